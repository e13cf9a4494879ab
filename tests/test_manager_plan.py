"""The manager's load plan (engines/manager/plan.py): mode, options and context runs, without a model."""

import pytest

from llama_ctypes.core.memory import DeviceMemory, MemoryUsage
from llama_ctypes.engines.manager.budget import Footprint
from llama_ctypes.engines.manager.plan import LoadPlan, charge
from llama_ctypes.engines.server.server import Server
from llama_ctypes.errors import ArgumentTypeError, InvalidArgumentError

GEN = ("generate", "chat")


def test_generative_models_default_to_server_mode_with_the_servers_context():
    plan = LoadPlan.make("m", GEN, None, {"n_parallel": 2, "n_ctx": 512, "max_queue": 9}, {"type_k": "q8_0"},
                         {"temp": 0})
    assert plan.mode == "server" and plan.capabilities == GEN
    assert plan.context_runs() == [Server.context_options(n_parallel=2, n_ctx=512, type_k="q8_0")]
    assert plan.server_opts["max_queue"] == 9 and plan.defaults == {"temp": 0}


def test_embedding_models_default_to_direct_mode_and_cannot_serve():
    plan = LoadPlan.make("e", ("embed",), None, {}, {}, {})
    assert plan.mode == "direct" and plan.capabilities == ("embed",)
    (run,) = plan.context_runs()
    assert run["embeddings"] is True and run["n_ctx"] == run["n_batch"] == 2048
    with pytest.raises(InvalidArgumentError, match="cannot run in server mode"):
        LoadPlan.make("e", ("rerank",), "server", {}, {}, {})


def test_a_generative_model_in_direct_mode_also_embeds_in_a_second_context():
    plan = LoadPlan.make("g", GEN, "direct", {"n_ctx": 1024, "n_batch": 256}, {"type_k": "q8_0", "pooling": "mean"},
                         {})
    assert plan.capabilities == (*GEN, "embed")
    assert plan.call_opts == {"n_ctx": 1024, "n_batch": 256, "n_ubatch": 256, "type_k": "q8_0", "pooling": "mean"}
    assert plan.embed_opts == {"type_k": "q8_0"} and plan.embed_pooling == "mean" and plan.embed_batch == 256
    gen, emb = plan.context_runs()
    assert gen == plan.call_opts
    assert emb["n_ctx"] == emb["n_batch"] == emb["n_ubatch"] == 256 and emb["pooling"] == "mean"


def test_direct_mode_refuses_server_settings_and_request_defaults():
    with pytest.raises(ArgumentTypeError, match="max_queue"):
        LoadPlan.make("g", GEN, "direct", {"max_queue": 3}, {}, {})
    with pytest.raises(ArgumentTypeError, match="temp"):
        LoadPlan.make("g", GEN, "direct", {}, {}, {"temp": 0.5})
    with pytest.raises(ArgumentTypeError, match="no effect on an embedding model"):
        LoadPlan.make("e", ("embed",), None, {"n_ctx": 4096}, {}, {})


def _usage(model, context, compute, endpoint=None):
    return DeviceMemory("CPU", 0, None, model, context, compute, endpoint)


def test_charge_counts_the_weights_once_and_never_an_rpc_workers_memory():
    first = MemoryUsage((_usage(100, 10, 5), _usage(50, 0, 0, endpoint="10.0.0.2:50052")))
    second = MemoryUsage((_usage(100, 20, 7),))
    estimate, required = charge([first, second], weights=True)
    assert required == Footprint({"ram": 100 + 10 + 5 + 20 + 7})
    assert sum(d.model for d in estimate.devices) == 150  # the second run's weights are the same weights
    _, resident = charge([first, second], weights=False)  # a Model handed in: its contexts only
    assert resident == Footprint({"ram": 10 + 5 + 20 + 7})


def test_charge_puts_adapters_and_a_projector_beside_the_weights():
    offloaded = MemoryUsage((_usage(10, 1, 1), DeviceMemory("CUDA0", 1, 0, 500, 20, 30)))
    _, required = charge([offloaded], weights=True, adapters=7, projector=40, projector_pool=("gpu", 0))
    assert required == Footprint({"ram": 12, ("gpu", 0): 550 + 7 + 40})
    _, on_cpu = charge([offloaded], weights=True, projector=40)  # --no-mmproj-offload
    assert on_cpu == Footprint({"ram": 12 + 40, ("gpu", 0): 550})
