"""Where llama.cpp comes from: the one place that holds the pin.

The pinned archive is a published source distribution whose ``vendor/llama.cpp``
is a complete llama.cpp tree. It is fetched with ``pip download --no-binary`` (so it goes
through whatever package index pip is configured for), checked against its
sha256, and only ``vendor/llama.cpp`` is extracted.

A user with their own tree sets ``LLAMA_CPP_DIR`` (or passes ``--llama-cpp-dir``)
and nothing is downloaded.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# ---- the pin ------------------------------------------------------------------
PIN_PACKAGE = "llama-cpp-python"
PIN_VERSION = "0.3.36"
PIN_SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
PIN_ARCHIVE = "llama_cpp_python-0.3.36.tar.gz"
PIN_SUBDIR = "llama_cpp_python-0.3.36/vendor/llama.cpp"
# A short, stable name for this llama.cpp source, used in cache keys and reports.
PIN_ID = f"{PIN_PACKAGE}-{PIN_VERSION}"

# Marker written into an extracted tree, so a stale or partial extraction is redone.
_MARKER = ".llama_ctypes_source"


class SourceError(RuntimeError):
    """The llama.cpp source could not be obtained or verified."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_archive(dest_dir: Path) -> Path:
    """Fetch the pinned sdist into dest_dir with pip, without building it."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    target = dest_dir / PIN_ARCHIVE
    if target.exists() and sha256_file(target) == PIN_SHA256:
        return target
    with tempfile.TemporaryDirectory(dir=dest_dir) as tmp:
        cmd = [
            # Only the pinned package as source: its build requirements (needed to read its
            # metadata) come as wheels, never compiled.
            sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", PIN_PACKAGE,
            "--disable-pip-version-check", "-d", tmp,
            f"{PIN_PACKAGE}=={PIN_VERSION}",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        got = Path(tmp) / PIN_ARCHIVE
        if not got.exists():
            # pip may have failed preparing metadata after saving the file; only the file matters.
            raise SourceError(
                f"could not download {PIN_PACKAGE}=={PIN_VERSION} with pip "
                f"(exit {proc.returncode}):\n{proc.stderr.strip()[-2000:]}\n"
                "Set LLAMA_CPP_DIR to an existing llama.cpp checkout to build without downloading."
            )
        actual = sha256_file(got)
        if actual != PIN_SHA256:
            raise SourceError(f"{PIN_ARCHIVE}: sha256 {actual} does not match the pin {PIN_SHA256}")
        os.replace(got, target)
    return target


def _extract(archive: Path, dest: Path) -> None:
    """Extract only the pinned llama.cpp subtree into dest (replaced atomically)."""
    if sha256_file(archive) != PIN_SHA256:
        raise SourceError(f"{archive}: sha256 does not match the pin {PIN_SHA256}")
    prefix = PIN_SUBDIR + "/"
    staging = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=dest.parent))
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for member in tar:
                if not member.name.startswith(prefix):
                    continue
                rel = member.name[len(prefix):]
                if not rel or rel.startswith("/") or ".." in Path(rel).parts or rel == ".git":
                    continue  # escapes, and the sdist's submodule link (it points nowhere here)
                if not (member.isfile() or member.isdir()):
                    continue  # no links or devices from an archive
                out = staging / rel
                if member.isdir():
                    out.mkdir(parents=True, exist_ok=True)
                    continue
                out.parent.mkdir(parents=True, exist_ok=True)
                with tar.extractfile(member) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
                os.chmod(out, 0o755 if member.mode & 0o111 else 0o644)
        if not (staging / "include" / "llama.h").exists():
            raise SourceError(f"{archive} holds no {PIN_SUBDIR}/include/llama.h")
        (staging / _MARKER).write_text(f"{PIN_ID} {PIN_SHA256}\n")
        _move_into_place(staging, dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def ensure_source(vendor_dir: Path, download_dir: Path, llama_cpp_dir: str | None = None) -> tuple[Path, str]:
    """Return (llama.cpp tree, source id), fetching the pinned archive if needed.

    ``llama_cpp_dir`` (or the ``LLAMA_CPP_DIR`` environment variable) names a
    user tree that is used as is; its source id is derived from its contents.
    """
    custom = llama_cpp_dir or os.environ.get("LLAMA_CPP_DIR")
    if custom:
        tree = Path(custom).expanduser().resolve()
        if not (tree / "include" / "llama.h").exists():
            raise SourceError(f"LLAMA_CPP_DIR={custom} is not a llama.cpp tree (no include/llama.h)")
        return tree, "custom-" + tree_fingerprint(tree)

    marker = vendor_dir / _MARKER
    if marker.exists() and marker.read_text().split() == [PIN_ID, PIN_SHA256]:
        return vendor_dir, PIN_ID
    archive = _download_archive(download_dir)
    vendor_dir.parent.mkdir(parents=True, exist_ok=True)
    _extract(archive, vendor_dir)
    return vendor_dir, PIN_ID


def stable_copy(tree: Path, dest: Path) -> Path:
    """A copy of the pinned tree at dest, made once and then left alone; returns dest.

    The build compiles this copy rather than a checkout's own ``vendor/llama.cpp``:
    CMake and Ninja remember source paths and mtimes, and a checkout (or pip's
    temporary copy of one) may be gone, or freshly extracted, next time.
    """
    marker = dest / _MARKER
    if marker.exists() and marker.read_text().split() == [PIN_ID, PIN_SHA256]:
        return dest
    if not (tree / _MARKER).exists():
        raise SourceError(f"{tree} is not an extracted copy of {PIN_ID}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".llama.cpp-", dir=dest.parent))
    try:
        shutil.copytree(tree, staging, symlinks=True, dirs_exist_ok=True)
        _move_into_place(staging, dest)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)
    return dest


def _move_into_place(staging: Path, dest: Path) -> None:
    """Replace ``dest`` by the finished ``staging`` folder (a reader never sees a half-written tree)."""
    if dest.exists():
        shutil.rmtree(dest)
    os.replace(staging, dest)


def tree_fingerprint(tree: Path) -> str:
    """A cheap content fingerprint of a llama.cpp tree: paths, sizes and mtimes of its sources."""
    digest = hashlib.sha256()
    for sub in ("include", "src", "common", "ggml", "CMakeLists.txt", "cmake"):
        root = tree / sub
        paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
        for path in paths:
            st = path.stat()
            digest.update(f"{path.relative_to(tree)}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return digest.hexdigest()[:16]
