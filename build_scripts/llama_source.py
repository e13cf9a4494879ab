"""Where llama.cpp comes from: the one place that holds the pin.

The pinned archive is a published source distribution whose ``vendor/llama.cpp``
is a complete llama.cpp tree. It is fetched with ``pip download --no-binary`` (so it goes
through whatever package index pip is configured for), checked against its
sha256, and only ``vendor/llama.cpp`` is extracted.

A user with their own tree sets ``LLAMA_CPP_DIR`` (or passes ``--llama-cpp-dir``)
and nothing is downloaded.

The tree itself is never changed. ``patches/*.patch`` (unified diffs against the
pinned tree) are applied by :func:`patched_files`, which returns the changed files'
new contents; the build compiles those copies instead (build_llama.py, CMakeLists.txt).
The patches are part of the build's cache key. On the pinned tree a patch must apply
exactly; on a user's tree one that does not apply is left out, with a warning.
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

# Changes to llama.cpp the package needs, one unified diff per change (see patched_files).
PATCH_DIR = Path(__file__).resolve().parent / "patches"


class SourceError(RuntimeError):
    """The llama.cpp source could not be obtained or verified."""


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def download_archive(dest_dir: Path) -> Path:
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
    archive = download_archive(download_dir)
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


# ---- patches ------------------------------------------------------------------------
class PatchError(SourceError):
    """A patch does not apply to a llama.cpp tree."""


def patches() -> list[Path]:
    """The patch files, in the order they apply."""
    return sorted(PATCH_DIR.glob("*.patch")) if PATCH_DIR.is_dir() else []


def _parse_patch(text: str) -> list[tuple[str, list[tuple[int, list[str], list[str]]]]]:
    """A unified diff as [(path, [(old start line, old lines, new lines), ...]), ...]."""
    files: list[tuple[str, list]] = []
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("--- ") and i + 1 < len(lines) and lines[i + 1].startswith("+++ "):
            path = lines[i + 1][4:].split("\t")[0].strip()
            if path.startswith("b/"):
                path = path[2:]
            files.append((path, []))
            i += 2
            continue
        if line.startswith("@@"):
            if not files:
                raise PatchError("a hunk before any file header")
            head = line.split("@@")[1].split()
            start, _, old_count = head[0][1:].partition(",")
            new_count = head[1][1:].partition(",")[2]
            n_old, n_new = int(old_count or 1), int(new_count or 1)
            old: list[str] = []
            new: list[str] = []
            i += 1
            while len(old) < n_old or len(new) < n_new:
                if i >= len(lines):
                    raise PatchError(f"{files[-1][0]}: a hunk ends early")
                body = lines[i]
                tag, rest = (body[:1], body[1:]) if body else (" ", "")
                if tag == " ":
                    old.append(rest)
                    new.append(rest)
                elif tag == "-":
                    old.append(rest)
                elif tag == "+":
                    new.append(rest)
                elif tag != "\\":  # "\\ No newline at end of file"
                    raise PatchError(f"{files[-1][0]}: unexpected line in a hunk: {body[:60]!r}")
                i += 1
            files[-1][1].append((int(start), old, new))
            continue
        i += 1
    return files


def _apply_hunks(path: str, text: str, hunks: list[tuple[int, list[str], list[str]]]) -> str:
    """Apply hunks exactly: each hunk's old lines must occur once (at or away from its line)."""
    lines = text.split("\n")
    offset = 0
    for start, old, new in hunks:
        at = start - 1 + offset
        if lines[at:at + len(old)] != old:
            found = [k for k in range(len(lines) - len(old) + 1) if lines[k:k + len(old)] == old]
            if len(found) != 1:
                raise PatchError(f"{path}: the hunk at line {start} "
                                 f"{'does not match' if not found else 'matches more than one place'}")
            at = found[0]
        lines[at:at + len(old)] = new
        offset = at + len(new) - (start - 1 + len(old))
    return "\n".join(lines)


def patched_files(tree: Path, pinned: bool) -> tuple[dict[str, bytes], list[str]]:
    """The files ``patches()`` change in ``tree``: ({relative path: new content}, applied patch names).

    ``pinned``: the tree is the pinned source, where every patch must apply (PatchError);
    on another tree a patch that does not apply is skipped and reported on stderr.
    """
    out: dict[str, bytes] = {}
    applied: list[str] = []
    for patch in patches():
        try:
            result: dict[str, bytes] = {}
            for rel, hunks in _parse_patch(patch.read_text(encoding="utf-8")):
                src = tree / rel
                if rel in out:
                    text = out[rel].decode("utf-8")
                elif src.is_file():
                    text = src.read_text(encoding="utf-8")
                else:
                    raise PatchError(f"{rel} is not in {tree}")
                result[rel] = _apply_hunks(rel, text, hunks).encode("utf-8")
        except PatchError as exc:
            if pinned:
                raise PatchError(f"{patch.name} does not apply to {PIN_ID}: {exc}") from None
            print(f"[llama_ctypes build] warning: {patch.name} does not apply to {tree} ({exc}); "
                  "building without it", file=sys.stderr, flush=True)
            continue
        out.update(result)
        applied.append(patch.stem)
    return out, applied
