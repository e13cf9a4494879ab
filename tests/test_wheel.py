"""The prebuilt wheel: installed with no compiler, run read-only and offline.

The base wheel and the RPC plugin wheel are built once per session by
build_scripts/build_wheel.py (the run-time-dispatched libraries come from the
build cache; the first build compiles every CPU variant). They are installed
into a fresh virtual environment whose PATH holds no compiler or build tool,
from local files only, and every check runs in that environment's Python from
a read-only install folder with the network blocked.
"""

from __future__ import annotations

import json
import os
import platform
import re
import shlex
import shutil
import stat
import subprocess
import sys
import textwrap
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_scripts"))

import build_wheel  # noqa: E402
from margins import assert_same_greedy  # noqa: E402

pytestmark = [
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the wheel test builds Linux wheels"),
    # The first build of the run-time-dispatched libraries compiles every CPU variant.
    pytest.mark.timeout(3600),
]

BUILD_TOOLS = ("cc", "gcc", "g++", "c++", "clang", "cmake", "ninja", "make", "ld")

# Prepended to every script run in the fresh environment: no network at all.
_OFFLINE = textwrap.dedent(
    """
    import socket
    def _no_network(*args, **kwargs):
        raise OSError("network disabled by the wheel test")
    socket.socket.connect = _no_network
    socket.create_connection = _no_network
    socket.getaddrinfo = _no_network
    """
)

# ...and the package folder must really be read-only (permission bits, or a read-only mount for root).
_READ_ONLY_PROBE = textwrap.dedent(
    """
    import importlib.util, pathlib
    _lib = pathlib.Path(importlib.util.find_spec("llama_ctypes").origin).parent / "lib"
    try:
        (_lib / "probe").write_text("x")
    except OSError:
        pass
    else:
        raise SystemExit("the install folder is writable")
    """
)


#: A folder of prebuilt wheels to test instead of building them: tests/test_arm64.py runs this module in an
#: emulated arm64 root on the aarch64 wheels cross-built on the x86-64 host.
PREBUILT_WHEELS_ENV = "LLAMA_CTYPES_TEST_WHEELS"


@pytest.fixture(scope="session")
def wheels(tmp_path_factory) -> dict[str, Path]:
    prebuilt = os.environ.get(PREBUILT_WHEELS_ENV)
    if prebuilt:
        machine = platform.machine()
        found = {kind: sorted(Path(prebuilt).glob(f"{prefix}-*{machine}.whl"))
                 for kind, prefix in (("base", "llama_ctypes"), ("rpc", "llama_ctypes_rpc"))}
        missing = [kind for kind, paths in found.items() if not paths]
        assert not missing, f"${PREBUILT_WHEELS_ENV}={prebuilt}: no {machine} wheel for {missing}"
        return {kind: paths[-1] for kind, paths in found.items()}
    out = tmp_path_factory.mktemp("wheelhouse")
    return {"base": build_wheel.build_base_wheel(out), "rpc": build_wheel.build_plugin_wheel("rpc", out)}


def _requirements(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as zf:
        meta = next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))
        message = Parser().parsestr(zf.read(meta).decode())
    return [r for r in message.get_all("Requires-Dist") or [] if "extra ==" not in r]


@pytest.fixture(scope="session")
def venv(wheels, tmp_path_factory) -> dict:
    """A fresh virtual environment with the wheels installed offline, without build tools."""
    root = tmp_path_factory.mktemp("wheel-venv")
    deps = root / "deps"
    # The dependencies' wheels are fetched beforehand: the install itself is offline.
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--only-binary=:all:", "--dest", str(deps),
         *_requirements(wheels["base"])],
        check=True,
    )
    env_dir = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(env_dir)], check=True)
    bindir = env_dir / "bin"
    env = {
        "PATH": str(bindir),
        "HOME": str(root / "home"),
        "CC": "/bin/false",
        "CXX": "/bin/false",
        "PIP_NO_INDEX": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "LANG": "C.UTF-8",
    }
    if "QEMU_CPU" in os.environ:  # (under qemu-user: the children run on the CPU emulated for this run)
        env["QEMU_CPU"] = os.environ["QEMU_CPU"]
    for tool in BUILD_TOOLS:
        assert shutil.which(tool, path=env["PATH"]) is None, f"{tool} is on the test PATH"
    python = str(bindir / "python")
    subprocess.run(
        [python, "-m", "pip", "install", "--quiet", "--no-index", "--find-links", str(deps),
         str(wheels["base"]), str(wheels["rpc"])],
        check=True, env=env,
    )
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, env=env, capture_output=True, text=True).stdout.strip())
    installed = [site / "llama_ctypes", site / "llama_ctypes.libs", site / "llama_ctypes_rpc"]
    for folder in installed:
        _set_writable(folder, False)
    yield {"python": python, "env": env, "site": site, "root": root, "installed": installed}
    for folder in installed:
        _set_writable(folder, True)


# Absolute paths: the fresh environment's PATH holds only its own bin/.
_UNSHARE, _SH, _MOUNT = (shutil.which(t) or t for t in ("unshare", "sh", "mount"))


def _can_bind_read_only() -> bool:
    try:
        probe = subprocess.run([_UNSHARE, "--mount", _SH, "-c", f"{_MOUNT} --bind -o ro /tmp /tmp"],
                               capture_output=True)
    except OSError:
        return False
    return probe.returncode == 0


def _venv_command(venv: dict, args: list[str]) -> list[str]:
    """args run in the fresh environment with the installed folders read-only.

    Permission bits do not stop root, so as root the folders are bind-mounted
    read-only in a private mount namespace.
    """
    if os.geteuid() != 0:
        return args
    if not _can_bind_read_only():
        pytest.fail("running as root without mount namespaces: cannot make the install read-only")
    mounts = " && ".join(f"{_MOUNT} --bind -o ro {shlex.quote(str(f))} {shlex.quote(str(f))}"
                         for f in venv["installed"] if f.exists())
    return [_UNSHARE, "--mount", _SH, "-c", f"{mounts} && exec \"$@\"", "sh", *args]


def _snapshot(folders: list[Path]) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for f in folders if f.exists() for p in f.rglob("*")}


def _set_writable(folder: Path, writable: bool) -> None:
    if not folder.exists():
        return
    for path in [folder, *folder.rglob("*")]:
        mode = path.stat().st_mode
        bits = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
        path.chmod(mode | stat.S_IWUSR if writable else mode & ~bits)


def run_in_venv(venv: dict, script: str, **env: str) -> dict:
    """Run script (which prints one JSON line last) offline in the fresh environment."""
    return _run_script(venv, script, env)


def _run_script(venv: dict, script: str, env: dict[str, str], args: tuple[str, ...] = ()) -> dict:
    before = _snapshot(venv["installed"])
    proc = subprocess.run(
        _venv_command(venv, [venv["python"], "-c", _OFFLINE + _READ_ONLY_PROBE + textwrap.dedent(script), *args]),
        env={**venv["env"], **env}, cwd=venv["root"], capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert _snapshot(venv["installed"]) == before, "the run wrote into the install folder"
    return json.loads(proc.stdout.strip().splitlines()[-1])


GENERATE = """
    import json, sys, logging
    native_lines = []
    class Keep(logging.Handler):
        def emit(self, record):
            native_lines.append(record.getMessage())
    logging.getLogger("llama_ctypes.llama_cpp").addHandler(Keep())
    logging.getLogger("llama_ctypes.llama_cpp").setLevel(logging.DEBUG)
    import llama_ctypes as lc
    results = {"file": lc.__file__, "version": lc.version_info().__dict__,
               "backends": [b.__dict__ for b in lc.loaded_backends()], "info": lc.system_info()}
    for name, path in json.loads(sys.argv[1] if len(sys.argv) > 1 else MODELS).items():
        with lc.load_model(path) as model:
            out = lc.generate(model, PROMPT, max_tokens=MAX_TOKENS, temp=0.0, logprobs=2)
            results[name] = {"text": str(out), "tokens": list(out.tokens), "finish": out.finish_reason,
                             "top": [[(t.token, t.logprob) for t in e.top] for e in out.logprobs]}
    # llama.cpp names the buffer types it puts weights in ("AMX model buffer size = ...").
    results["buffer_lines"] = [line for line in native_lines if "model buffer size" in line]
    results["amx_lines"] = [line for line in native_lines if "AMX" in line]
    print(json.dumps(results))
"""


def _generate(venv, models: dict[str, Path], max_tokens: int = 24, **env) -> dict:
    script = (
        f"MODELS = {json.dumps(json.dumps({k: str(v) for k, v in models.items()}))}\n"
        f"PROMPT = 'The capital of France is'\nMAX_TOKENS = {max_tokens}\n" + textwrap.dedent(GENERATE)
    )
    return run_in_venv(venv, script, **env)


EXPECTED_VARIANTS = {
    "x86_64": {"x64", "sse42", "haswell", "skylakex", "icelake", "zen4", "sapphirerapids"},
    "aarch64": {"armv8.0_1", "armv8.2_1", "armv8.2_2", "armv8.2_3", "armv8.6_1", "armv8.6_2", "armv9.2_1", "armv9.2_2"},
}


def test_wheel_is_manylinux_and_self_contained(wheels):
    base = wheels["base"]
    assert base.name.startswith("llama_ctypes-") and "-py3-none-manylinux_" in base.name, base.name
    with zipfile.ZipFile(base) as zf:
        names = zf.namelist()
    libs = [n for n in names if n.startswith("llama_ctypes/lib/")]
    variants = {n.rsplit("/", 1)[1][len("libggml-cpu-"):-3] for n in libs if "/libggml-cpu-" in n}
    assert EXPECTED_VARIANTS[platform.machine()] <= variants
    assert "llama_ctypes/lib/LICENSE.llama.cpp.txt" in names
    assert not any("ggml-rpc" in n for n in names)  # RPC ships in its plugin
    assert "llama_ctypes/lib/build_info.json" in names
    assert "llama_ctypes/lib/libmtmd.so" in names or platform.system() != "Linux"  # images and audio
    page = {n.rsplit("/", 1)[1] for n in names if n.startswith("llama_ctypes/interfaces/http/webui/")}
    assert {"index.html", "app.js", "api.js", "markdown.js", "highlight.js", "store.js", "style.css"} <= page
    proc = subprocess.run([sys.executable, "-m", "auditwheel", "show", str(base)], capture_output=True, text=True)
    assert proc.returncode == 0 and "manylinux_" in proc.stdout, proc.stdout + proc.stderr
    with zipfile.ZipFile(wheels["rpc"]) as zf:
        plugin_names = zf.namelist()
    assert any(n.endswith("libggml-rpc.so") for n in plugin_names)
    assert not any("libggml-base" in n for n in plugin_names)  # the base package provides it


def test_plugin_requires_the_same_base_version(wheels):
    from llama_ctypes import __version__

    assert f"llama_ctypes=={__version__}" in _requirements(wheels["rpc"])


def test_install_without_compiler_generates_offline_from_read_only_folder(venv, tiny_model_path, gemma_path):
    res = _generate(venv, {"tiny": tiny_model_path, "gemma": gemma_path})
    assert res["file"].startswith(str(venv["site"])), res["file"]  # the wheel, not the checkout
    for name in ("tiny", "gemma"):
        assert res[name]["finish"] in ("length", "eog")
        assert res[name]["tokens"] and (res[name]["finish"] == "eog" or len(res[name]["tokens"]) == 24)
    assert res["gemma"]["text"].strip()
    # No AMX kernels: on an AMX CPU (Sapphire Rapids and later) the best variant is
    # sapphirerapids, and Gemma is a Q4_K model (llama.cpp #20824 crashed there).
    assert res["buffer_lines"] and res["amx_lines"] == []
    # The CPU came from a variant module of the package, chosen at run time.
    cpu = [b for b in res["backends"] if b["name"] == "CPU"]
    assert len(cpu) == 1 and cpu[0]["variant"] and cpu[0]["origin"] == "package"
    assert cpu[0]["path"].startswith(str(venv["site"] / "llama_ctypes" / "lib"))
    assert res["version"]["cpu_variant"] == cpu[0]["variant"]
    assert f"variant {cpu[0]['variant']}" in res["info"]
    # The RPC plugin wheel was found through its entry point, without configuration.
    rpc = [b for b in res["backends"] if b["name"] == "RPC"]
    assert rpc and rpc[0]["origin"].startswith("plugin llama-ctypes-rpc ")
    assert rpc[0]["path"].startswith(str(venv["site"] / "llama_ctypes_rpc"))


def test_wheel_reads_images(venv, tiny_model_path, tmp_path):
    """libmtmd ships in the wheel and decodes an image file, with nothing but the wheel installed."""
    from tiny_models import write_tiny_mmproj

    mmproj = write_tiny_mmproj(tmp_path / "mmproj.gguf")
    image = tmp_path / "image.bmp"  # (BMP: written here without an imaging library)
    width, height = 6, 4
    row = bytes(range(width * 3)) + b"\0" * (-width * 3 % 4)
    header = (b"BM" + (54 + len(row) * height).to_bytes(4, "little") + b"\0\0\0\0" + (54).to_bytes(4, "little")
              + (40).to_bytes(4, "little") + width.to_bytes(4, "little") + height.to_bytes(4, "little")
              + (1).to_bytes(2, "little") + (24).to_bytes(2, "little") + b"\0" * 24)
    image.write_bytes(header + row * height)
    script = f"""
        import json
        import llama_ctypes as lc
        with lc.load_model({str(tiny_model_path)!r}, mmproj={str(mmproj)!r}) as model:
            out = lc.generate(model, "See " + lc.MEDIA_MARKER + " now", media=[{str(image)!r}], max_tokens=3, temp=0.0)
            print(json.dumps({{"modalities": sorted(model.modalities), "prompt": out.prompt_tokens,
                               "tokens": list(out.tokens)}}))
    """
    res = run_in_venv(venv, script)
    assert res["modalities"] == ["vision"] and res["prompt"] > 16 and len(res["tokens"]) == 3


def _variant_of(res: dict) -> str:
    return next(b["variant"] for b in res["backends"] if b["name"] == "CPU")


def test_lower_cpu_variant_gives_the_same_greedy_text(venv, gemma_path):
    best = _generate(venv, {"gemma": gemma_path}, max_tokens=32)
    lowers = ("armv8.0_1", "armv8.2_1") if platform.machine() == "aarch64" else ("haswell", "sse42", "x64")
    lower = next(v for v in lowers if v != _variant_of(best))
    forced = _generate(venv, {"gemma": gemma_path}, max_tokens=32, LLAMA_CTYPES_CPU_VARIANT=lower)
    assert _variant_of(forced) == lower != _variant_of(best)
    # other kernels, other rounding: the same greedy tokens up to a near tie (margins.py)
    n = assert_same_greedy(forced["gemma"]["tokens"], best["gemma"]["tokens"], best["gemma"]["top"],
                           what=f"{lower} vs {_variant_of(best)}")
    assert n >= 4, f"diverged at token {n}: 'The capital of France is' starts with clear margins"


def _cpu_flags() -> set[str]:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@pytest.mark.skipif(platform.machine() != "x86_64", reason="AMX is an x86 extension")
def test_amx_kernels_are_left_out(venv, wheels, tmp_path):
    with zipfile.ZipFile(wheels["base"]) as zf:
        zf.extract("llama_ctypes/lib/libggml-cpu-sapphirerapids.so", tmp_path)
    lib = tmp_path / "llama_ctypes" / "lib" / "libggml-cpu-sapphirerapids.so"
    objdump = shutil.which("objdump")
    if objdump:  # binutils comes with the compiler CI has; no AMX tile instruction in the variant
        listing = subprocess.run([objdump, "-d", "--no-show-raw-insn", str(lib)], capture_output=True,
                                 text=True, check=True).stdout
        assert re.search(r"\b(ldtilecfg|tileloadd|tdpbssd|tdpbusd|tdpbf16ps)\b", listing) is None
        assert "vdpbf16ps" in listing or "vcvtne2ps2bf16" in listing  # it is the AVX-512 BF16 build
    res = run_in_venv(venv, """
        import json, llama_ctypes as lc
        print(json.dumps({"variant": next(b.variant for b in lc.loaded_backends() if b.variant)}))
    """)
    if {"amx_int8", "amx_tile", "avx512_fp16", "avx_vnni"} <= _cpu_flags():
        # this machine is an AMX CPU: the variant built for it runs (without the AMX kernels)
        assert res["variant"] == "sapphirerapids"
    else:
        assert res["variant"] != "sapphirerapids"


@pytest.mark.skipif(platform.machine() != "aarch64", reason="ARM variants (x86: the test below)")
def test_arm_variant_this_cpu_cannot_run_is_refused(venv):
    # tests/test_arm64.py runs this on an emulated ARMv8.2 core: the SVE/SME variants score 0 there.
    script = """
        import json, os
        from pathlib import Path
        import llama_ctypes
        from llama_ctypes.native.backends import cpu_variant_files, variant_score
        files = cpu_variant_files(Path(llama_ctypes.__file__).parent / "lib")
        print(json.dumps({name: variant_score(path) for name, path in files.items()}))
    """
    scores = run_in_venv(venv, script)
    assert set(scores) >= EXPECTED_VARIANTS["aarch64"] and scores["armv8.0_1"] > 0
    unrunnable = sorted(name for name, score in scores.items() if score == 0)
    if not unrunnable:
        pytest.fail(f"every ARM variant runs on this CPU ({scores}): run it on a lower one (QEMU_CPU=neoverse-n1)")
    res = run_in_venv(venv, """
        import json, llama_ctypes as lc
        try:
            lc.init()
        except lc.NativeLibraryError as exc:
            print(json.dumps({"error": str(exc)}))
        else:
            print(json.dumps({"error": None}))
    """, LLAMA_CTYPES_CPU_VARIANT=unrunnable[-1])
    assert res["error"] and "lacks" in res["error"]


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the sapphirerapids variant is x86's")
def test_variant_this_cpu_cannot_run_is_refused(venv):
    # What the sapphirerapids variant needs beyond its ggml score, hidden from the check
    # as a hypervisor may hide it: forcing it is refused instead of faulting.
    script = """
        import json
        import llama_ctypes.native.backends as backends
        backends._cpu_flags = lambda: set()
        import llama_ctypes as lc
        try:
            lc.init()
        except lc.NativeLibraryError as exc:
            print(json.dumps({"error": str(exc)}))
        else:
            print(json.dumps({"error": None}))
    """
    res = run_in_venv(venv, script, LLAMA_CTYPES_CPU_VARIANT="sapphirerapids")
    assert res["error"] and "lacks" in res["error"]


def test_failed_init_keeps_the_log_callback_and_can_be_retried(venv, tiny_model_path):
    script = """
        import gc, json, os, sys
        import llama_ctypes as lc
        from llama_ctypes import native
        try:
            lc.init()
        except lc.NativeLibraryError as exc:
            first = str(exc)
        gc.collect()
        native.load().ggml_backend_load(b"/nonexistent/libggml-x.so")  # logs through the callback
        del os.environ["LLAMA_CTYPES_CPU_VARIANT"]
        with lc.load_model(sys.argv[1]) as model:
            out = lc.generate(model, "Hello", max_tokens=3, temp=0.0)
        print(json.dumps({"first": first, "tokens": len(out.tokens)}))
    """
    res = _run_script(venv, script, {"LLAMA_CTYPES_CPU_VARIANT": "pentium4"}, (str(tiny_model_path),))
    assert "pentium4" in res["first"] and res["tokens"] == 3


def test_unknown_or_unsupported_cpu_variant_is_a_clear_error(venv):
    script = """
        import json, llama_ctypes as lc
        try:
            lc.init()
        except lc.LlamaError as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
    """
    res = run_in_venv(venv, script, LLAMA_CTYPES_CPU_VARIANT="pentium4")
    assert res["error"] == "NativeLibraryError"
    assert "pentium4" in res["message"]
    assert all(v in res["message"] for v in EXPECTED_VARIANTS[platform.machine()])  # names what exists


def test_broken_and_mismatched_plugins_leave_the_cpu_path_working(venv, tmp_path, tiny_model_path):
    from llama_ctypes import __version__

    plugins = tmp_path / "plugins"
    bogus = plugins / "bogus_backend.so"
    plugins.mkdir()
    bogus.write_bytes(b"not a shared library")

    def fake_dist(name: str, version: str, target: str) -> None:
        # installers name the folder after the normalized name; importlib.metadata relies on it
        info = plugins / f"{name.replace('-', '_')}-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        (info / "entry_points.txt").write_text(f"[llama_ctypes.backends]\n{name} = {target}\n")

    # Hard links to the package's own CPU modules: one is the backend already registered
    # (ggml hands back its handle), the others would register a second "CPU".
    lib_dir = venv["site"] / "llama_ctypes" / "lib"
    links = []
    for variant in sorted(lib_dir.glob("libggml-cpu-*.so")):
        os.link(variant, plugins / variant.name)
        links.append(str(plugins / variant.name))
    (plugins / "fake_plugins.py").write_text(
        f"def duplicates():\n    return {links!r}\n"
        "def unloadable():\n"
        f"    return [{str(bogus)!r}]\n"
        "def raising():\n"
        "    raise RuntimeError('no runtime for this backend')\n"
        "def one_string():\n"
        f"    return {str(bogus)!r}\n"
        "def reentrant():\n"
        "    import llama_ctypes\n"
        "    llama_ctypes.version_info()\n"
        "    return []\n"
    )
    fake_dist("llama-ctypes-old", "0.0.1", "fake_plugins:unloadable")
    fake_dist("llama-ctypes-unloadable", __version__, "fake_plugins:unloadable")
    fake_dist("llama-ctypes-raising", __version__, "fake_plugins:raising")
    fake_dist("llama-ctypes-string", __version__, "fake_plugins:one_string")
    fake_dist("llama-ctypes-reentrant", __version__, "fake_plugins:reentrant")
    fake_dist("llama-ctypes-duplicates", __version__, "fake_plugins:duplicates")
    script = """
        import json, logging, sys
        records = []
        class Keep(logging.Handler):
            def emit(self, record):
                records.append(record.getMessage())
        logging.getLogger("llama_ctypes").addHandler(Keep())
        logging.getLogger("llama_ctypes").setLevel(logging.INFO)
        import llama_ctypes as lc
        with lc.load_model(sys.argv[1]) as model:
            out = lc.generate(model, "Hello", max_tokens=4, temp=0.0)
        print(json.dumps({"records": records, "tokens": len(out.tokens),
                          "backends": [b.name for b in lc.loaded_backends()]}))
    """
    res = _run_script(venv, script, {"PYTHONPATH": str(plugins)}, (str(tiny_model_path),))
    text = "\n".join(res["records"])
    assert "llama-ctypes-old 0.0.1" in text and f"this is {__version__}" in text
    assert "llama-ctypes-raising" in text and "no runtime for this backend" in text
    assert "could not load" in text and "bogus_backend.so" in text
    assert "llama-ctypes-string" in text and "expected a list of module paths" in text
    assert "llama-ctypes-reentrant" in text and "while init() loads the backends" in text  # not a deadlock
    assert res["tokens"] == 4 and res["backends"].count("CPU") == 1
    assert "is already registered" in text  # a second CPU backend was refused, the first kept


def test_plugin_extras_pin_this_version():
    import re

    from llama_ctypes import __version__

    text = (ROOT / "pyproject.toml").read_text()
    for name in build_wheel.PLUGINS:
        match = re.search(rf'^{name} = \["llama-ctypes-{name}==([^"]+)"\]', text, re.M)
        assert match, f"no [{name}] extra in pyproject.toml"
        assert match.group(1) == __version__
