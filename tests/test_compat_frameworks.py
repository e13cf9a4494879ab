"""The frameworks built on llama-cpp-python, unchanged, on llama_ctypes.compat (issue 43, item 3).

Each runs in a child process that calls ``install_as_llama_cpp()`` first (the one line a user adds) and
then uses the framework as its documentation shows; the real llama-cpp-python is never installed here.
Each runs on the tiny generated model and on Gemma 3 270M. The tiny model's text is random, so what is
asserted is what the frameworks promise: shapes, streaming
that adds up to the whole, tool calls and structured outputs that parse (their grammars constrain the
model), embeddings of the right size.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tiny_models import write_tiny_bert

ROOT = Path(__file__).resolve().parent.parent
LLAMA_INDEX_LLAMA_CPP = "llama-index-llms-llama-cpp==0.7.0"


@pytest.fixture(scope="module")
def llama_index_path() -> Path:
    """llama-index-llms-llama-cpp, installed without its dependencies (it requires llama-cpp-python, which
    would be built from source) into the build cache, once."""
    sys.path.insert(0, str(ROOT / "build_scripts"))
    import build_llama

    where = build_llama.cache_root() / "test-deps" / LLAMA_INDEX_LLAMA_CPP.replace("==", "-")
    if not (where / "llama_index" / "llms" / "llama_cpp").exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps",
                        "--target", str(where), LLAMA_INDEX_LLAMA_CPP], check=True, timeout=600)
    return where


#: the model each framework test runs on: the tiny generated llama (chatml) and Gemma 3 270M (its format)
MODELS = ["tiny", pytest.param("gemma", marks=pytest.mark.gemma)]


@pytest.fixture
def model(request, tiny_model_path) -> dict:
    """The script's MODEL and FORMAT; ``exact``: whether a streamed text must equal the whole one. The two
    come from two calls (the second on the prompt the first left cached); on Gemma a near tie of its two
    best tokens may flip between them on another CPU, so there the stream is only checked for its shape."""
    if request.param == "tiny":
        return {"MODEL": tiny_model_path, "FORMAT": "chatml", "exact": True}
    return {"MODEL": request.getfixturevalue("gemma_path"), "FORMAT": "gemma", "exact": False}


def _same_text(pieces: list, whole: str, exact: bool) -> bool:
    joined = "".join(p or "" for p in pieces)
    return joined == whole if exact else bool(joined) and isinstance(whole, str) and bool(whole)


def _script_paths(model: dict) -> dict:
    return {k: v for k, v in model.items() if k != "exact"}


def _run(script: str, extra_path: Path | None = None, **paths: Path) -> dict:
    """Run ``script`` after install_as_llama_cpp(); it prints one JSON line, returned."""
    prelude = ("import json, sys\nfrom llama_ctypes.compat import install_as_llama_cpp\ninstall_as_llama_cpp()\n"
               "import llama_cpp\nassert llama_cpp.__name__ == 'llama_ctypes.interfaces.compat', llama_cpp\n"
               + "".join(f"{k} = {str(v)!r}\n" for k, v in paths.items()))
    env = dict(os.environ)
    if extra_path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(extra_path), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", prelude + script], capture_output=True, text=True, timeout=600,
                          env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


_LANGCHAIN = '''
from typing import Literal
from pydantic import BaseModel
from langchain_community.chat_models import ChatLlamaCpp
from langchain_community.llms import LlamaCpp
from langchain_community.embeddings import LlamaCppEmbeddings
import llama_cpp
from llama_ctypes.compat import Llama

class Weather(BaseModel):
    """The weather in a city for some days."""
    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]

chat = ChatLlamaCpp(model_path=MODEL, temperature=0, max_tokens=8, model_kwargs={"chat_format": FORMAT},
                    verbose=False)
assert isinstance(chat.client, Llama)
reply = chat.invoke("Hello")
chunks = [c.content for c in chat.stream("Hello")]
tooled = chat.bind_tools([Weather], tool_choice={"type": "function", "function": {"name": "Weather"}})
called = tooled.invoke("Weather in Paris for 3 days?", max_tokens=200)
structured = chat.with_structured_output(Weather).invoke("Weather in Paris for 3 days?", max_tokens=200)
llm = LlamaCpp(model_path=MODEL, temperature=0, max_tokens=8, verbose=False)
text = llm.invoke("The quick brown fox")
pieces = list(llm.stream("The quick brown fox"))
emb = LlamaCppEmbeddings(model_path=BERT, verbose=False)
print(json.dumps({"reply": reply.content, "chunks": chunks, "tool_calls": called.tool_calls,
                  "structured": structured.model_dump(), "text": text, "pieces": pieces,
                  "query": emb.embed_query("hello"), "docs": emb.embed_documents(["a", "b c"]),
                  "n_embd": Llama(BERT, embedding=True, verbose=False).n_embd()}))
'''


@pytest.mark.parametrize("model", MODELS, indirect=True)
def test_langchain_chat_llm_and_embeddings(model, tmp_path, vocab_dir):
    bert = write_tiny_bert(tmp_path / "bert.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf")
    out = _run(_LANGCHAIN, BERT=bert, **_script_paths(model))
    assert isinstance(out["reply"], str) and out["reply"]
    assert _same_text(["".join(out["chunks"]).rstrip("\ufffd")], out["reply"].rstrip("\ufffd"), model["exact"])
    (call,) = out["tool_calls"]
    assert call["name"] == "Weather" and call["args"]["city"] in ("Paris", "Rome") and call["args"]["days"] in (1, 2, 3)
    assert out["structured"]["city"] in ("Paris", "Rome")
    assert _same_text(out["pieces"], out["text"], model["exact"])
    assert len(out["query"]) == out["n_embd"] and [len(v) for v in out["docs"]] == [out["n_embd"]] * 2


_LLAMA_INDEX = '''
from llama_index.llms.llama_cpp import LlamaCPP
from llama_index.core.llms import ChatMessage
llm = LlamaCPP(model_path=MODEL, temperature=0.0, max_new_tokens=8, context_window=512, generate_kwargs={},
               model_kwargs={}, verbose=False)
done = llm.complete("The quick brown fox")
deltas = [r.delta for r in llm.stream_complete("The quick brown fox")]
chat = llm.chat([ChatMessage(role="user", content="Hello")])
streamed = [r.delta for r in llm.stream_chat([ChatMessage(role="user", content="Hello")])]
print(json.dumps({"text": done.text, "deltas": deltas, "chat": chat.message.content, "streamed": streamed,
                  "window": llm.metadata.context_window}))
'''


@pytest.mark.parametrize("model", MODELS, indirect=True)
def test_llama_index_complete_chat_and_stream(model, llama_index_path):
    out = _run(_LLAMA_INDEX, llama_index_path, MODEL=model["MODEL"])
    assert out["text"] and _same_text(out["deltas"], out["text"], model["exact"])
    assert isinstance(out["chat"], str) and out["chat"]
    assert _same_text(["".join(d or "" for d in out["streamed"]).strip()], out["chat"].strip(), model["exact"])
    assert out["window"] == 512


_OUTLINES = '''
from typing import Literal
from pydantic import BaseModel
import llama_cpp, outlines

class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]  # (a bare int lets Gemma write digits up to max_tokens: its JSON then ends cut)

llm = llama_cpp.Llama(MODEL, chat_format=FORMAT, verbose=False)
chat_mode = outlines.from_llamacpp(llm)
weather = chat_mode("Weather in Paris for 3 days?", Weather, max_tokens=100, temperature=0)
choice = chat_mode("Yes or no?", Literal["yes", "no"], max_tokens=5)
plain = outlines.from_llamacpp(llm, chat_mode=False)
plain_choice = plain("The quick brown fox", Literal["jumps", "sleeps"], max_tokens=5)
streamed = list(plain.stream("The quick brown fox", Literal["jumps", "sleeps"], max_tokens=5))
print(json.dumps({"weather": weather, "choice": choice, "plain": plain_choice, "streamed": streamed}))
'''


@pytest.mark.parametrize("model", MODELS, indirect=True)
def test_outlines_json_schema_and_choice(model):
    out = _run(_OUTLINES, **_script_paths(model))
    weather = json.loads(out["weather"])
    assert weather["city"] in ("Paris", "Rome") and weather["days"] in (1, 2, 3)
    assert out["choice"] in ("yes", "no") and out["plain"] in ("jumps", "sleeps")
    assert "".join(out["streamed"]) in ("jumps", "sleeps")


_INSTRUCTOR = '''
from typing import Literal
from pydantic import BaseModel
import instructor, llama_cpp

class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]

llm = llama_cpp.Llama(MODEL, chat_format=FORMAT, verbose=False)
create = instructor.patch(create=llm.create_chat_completion_openai_v1, mode=instructor.Mode.JSON_SCHEMA)
weather = create(messages=[{"role": "user", "content": "Weather in Rome?"}], response_model=Weather,
                 max_tokens=200, temperature=0)
assert isinstance(weather, Weather)
print(json.dumps(weather.model_dump()))
'''


@pytest.mark.parametrize("model", MODELS, indirect=True)
def test_instructor_response_model(model):
    out = _run(_INSTRUCTOR, **_script_paths(model))
    assert out["city"] in ("Paris", "Rome") and out["days"] in (1, 2, 3)
