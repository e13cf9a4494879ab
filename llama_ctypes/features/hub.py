"""Hugging Face Hub client: search GGUF repos, list their files, download into a local cache.

Written on ``requests``; no dependency on ``huggingface_hub``.

* Cache: ``<cache>/<owner>--<name>/<revision>/<file>``, where ``<cache>`` is
  ``cache_dir=``, else ``$LLAMA_CTYPES_MODELS_DIR``, else
  ``platformdirs.user_cache_dir("llama_ctypes")/models`` (``~/.cache/llama_ctypes/models`` on Linux).
* Downloads go to ``<file>.incomplete``, resume with HTTP Range after an
  interruption, are checked against the size and the sha256 the Hub reports for
  LFS files, and are moved into place atomically. A file lock makes concurrent
  downloads of one file (threads or processes) produce one correct file.
* A cached file costs one HEAD request to confirm it is current, and none in
  offline mode (``LLAMA_OFFLINE=1`` or ``HF_HUB_OFFLINE=1``).
* Auth: ``token=`` or ``$HF_TOKEN``. ``$HF_ENDPOINT`` overrides the Hub URL.
  The token never appears in logs, exceptions or reprs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, Callable
from urllib.parse import quote

import requests

from ..errors import InvalidArgumentError, LlamaError

logger = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
CHUNK = 1 << 20
RETRIES = 3
TIMEOUT = (10, 60)  # connect, read (seconds)
_SPLIT = re.compile(r"^(?P<prefix>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")
_REPO = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*$")
_REVISION = re.compile(r"^[A-Za-z0-9._/-]+$")


class HubError(LlamaError):
    """Base class of Hub errors."""


class HubNotFoundError(HubError, FileNotFoundError):
    """The repository, file or revision does not exist (or is hidden from this token)."""


class HubUnauthorizedError(HubError, PermissionError):
    """The repository is private or gated: a token with access is needed."""


class HubOfflineError(HubError):
    """Offline mode is on and the file is not in the cache."""


class HubIntegrityError(HubError):
    """A downloaded file did not match the size or sha256 the Hub reported."""


# ---- configuration --------------------------------------------------------------------------------

def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def is_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("LLAMA_OFFLINE", "HF_HUB_OFFLINE"))


def default_cache_dir() -> Path:
    env = os.environ.get("LLAMA_CTYPES_MODELS_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("llama_ctypes")) / "models"


def _token(token: str | None) -> str | None:
    return token if token is not None else (os.environ.get("HF_TOKEN") or None)


def _headers(token: str | None) -> dict[str, str]:
    from .._version import __version__

    headers = {"User-Agent": f"llama_ctypes/{__version__}"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    return headers


# ---- validation -------------------------------------------------------------------------------------

def validate_repo(repo: str) -> str:
    if not isinstance(repo, str) or not _REPO.match(repo) or ".." in repo:
        raise InvalidArgumentError(f"invalid repository id {repo!r}: expected 'owner/name'")
    return repo


def validate_filename(filename: str) -> str:
    """A relative path inside the repository: no absolute paths, no '..', no backslashes."""
    if not isinstance(filename, str) or not filename or "\\" in filename or "\x00" in filename:
        raise InvalidArgumentError(f"invalid file name {filename!r}")
    path = PurePosixPath(filename)
    if path.is_absolute() or any(part in ("..", ".", "") for part in filename.split("/")) or re.match(r"^[A-Za-z]:",
                                                                                                     filename):
        raise InvalidArgumentError(f"refusing file name {filename!r}: it must stay inside the repository")
    return filename


def validate_revision(revision: str) -> str:
    if not isinstance(revision, str) or not _REVISION.match(revision) or ".." in revision.split("/") \
            or revision.startswith("/"):
        raise InvalidArgumentError(f"invalid revision {revision!r}")
    return revision


def _cache_path(root: Path, repo: str, revision: str, filename: str) -> Path:
    base = (root / repo.replace("/", "--") / revision.replace("/", "--")).resolve()
    target = (base / filename).resolve()
    if base not in target.parents:
        raise InvalidArgumentError(f"refusing file name {filename!r}: it resolves outside the cache")
    return target


# ---- HTTP -----------------------------------------------------------------------------------------------

def _check(response: requests.Response, what: str, token: str | None) -> None:
    if response.status_code in (401, 403):
        hint = ("the token given has no access to it" if token else
                "pass token='hf_...' or set HF_TOKEN (and accept the model's terms on its page if it is gated)")
        raise HubUnauthorizedError(f"{what} is private or gated (HTTP {response.status_code}): {hint}")
    if response.status_code == 404:
        raise HubNotFoundError(f"{what} was not found (HTTP 404)")
    if response.status_code >= 400:
        raise HubError(f"{what}: HTTP {response.status_code}")


def _get_json(url: str, params: dict | None, token: str | None, what: str) -> Any:
    if is_offline():
        raise HubOfflineError(f"offline mode is on (LLAMA_OFFLINE/HF_HUB_OFFLINE): cannot fetch {what}")
    try:
        response = requests.get(url, params=params, headers=_headers(token), timeout=TIMEOUT)
    except requests.RequestException as exc:
        raise HubError(f"cannot reach the Hub for {what}: {type(exc).__name__}") from None
    _check(response, what, token)
    return response.json()


# ---- search and listing ------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelSummary:
    """A Hub repository, as search returns it."""

    id: str
    downloads: int = 0
    likes: int = 0
    tags: tuple[str, ...] = ()
    last_modified: str | None = None


@dataclass(frozen=True)
class GGUFFile:
    """A GGUF model in a repository; a split model lists all its parts (sizes in bytes)."""

    name: str  # the file to pass to download (the first part of a split model)
    size: int
    parts: tuple[str, ...] = field(default=())
    sha256: str | None = None

    @property
    def is_split(self) -> bool:
        return len(self.parts) > 1


def search(query: str = "", *, limit: int = 20, author: str | None = None, sort: str = "downloads",
           token: str | None = None) -> list[ModelSummary]:
    """Search GGUF repositories (most downloaded first by default)."""
    if not 0 < limit <= 1000:
        raise InvalidArgumentError(f"limit={limit}: expected 1..1000")
    params = {"search": query, "filter": "gguf", "limit": limit, "sort": sort, "direction": -1}
    if author:
        params["author"] = author
    data = _get_json(f"{endpoint()}/api/models", params, _token(token), f"search {query!r}")
    return [ModelSummary(id=m.get("id") or m.get("modelId", ""), downloads=int(m.get("downloads", 0) or 0),
                         likes=int(m.get("likes", 0) or 0), tags=tuple(m.get("tags", ()) or ()),
                         last_modified=m.get("lastModified")) for m in data]


def list_files(repo: str, *, revision: str = "main", token: str | None = None) -> list[dict[str, Any]]:
    """Every file of a repository revision: dicts with ``path``, ``size`` and (LFS files) ``sha256``."""
    validate_repo(repo)
    validate_revision(revision)
    url = f"{endpoint()}/api/models/{repo}/tree/{quote(revision, safe='')}"
    data = _get_json(url, {"recursive": "true"}, _token(token), f"repository {repo!r} at revision {revision!r}")
    out = []
    for item in data:
        if item.get("type") != "file":
            continue
        lfs = item.get("lfs") or {}
        out.append({"path": item["path"], "size": int(lfs.get("size", item.get("size", 0)) or 0),
                    "sha256": lfs.get("oid") or lfs.get("sha256")})
    return out


def list_gguf_files(repo: str, *, revision: str = "main", token: str | None = None) -> list[GGUFFile]:
    """The GGUF models in a repository; split GGUFs (``-00001-of-00003.gguf``) are grouped."""
    groups: dict[str, list[dict]] = {}
    singles: list[GGUFFile] = []
    for f in list_files(repo, revision=revision, token=token):
        if not f["path"].endswith(".gguf"):
            continue
        m = _SPLIT.match(f["path"])
        if m:
            groups.setdefault(f"{m['prefix']}|{m['count']}", []).append(f)
        else:
            singles.append(GGUFFile(f["path"], f["size"], (f["path"],), f["sha256"]))
    for parts in groups.values():
        parts.sort(key=lambda f: f["path"])
        singles.append(GGUFFile(parts[0]["path"], sum(p["size"] for p in parts), tuple(p["path"] for p in parts)))
    return sorted(singles, key=lambda g: g.name)


def _quant_bits(path: str) -> int:
    """The bits of a GGUF file name's quantization tag (``Q4_K_M`` → 4, ``F16`` → 16; 0 when none)."""
    stem = path[:-5] if path.endswith(".gguf") else path
    m = _SPLIT.match(path)
    if m:
        stem = m["prefix"]
    tag = re.search(r"[-.]([A-Za-z0-9_]+)$", stem)
    digits = re.search(r"\d+", tag.group(1)) if tag else None
    return int(digits.group(0)) if digits else 0


def cached_files(repo: str, *, revision: str = "main", cache_dir: str | os.PathLike | None = None) -> list[str]:
    """The files of ``repo`` already in the cache (paths in the repository, sorted); no request is made."""
    validate_repo(repo)
    validate_revision(revision)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    base = root / repo.replace("/", "--") / revision.replace("/", "--")
    if not base.is_dir():
        return []
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file()
                  and not p.name.endswith((".incomplete", ".lock", ".meta.json")))


def _choice_files(repo: str, revision: str, token: str | None) -> list[str]:
    """The files a choice (a model by its quantization, a projector) is made among: the repository's, or in
    offline mode those in the cache, as llama-server's ``-hf`` does with ``--offline``."""
    if is_offline():
        return cached_files(repo, revision=revision)
    return [f["path"] for f in list_files(repo, revision=revision, token=token)]


def split_repo_tag(repo_with_tag: str) -> tuple[str, str]:
    """``"owner/name:Q4_K_M"`` → ``("owner/name", "Q4_K_M")`` (llama-server's ``-hf`` spelling; tag "" when none)."""
    repo, _, tag = repo_with_tag.partition(":")
    validate_repo(repo)
    if tag and not re.fullmatch(r"[A-Za-z0-9_.-]+", tag):
        raise InvalidArgumentError(f"invalid quantization tag {tag!r} in {repo_with_tag!r}: expected owner/name[:quant]")
    return repo, tag


def _is_model_file(path: str) -> bool:
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".gguf") and not any(k in name for k in ("mmproj", "imatrix", "mtp-", "eagle3-", "dflash-",
                                                                  "dspark-"))


def find_model(repo_with_tag: str, *, revision: str = "main", token: str | None = None) -> tuple[str, str]:
    """(repo, file) for llama-server's ``-hf owner/name[:quant]``, chosen as it chooses: the first model GGUF
    whose name holds the tag (default: ``Q4_K_M``, then ``Q8_0``, then the first model file), the first part
    of a split one. In offline mode the choice is among the cached files. HubNotFoundError when none fits."""
    repo, tag = split_repo_tag(repo_with_tag)
    files = _choice_files(repo, revision, token)
    for wanted in ([tag] if tag else ["Q4_K_M", "Q8_0"]):
        pattern = re.compile(re.escape(wanted) + r"[.-]", re.IGNORECASE)
        for path in files:
            split = _SPLIT.match(path.rsplit("/", 1)[-1])
            if _is_model_file(path) and pattern.search(path) and (split is None or split["index"] == "00001"):
                return repo, path
    if not tag:
        for path in files:
            split = _SPLIT.match(path.rsplit("/", 1)[-1])
            if _is_model_file(path) and (split is None or split["index"] == "00001"):
                return repo, path
    where = " in the cache (offline mode)" if is_offline() else ""
    raise HubNotFoundError(f"{repo} has no GGUF model{' for ' + repr(tag) if tag else ''}{where}")


def find_mmproj(repo: str, model: str | None = None, *, revision: str = "main", token: str | None = None,
                required: bool = True) -> str | None:
    """The repository's multimodal projector for ``model`` (a GGUF of the repository), chosen as
    llama-server's ``-hf`` chooses: a ``.gguf`` whose name holds ``mmproj``, in the model's folder or
    above it (the deepest first), then the closest quantization to the model's. None when there is
    none, or HubNotFoundError when ``required``. In offline mode the choice is among the cached files."""
    model_dir = model.split("/")[:-1] if model else []
    best: tuple[int, int] | None = None
    chosen = None
    bits = _quant_bits(model) if model else 0
    for path in _choice_files(repo, revision, token):
        if not path.endswith(".gguf") or "mmproj" not in path:
            continue
        folder = path.split("/")[:-1]
        if folder != model_dir[:len(folder)]:
            continue  # (a sibling folder's projector belongs to another model)
        key = (-len(folder), abs(_quant_bits(path) - bits))
        if best is None or key < best:
            best, chosen = key, path
    if chosen is None and required:
        raise HubNotFoundError(f"{repo} has no multimodal projector (no .gguf file named *mmproj*)")
    return chosen


# ---- download ---------------------------------------------------------------------------------------------

ProgressCallback = Callable[[int, int], Any]  # (bytes done, total bytes or 0 when unknown)


def download(repo: str, filename: str, *, revision: str = "main", token: str | None = None,
             cache_dir: str | os.PathLike | None = None, progress: ProgressCallback | None = None) -> Path:
    """Download ``filename`` of ``repo`` into the cache (or confirm the cached copy); return its path.

    For the first part of a split GGUF, every part is downloaded and the first
    part's path returned (llama.cpp finds the others by name).
    """
    validate_repo(repo)
    validate_filename(filename)
    validate_revision(revision)
    m = _SPLIT.match(PurePosixPath(filename).name)
    if m:
        count = int(m["count"])
        parent = str(PurePosixPath(filename).parent)
        names = [f"{m['prefix']}-{i:05d}-of-{count:05d}.gguf" for i in range(1, count + 1)]
        paths = [_download_one(repo, n if parent == "." else f"{parent}/{n}", revision, token, cache_dir, progress)
                 for n in names]
        return paths[int(m["index"]) - 1]
    return _download_one(repo, filename, revision, token, cache_dir, progress)


def _meta_path(target: Path) -> Path:
    return target.with_name(target.name + ".meta.json")


def _download_one(repo: str, filename: str, revision: str, token: str | None, cache_dir, progress) -> Path:
    token = _token(token)
    root = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    target = _cache_path(root, repo, revision, filename)
    what = f"{filename!r} in {repo!r} at revision {revision!r}"
    if is_offline():
        if target.exists():
            return target
        raise HubOfflineError(f"offline mode is on and {what} is not in the cache ({target})")
    url = f"{endpoint()}/{repo}/resolve/{quote(revision, safe='')}/{quote(filename)}"
    expected_size, expected_sha = _head(url, token, what)
    if target.exists() and _is_current(target, expected_size, expected_sha):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    from filelock import FileLock

    with FileLock(str(target) + ".lock"):
        if target.exists() and _is_current(target, expected_size, expected_sha):
            return target  # another thread or process finished it while we waited
        _fetch(url, target, expected_size, expected_sha, token, what, progress)
    return target


def _head(url: str, token: str | None, what: str) -> tuple[int | None, str | None]:
    """Size and sha256 (LFS files) of the file behind ``url``, without downloading it."""
    try:
        response = requests.head(url, headers=_headers(token), allow_redirects=False, timeout=TIMEOUT)
    except requests.RequestException as exc:
        raise HubError(f"cannot reach the Hub for {what}: {type(exc).__name__}") from None
    if response.is_redirect or response.status_code in (301, 302, 303, 307, 308):
        response.status_code = 200  # the redirect itself carries the headers we need
    _check(response, what, token)
    size = response.headers.get("X-Linked-Size") or response.headers.get("Content-Length")
    etag = (response.headers.get("X-Linked-Etag") or response.headers.get("ETag") or "").strip('"').removeprefix("W/")
    etag = etag.strip('"')
    sha = etag if re.fullmatch(r"[0-9a-f]{64}", etag) else None
    return (int(size) if size and size.isdigit() else None), sha


def _is_current(target: Path, size: int | None, sha: str | None) -> bool:
    if size is not None and target.stat().st_size != size:
        return False
    meta = _meta_path(target)
    if sha is not None:
        try:
            return json.loads(meta.read_text()).get("sha256") == sha
        except (OSError, ValueError):
            return False
    return True


def _fetch(url: str, target: Path, size: int | None, sha: str | None, token: str | None, what: str,
           progress: ProgressCallback | None) -> None:
    partial = target.with_name(target.name + ".incomplete")
    bar = _progress_bar(target.name, size)
    last_error: Exception | None = None
    try:
        for attempt in range(RETRIES):
            have = partial.stat().st_size if partial.exists() else 0
            if size is not None and have > size:
                partial.unlink()
                have = 0
            headers = _headers(token)
            if have:
                headers["Range"] = f"bytes={have}-"
            try:
                with requests.get(url, headers=headers, stream=True, timeout=TIMEOUT) as response:
                    if response.status_code == 416 and size is not None and have == size:
                        break  # already complete
                    _check(response, what, token)
                    if have and response.status_code != 206:  # the server ignored Range: start over
                        have = 0
                    with open(partial, "ab" if have else "wb") as out:
                        done = have
                        for chunk in response.iter_content(CHUNK):
                            out.write(chunk)
                            done += len(chunk)
                            if progress is not None:
                                progress(done, size or 0)
                            if bar is not None:
                                bar.update(len(chunk))
                if size is None or partial.stat().st_size >= size:
                    break
                last_error = HubError(f"the download of {what} ended early")
            except (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError) as exc:
                last_error = exc
            logger.info("download of %s interrupted (attempt %d of %d); resuming", what, attempt + 1, RETRIES)
            time.sleep(0.2 * (attempt + 1))
        else:
            raise HubError(f"could not download {what} after {RETRIES} attempts: "
                           f"{type(last_error).__name__ if last_error else 'incomplete'}")
        _verify(partial, size, sha, what)
        os.replace(partial, target)
        _meta_path(target).write_text(json.dumps({"size": target.stat().st_size, "sha256": sha, "url_path": what}))
    finally:
        if bar is not None:
            bar.close()


def _verify(partial: Path, size: int | None, sha: str | None, what: str) -> None:
    actual_size = partial.stat().st_size
    if size is not None and actual_size != size:
        partial.unlink(missing_ok=True)
        raise HubIntegrityError(f"{what}: downloaded {actual_size} bytes, the Hub reported {size}")
    if sha is not None:
        digest = hashlib.sha256()
        with open(partial, "rb") as fh:
            for block in iter(lambda: fh.read(CHUNK), b""):
                digest.update(block)
        if digest.hexdigest() != sha:
            partial.unlink(missing_ok=True)
            raise HubIntegrityError(f"{what}: sha256 {digest.hexdigest()} does not match the Hub's {sha}; "
                                    "the corrupt download was removed")


def _progress_bar(name: str, total: int | None):
    if not sys.stderr.isatty():
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, desc=name, leave=False, file=sys.stderr)


def load_model_from_hub(repo: str, filename: str, *, revision: str = "main", token: str | None = None,
                        cache_dir: str | os.PathLike | None = None, progress: ProgressCallback | None = None,
                        mmproj: str | None = None, **model_opts: Any):
    """Download (or find in the cache) and load a GGUF model; options as :func:`load_model`.

    ``mmproj``: a multimodal projector of the same repository to attach: a file name, or ``"auto"`` for
    the one llama-server's ``-hf`` would pick (:func:`find_mmproj`), when the repository has one.
    """
    from ..core.model import load_model

    projector = None
    name = find_mmproj(repo, filename, revision=revision, token=token, required=False) if mmproj == "auto" \
        else mmproj
    if name is not None:
        projector = download(repo, name, revision=revision, token=token, cache_dir=cache_dir, progress=progress)
    path = download(repo, filename, revision=revision, token=token, cache_dir=cache_dir, progress=progress)
    return load_model(path, mmproj=projector, **model_opts)
