"""ModelManager: loading in workers, routing by id, modes, budget, unloading, concurrency."""

from __future__ import annotations

import asyncio
import random
import threading
import time

import numpy as np
import pytest

import llama_ctypes as lc
from llama_ctypes.engines.manager import manager as manager_module
from tiny_models import write_tiny_bert

MSG = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def bert_path(tmp_path_factory, vocab_dir):
    return write_tiny_bert(tmp_path_factory.mktemp("mm-bert") / "tiny-bert.gguf",
                           vocab_dir / "ggml-vocab-bert-bge.gguf", pooling=1)


@pytest.fixture(scope="module")
def rerank_path(tmp_path_factory, vocab_dir):
    return write_tiny_bert(tmp_path_factory.mktemp("mm-rerank") / "tiny-rerank.gguf",
                           vocab_dir / "ggml-vocab-bert-bge.gguf", pooling=4, seed=1)


@pytest.fixture
def track_models(monkeypatch):
    """Every Model the manager loads, to check none is leaked (each freed at the end)."""
    made: list[lc.Model] = []
    real = manager_module.load_model

    def tracking(path, **opts):
        model = real(path, **opts)
        made.append(model)
        return model

    monkeypatch.setattr(manager_module, "load_model", tracking)
    return made


class _Gate:
    """Holds every native model load (not the vocabulary probe) until ``release`` is set."""

    def __init__(self, monkeypatch):
        self.entered, self.release = threading.Event(), threading.Event()
        self._monkeypatch = monkeypatch
        self.real = manager_module.load_model  # (the tracking one, when track_models came first)

    def install(self) -> None:
        self._monkeypatch.setattr(manager_module, "load_model", self._slow)

    def uninstall(self) -> None:
        self._monkeypatch.setattr(manager_module, "load_model", self.real)

    def _slow(self, path, **opts):
        if not opts.get("vocab_only"):
            self.entered.set()
            self.release.wait(30)
        return self.real(path, **opts)


@pytest.fixture
def gate(monkeypatch):
    return _Gate(monkeypatch)


def test_routing_by_id_and_default_with_modes(tiny_model_path, bert_path, rerank_path, gemma_path, track_models):
    with lc.ModelManager() as mm:
        tiny = mm.load("tiny", tiny_model_path, n_parallel=2, n_ctx=256)
        bert = mm.load("bert", bert_path)
        rr = mm.load("rr", rerank_path)
        gemma = mm.load("gemma", gemma_path, n_parallel=2, n_ctx=1024, default=True)
        assert (tiny.mode, tiny.capabilities) == ("server", ("generate", "chat"))
        assert (bert.mode, bert.capabilities) == ("direct", ("embed",))
        assert (rr.mode, rr.capabilities) == ("direct", ("rerank",))
        assert gemma.default and mm.default == "gemma"
        # greedy through the manager (a batching server) = greedy on the bare model
        for id_ in ("tiny", "gemma"):
            routed = mm.generate(id_, "The capital of France is", max_tokens=12, temp=0)
            plain = lc.generate(mm.model(id_), "The capital of France is", max_tokens=12, temp=0)
            assert routed.tokens == plain.tokens
        assert mm.generate("default", "Hi", max_tokens=6, temp=0).tokens == \
            mm.generate("gemma", "Hi", max_tokens=6, temp=0).tokens
        mm.set_default("tiny")
        assert mm.generate("default", "Hi", max_tokens=4, temp=0).tokens == \
            mm.generate("tiny", "Hi", max_tokens=4, temp=0).tokens
        assert "".join(mm.stream("tiny", "Hi", max_tokens=4, temp=0)) == str(mm.generate("tiny", "Hi", max_tokens=4,
                                                                                        temp=0))
        # chat forms
        reply = mm.chat("gemma", MSG, max_tokens=6, temp=0, chat_template="gemma")
        assert isinstance(reply, str)
        done = mm.chat_completion("gemma", MSG, max_tokens=6, temp=0, chat_template="gemma")
        assert done["choices"][0]["message"]["content"] == reply
        chunks = list(mm.stream_chat_completion("gemma", MSG, max_tokens=6, temp=0, chat_template="gemma"))
        assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == reply
        # direct mode: embeddings and rerank equal the plain calls
        assert np.allclose(mm.embed("bert", ["a b", "c d"]), lc.embed(mm.model("bert"), ["a b", "c d"]))
        scores = mm.rerank("rr", "query", ["doc one", "doc two"])
        assert np.allclose(scores, lc.rerank(mm.model("rr"), "query", ["doc one", "doc two"]))
        # a capability a model lacks names the id and what it can do
        with pytest.raises(lc.InvalidArgumentError, match=r"'bert' cannot generate.*embed"):
            mm.generate("bert", "Hi")
        with pytest.raises(lc.InvalidArgumentError, match="'tiny' cannot embed"):
            mm.embed("tiny", "x")  # a server-mode model: its embedding context is not budgeted
        assert [i.id for i in mm.list()] == ["tiny", "bert", "rr", "gemma"]
        assert len({*mm.list(), *mm.list()}) == 4  # sanitised views: hashable, equal by value
        assert all(i.status == "ready" and i.estimated and i.placement for i in mm.list())
    assert track_models and all(m.freed for m in track_models)


def test_async_forms(tiny_model_path, bert_path):
    async def main(mm):
        text = await mm.agenerate("tiny", "Hi", max_tokens=4, temp=0)
        pieces = [p async for p in mm.astream("tiny", "Hi", max_tokens=4, temp=0)]
        reply = await mm.achat("tiny", MSG, max_tokens=4, temp=0, chat_template="chatml")
        chunks = [c async for c in mm.astream_chat_completion("tiny", MSG, max_tokens=4, temp=0,
                                                              chat_template="chatml")]
        vec = await mm.aembed("bert", "a b")
        return text, pieces, reply, chunks, vec

    with lc.ModelManager() as mm:
        mm.load("tiny", tiny_model_path, n_parallel=2, n_ctx=256)
        mm.load("bert", bert_path)
        text, pieces, reply, chunks, vec = asyncio.run(main(mm))
        assert "".join(pieces) == str(text) == str(mm.generate("tiny", "Hi", max_tokens=4, temp=0))
        assert reply == mm.chat("tiny", MSG, max_tokens=4, temp=0, chat_template="chatml")
        assert chunks and vec.shape == (mm.model("bert").n_embd_out,)


def test_budget_counts_resident_models(tiny_model_path, gemma_path):
    est_tiny = lc.estimate_memory(tiny_model_path, **lc.Server.context_options(2, 256))
    with lc.ModelManager(memory_budget=est_tiny.total * 2 + 2**20) as mm:
        info = mm.load("a", tiny_model_path, n_parallel=2, n_ctx=256)
        assert info.estimated == {"ram": est_tiny.total}
        assert info.actual and abs(info.actual["ram"] - est_tiny.total) <= 0.1 * est_tiny.total
        mm.load("b", tiny_model_path, n_parallel=2, n_ctx=256)
        with pytest.raises(lc.InsufficientMemoryError) as err:
            mm.load("c", tiny_model_path, n_parallel=2, n_ctx=256)
        assert err.value.device == "total" and err.value.required == est_tiny.total
        assert err.value.available < est_tiny.total
        assert mm.info("c").status == "failed" and "needs" in mm.info("c").error
        mm.unload("a")  # frees its share: c fits now (a failed id may be loaded again)
        assert mm.load("c", tiny_model_path, n_parallel=2, n_ctx=256).status == "ready"
    with lc.ModelManager(memory_budget={"ram": 64 * 2**20}) as mm:
        with pytest.raises(lc.InsufficientMemoryError) as err:
            mm.load("gemma", gemma_path)
        assert err.value.device == "ram"


def test_bad_input_leaves_the_manager_usable(tiny_model_path, tmp_path):
    with pytest.raises(lc.InvalidArgumentError):
        lc.ModelManager(memory_budget={"ram": -1})
    with pytest.raises(TypeError):
        lc.ModelManager(memory_budget={"gpu_ram": 1})
    with lc.ModelManager() as mm:
        with pytest.raises(KeyError):
            mm.generate("nope", "Hi")
        with pytest.raises(KeyError):
            mm.info("nope")
        with pytest.raises(KeyError):
            mm.generate("default", "Hi")  # nothing loaded
        with pytest.raises(TypeError):
            mm.load("x", 42)
        with pytest.raises(lc.InvalidArgumentError):
            mm.load("", tiny_model_path)
        with pytest.raises(FileNotFoundError):
            mm.load("missing", tmp_path / "missing.gguf")
        assert mm.info("missing").status == "failed"
        with pytest.raises(TypeError):
            mm.load("typo", tiny_model_path, n_ctx_typo=1)
        with pytest.raises(lc.InvalidArgumentError):
            mm.load("mode", tiny_model_path, mode="batch")
        mm.load("tiny", tiny_model_path, n_parallel=2, n_ctx=256)
        with pytest.raises(lc.AlreadyLoadedError):
            mm.load("tiny", tiny_model_path)
        with pytest.raises(lc.ModelNotReadyError):
            mm.generate("missing", "Hi")
        assert mm.generate("tiny", "Hi", max_tokens=3, temp=0).tokens


def test_unload_during_a_stream_ends_it_clearly(tiny_model_path, track_models):
    with lc.ModelManager() as mm:
        mm.load("tiny", tiny_model_path, n_parallel=2, n_ctx=512)
        held = mm.model("tiny")
        stream = mm.stream("tiny", "Once", max_tokens=400, temp=0.8, ignore_eos=True)
        next(iter(stream))
        mm.unload("tiny")
        with pytest.raises(lc.LlamaError):
            for _ in stream:
                pass
        with pytest.raises(lc.ClosedError):
            lc.generate(held, "Hi", max_tokens=2)
        assert not mm.loaded("tiny") and mm.list() == []
        mm.load("tiny", tiny_model_path, n_parallel=2, n_ctx=256)  # still usable
        assert mm.generate("tiny", "Hi", max_tokens=2, temp=0).tokens
    assert all(m.freed for m in track_models)


def test_a_slow_load_blocks_neither_list_nor_other_models(tiny_model_path, gate):
    with lc.ModelManager() as mm:
        mm.load("fast", tiny_model_path, n_parallel=1, n_ctx=256)
        gate.install()
        future = mm.load("slow", tiny_model_path, wait=False, n_parallel=1, n_ctx=256)
        t0 = time.monotonic()
        while mm.info("slow").status != "loading" or not mm.info("slow").estimated:
            time.sleep(0.01)  # it has reserved its memory and waits in the native load
        assert [i.status for i in mm.list()] == ["ready", "loading"]
        assert not mm.loaded("slow")
        assert mm.generate("fast", "Hi", max_tokens=2, temp=0).tokens
        mm.set_default("fast")
        assert time.monotonic() - t0 < 5
        gate.release.set()
        assert future.result(30).status == "ready" and mm.loaded("slow")


def test_unload_while_loading_frees_what_the_load_made(tiny_model_path, track_models, gate):
    gate.install()
    with lc.ModelManager() as mm:
        future = mm.load("x", tiny_model_path, wait=False, n_parallel=1, n_ctx=256)
        while not mm.info("x").estimated:
            time.sleep(0.01)
        mm.unload("x")
        gate.release.set()
        with pytest.raises(lc.ClosedError):
            future.result(30)
        assert mm.list() == []
    assert all(m.freed for m in track_models if m.params.vocab_only is False)


def test_an_unload_stops_a_load_as_cancelled_and_the_id_loads_again(tiny_model_path, track_models, gate):
    """An unload during a load is not a failure of the model: the load raises LoadCancelledError (a
    ClosedError), the id is free at once and a new load under it succeeds (issue 42)."""
    from llama_ctypes.engines.manager import LoadCancelledError

    gate.install()
    with lc.ModelManager() as mm:
        future = mm.load("x", tiny_model_path, wait=False, n_parallel=1, n_ctx=256)
        assert gate.entered.wait(30)
        mm.unload("x")
        assert mm.list() == []
        gate.release.set()
        with pytest.raises(LoadCancelledError, match="unloaded while it loaded"):
            future.result(30)
        assert isinstance(future.exception(), lc.ClosedError)
        assert mm.load("x", tiny_model_path, n_parallel=1, n_ctx=256).status == "ready"
        assert mm.generate("x", "Hi", max_tokens=2, temp=0).tokens
    assert all(m.freed for m in track_models)


def test_a_cancelled_queued_load_leaves_no_entry_loading(tiny_model_path, gate):
    """A queued load whose Future is cancelled (a client that stopped waiting) never runs: its id leaves the
    registry instead of staying ``loading`` for ever, its waiters wake, and the id loads again."""
    from llama_ctypes.engines.manager import LoadCancelledError

    gate.install()
    with lc.ModelManager(workers=1) as mm:
        first = mm.load("a", tiny_model_path, wait=False, n_parallel=1, n_ctx=128)
        assert gate.entered.wait(30)
        queued = mm.load("b", tiny_model_path, wait=False, n_parallel=1, n_ctx=128)
        entry = mm._entries["b"]
        assert queued.cancel()
        assert [i.id for i in mm.list()] == ["a"] and entry.done.is_set()
        assert isinstance(entry.error, LoadCancelledError)
        with pytest.raises(KeyError):
            mm.info("b")
        gate.release.set()
        assert first.result(30).status == "ready"
        gate.uninstall()
        assert mm.load("b", tiny_model_path, n_parallel=1, n_ctx=128).status == "ready"


def test_many_threads_load_unload_and_route(tiny_model_path, track_models):
    ids = ["m0", "m1", "m2"]
    errors: list[BaseException] = []
    done: dict[str, int] = {}
    stop = time.monotonic() + 8
    with lc.ModelManager(workers=3) as mm:
        def worker(seed: int) -> None:
            rng = random.Random(seed)
            while time.monotonic() < stop:
                id_ = rng.choice(ids)
                action = rng.choice(["load", "load", "load", "unload", "generate", "generate", "list", "info"])
                try:
                    if action == "load":
                        mm.load(id_, tiny_model_path, n_parallel=1, n_ctx=128)
                    elif action == "unload":
                        mm.unload(id_)
                    elif action == "generate":
                        mm.generate(id_, "Hi", max_tokens=2, temp=0)
                    elif action == "list":
                        mm.list()
                    else:
                        mm.info(id_)
                    done[action] = done.get(action, 0) + 1
                except (KeyError, lc.AlreadyLoadedError, lc.ClosedError, lc.ServerClosedError,
                        lc.ModelNotReadyError):
                    pass  # the races the API defines: gone, already there, closed under us
                except BaseException as exc:  # anything else is a defect
                    errors.append(exc)

        threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]  # (a deadlock fails)
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not any(t.is_alive() for t in threads), "deadlock"
    assert errors == []
    assert done.get("load", 0) > 2 and done.get("unload", 0) > 2 and done.get("generate", 0) > 2, done
    assert track_models and all(m.freed for m in track_models)


def test_closed_under_load_by_eight_threads(tiny_model_path, track_models):
    """close() while 8 threads load, unload, generate and stream: it returns, every thread ends with the
    API's own errors only, and every model loaded is freed."""
    ids = ["m0", "m1", "m2"]
    errors: list[BaseException] = []
    ops: dict[str, int] = {}
    mm = lc.ModelManager(workers=3)
    closed = threading.Event()

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        while True:
            id_ = rng.choice(ids)
            action = rng.choice(["load", "load", "unload", "generate", "stream", "list"])
            try:
                if action == "load":
                    mm.load(id_, tiny_model_path, n_parallel=2, n_ctx=128)
                elif action == "unload":
                    mm.unload(id_)
                elif action == "generate":
                    mm.generate(id_, "Hi", max_tokens=3, temp=0)
                elif action == "stream":
                    for i, _ in enumerate(mm.stream(id_, "Tell", max_tokens=12, ignore_eos=True)):
                        if i == 2:
                            break
                else:
                    mm.list()
                ops[action] = ops.get(action, 0) + 1
            except lc.ClosedError:
                if closed.is_set():
                    return
            except (KeyError, lc.AlreadyLoadedError, lc.ModelNotReadyError):
                pass
            except BaseException as exc:  # anything else is a defect
                errors.append(exc)
                return
            if closed.is_set() and rng.random() < 0.2:
                return  # (some threads keep calling into the closed manager a while)

    threads = [threading.Thread(target=worker, args=(i,), daemon=True) for i in range(8)]  # (a deadlock fails)
    for t in threads:
        t.start()
    time.sleep(4)
    t0 = time.monotonic()
    mm.close()  # under load
    closed.set()
    assert time.monotonic() - t0 < 30
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "deadlock"
    assert errors == [], errors
    assert ops.get("load", 0) > 1 and ops.get("generate", 0) + ops.get("stream", 0) > 1, ops
    assert track_models and all(m.freed for m in track_models)
    with pytest.raises(lc.ClosedError):
        mm.load("late", tiny_model_path)


def test_direct_mode_generative_model_fixes_its_contexts(tiny_model_path):
    with lc.ModelManager() as mm:
        info = mm.load("d", tiny_model_path, mode="direct", n_ctx=256, n_batch=64)
        assert info.mode == "direct" and info.capabilities == ("generate", "chat", "embed")
        # both contexts it will make are in the estimate: generation (n_ctx, n_batch as given) and embedding
        gen = lc.estimate_memory(tiny_model_path, n_ctx=256, n_batch=64, n_ubatch=64)
        emb = lc.estimate_memory(tiny_model_path, n_ctx=64, n_batch=64, n_ubatch=64, n_seq_max=64, kv_unified=True,
                                 embeddings=True, flash_attn="disabled")
        assert sum(info.estimated.values()) == gen.total + emb.context + emb.compute
        out = mm.generate("d", "Hi", max_tokens=3, temp=0)
        assert out.tokens == lc.generate(mm.model("d"), "Hi", max_tokens=3, temp=0, n_ctx=256).tokens
        with pytest.raises(TypeError, match="server mode only"):
            mm.load("d3", tiny_model_path, mode="direct", n_parallel=4)
        assert mm.load("b2", tiny_model_path, mode="direct", n_ubatch=32, n_batch=64).status == "ready"
        assert mm.embed("b2", "a").ndim == 1  # n_ubatch is generate()'s; embed sets its own
        assert mm.embed("d", ["a", "b"]).shape[0] == 2
        with pytest.raises(TypeError, match="fixed when model 'd' is loaded"):
            mm.generate("d", "Hi", n_ctx=8192)
        with pytest.raises(TypeError, match="fixed"):
            mm.embed("d", "a", n_batch=4096)
        with pytest.raises(TypeError):
            mm.load("d2", tiny_model_path, mode="direct", temp=0.5)  # request defaults are server-mode
        with pytest.raises(lc.InvalidArgumentError):
            mm.load("v", tiny_model_path, vocab_only=True)


def test_memory_of_an_unloaded_loading_model_counts_until_freed(tiny_model_path, track_models, gate):
    est = lc.estimate_memory(tiny_model_path, **lc.Server.context_options(1, 256)).total
    gate.install()
    with lc.ModelManager(memory_budget=est + est // 2) as mm:
        future = mm.load("x", tiny_model_path, wait=False, n_parallel=1, n_ctx=256)
        assert gate.entered.wait(30)
        mm.unload("x")
        assert mm.used().total() == est  # still being built: still counted
        gate.release.set()
        with pytest.raises(lc.ClosedError):
            future.result(30)
        assert mm.used().total() == 0
        gate.uninstall()
        assert mm.load("y", tiny_model_path, n_parallel=1, n_ctx=256).status == "ready"
    assert all(m.freed for m in track_models)


def test_cancelling_an_async_stream_cancels_it(tiny_model_path):
    async def main(mm):
        async def consume():
            async for _ in mm.astream_chat_completion("t", MSG, max_tokens=2000, temp=0.8, ignore_eos=True,
                                                      chat_template="chatml"):
                await asyncio.sleep(0)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    with lc.ModelManager() as mm:
        mm.load("t", tiny_model_path, n_parallel=1, n_ctx=4096)
        asyncio.run(main(mm))
        # the slot is free again: a new request is served at once
        t0 = time.monotonic()
        assert mm.generate("t", "Hi", max_tokens=2, temp=0).tokens
        assert time.monotonic() - t0 < 10


def test_default_follows_loads_and_failures(tiny_model_path, tmp_path):
    with lc.ModelManager() as mm:
        with pytest.raises(FileNotFoundError):
            mm.load("bad", tmp_path / "missing.gguf", default=True)
        assert mm.default is None
        mm.load("a", tiny_model_path, n_parallel=1, n_ctx=128)
        mm.load("b", tiny_model_path, n_parallel=1, n_ctx=128, default=True)
        assert mm.default == "b" and mm.info("b").default
        mm.unload("b")
        assert mm.default == "a"


def test_hub_source(tiny_model_path, tmp_path, monkeypatch):
    from fake_hub import FakeHub, Repo

    with FakeHub() as fake:
        fake.state.repos["acme/tiny-GGUF"] = Repo(files={"tiny-Q8_0.gguf": tiny_model_path.read_bytes()})
        monkeypatch.setenv("HF_ENDPOINT", fake.url)
        monkeypatch.setenv("LLAMA_CTYPES_MODELS_DIR", str(tmp_path / "cache"))
        for var in ("HF_TOKEN", "LLAMA_OFFLINE", "HF_HUB_OFFLINE"):
            monkeypatch.delenv(var, raising=False)
        with lc.ModelManager() as mm:
            info = mm.load("hubbed", ("hub", "acme/tiny-GGUF", "tiny-Q8_0.gguf"), n_parallel=1, n_ctx=128)
            assert info.source == "hub:acme/tiny-GGUF/tiny-Q8_0.gguf" and info.status == "ready"
            assert mm.generate("hubbed", "Hi", max_tokens=3, temp=0).tokens == \
                lc.generate(mm.model("hubbed"), "Hi", max_tokens=3, temp=0).tokens
            # (no file: chosen by the tag, as llama-server's -hf owner/name:quant)
            chosen = mm.load("tagged", ("hub", "acme/tiny-GGUF:Q8_0", None), n_parallel=1, n_ctx=128)
            assert chosen.source == "hub:acme/tiny-GGUF:Q8_0" and chosen.status == "ready"
            with pytest.raises(lc.HubNotFoundError):
                mm.load("nope", ("hub", "acme/tiny-GGUF", "missing.gguf"))
            with pytest.raises(lc.HubNotFoundError):
                mm.load("nope", ("hub", "acme/tiny-GGUF:Q5_K", None))
            with pytest.raises(ValueError):
                mm.load("badrepo", ("hub", "not a repo", "x.gguf"))


def test_a_model_handed_in_is_used_not_owned(tiny_model_path):
    with lc.load_model(tiny_model_path) as model:
        with lc.ModelManager() as mm:
            info = mm.load("mine", model, n_parallel=1, n_ctx=256)
            assert info.source == f"model:{model.path}"
            full = lc.estimate_memory(tiny_model_path, **lc.Server.context_options(1, 256))
            # its weights are resident already: only the server's context is charged
            assert sum(info.estimated.values()) == full.total
            assert mm.used().total() == full.context + full.compute
            with pytest.raises(TypeError):
                mm.load("again", model, n_gpu_layers=0)  # model options need a path
            mm.unload("mine")
        assert not model.closed
        assert lc.generate(model, "Hi", max_tokens=2, temp=0).tokens


def test_models_at_construction(tiny_model_path, tmp_path):
    specs = [{"id": "a", "source": tiny_model_path, "n_parallel": 1, "n_ctx": 128},
             {"id": "b", "source": tiny_model_path, "n_parallel": 1, "n_ctx": 128, "default": True}]
    with lc.ModelManager(models=specs) as mm:
        assert [i.id for i in mm.list()] == ["a", "b"] and mm.default == "b"
    with pytest.raises(TypeError):
        lc.ModelManager(models=[{"source": tiny_model_path}])
    with pytest.raises(FileNotFoundError):  # a failing entry fails the constructor, after freeing the rest
        lc.ModelManager(models=[specs[0], {"id": "x", "source": tmp_path / "missing.gguf"}])


def test_metadata_overrides_decide_the_capabilities(bert_path):
    with lc.ModelManager() as mm:
        assert mm.load("e", bert_path).capabilities == ("embed",)
        ranked = mm.load("r", bert_path, kv_overrides={"bert.pooling_type": 4})  # 4: rank
        assert ranked.capabilities == ("rerank",) and ranked.mode == "direct"


def test_close_from_a_worker_wakes_every_waiter(tiny_model_path, gate):
    gate.install()
    mm = lc.ModelManager(workers=1)
    first = mm.load("a", tiny_model_path, wait=False, n_parallel=1, n_ctx=128)
    queued = mm.load("b", tiny_model_path, wait=False, n_parallel=1, n_ctx=128)
    outcome: list[BaseException] = []

    def waiter():
        try:
            mm.generate("b", "Hi", max_tokens=1)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=waiter)
    t.start()
    first.add_done_callback(lambda _f: mm.close())  # runs in the load worker
    gate.release.set()
    t.join(30)
    assert not t.is_alive() and outcome and isinstance(outcome[0], lc.ClosedError)
    assert queued.cancelled()


def test_close_wakes_the_waiters_of_a_queued_load_that_was_unloaded(tiny_model_path, gate):
    """A load queued behind a slow one, unloaded while queued, then cancelled by close(): whoever
    waited for it (looked up before the unload) gets ClosedError instead of waiting forever."""
    gate.install()
    mm = lc.ModelManager(workers=1)
    mm.load("a", tiny_model_path, wait=False, n_parallel=1, n_ctx=128)
    assert gate.entered.wait(30)
    queued = mm.load("b", tiny_model_path, wait=False, n_parallel=1, n_ctx=128)
    outcome: list[BaseException] = []
    looked_up = threading.Event()
    real_entry = mm._entry

    def entry_then_signal(id, wait):  # signals once the waiter holds the entry, before it waits
        if not wait:
            return real_entry(id, wait)
        found = real_entry(id, False)
        looked_up.set()
        found.done.wait()
        return found

    mm._entry = entry_then_signal

    def waiter():
        try:
            mm.generate("b", "Hi", max_tokens=1)
        except BaseException as exc:
            outcome.append(exc)

    t = threading.Thread(target=waiter, daemon=True)
    t.start()
    assert looked_up.wait(30)
    mm.unload("b")  # still queued: its worker would free it, but it will never run
    closer = threading.Thread(target=mm.close, daemon=True)
    closer.start()
    gate.release.set()
    closer.join(30)
    t.join(30)
    assert not closer.is_alive() and not t.is_alive(), "a waiter was never woken"
    assert outcome and isinstance(outcome[0], lc.ClosedError), outcome
    assert queued.cancelled()
    assert mm.used().total() == 0


def test_server_accessor_gives_the_batching_server_of_server_mode_models(tiny_model_path, bert_path):
    with lc.ModelManager() as mm:
        mm.load("gen", tiny_model_path, n_parallel=2, n_ctx=256)
        mm.load("emb", bert_path)  # direct mode (an embedding model)
        server = mm.server("gen")
        assert server is mm.server("default") and isinstance(server, lc.Server)
        assert server.generate("Hello", max_tokens=4, temp=0).tokens == mm.generate("gen", "Hello", max_tokens=4,
                                                                                   temp=0).tokens
        with pytest.raises(lc.InvalidArgumentError, match="direct mode"):
            mm.server("emb")
        with pytest.raises(KeyError):
            mm.server("nope")
        mm.unload("gen")
        with pytest.raises(lc.ClosedError):
            server.generate("Hello", max_tokens=1)


def test_a_failed_server_load_closes_the_drafter_it_was_handed(tiny_model_path):
    """speculative= hands a Drafter over to the model's Server; a load refused for a bad server setting
    closes it (as the Server itself does) and shows as failed."""
    drafter = lc.DraftModel(tiny_model_path)
    with lc.ModelManager() as mm:
        with pytest.raises(lc.InvalidArgumentError, match="n_draft"):
            mm.load("s", tiny_model_path, mode="server", n_parallel=1, n_ctx=128, speculative=drafter, n_draft=0)
        assert drafter.closed
        assert [(i.id, i.status) for i in mm.list()] == [("s", "failed")]
