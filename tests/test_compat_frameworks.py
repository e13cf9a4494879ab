"""The frameworks built on llama-cpp-python, unchanged, on llama_ctypes.compat (issue 43, item 3).

Each runs in a child process that calls ``install_as_llama_cpp()`` first (the one line a user adds) and
then uses the framework as its documentation shows; the real llama-cpp-python is never installed here.
The tiny model's text is random, so what is asserted is what the frameworks promise: shapes, streaming
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

chat = ChatLlamaCpp(model_path=MODEL, temperature=0, max_tokens=8, model_kwargs={"chat_format": "chatml"},
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


def test_langchain_chat_llm_and_embeddings(tiny_model_path, tmp_path, vocab_dir):
    bert = write_tiny_bert(tmp_path / "bert.gguf", vocab_dir / "ggml-vocab-llama-spm.gguf")
    out = _run(_LANGCHAIN, MODEL=tiny_model_path, BERT=bert)
    assert isinstance(out["reply"], str) and out["reply"]
    assert "".join(out["chunks"]).rstrip("\ufffd") == out["reply"].rstrip("\ufffd")  # (the same run, in pieces)
    (call,) = out["tool_calls"]
    assert call["name"] == "Weather" and call["args"]["city"] in ("Paris", "Rome") and call["args"]["days"] in (1, 2, 3)
    assert out["structured"]["city"] in ("Paris", "Rome")
    assert isinstance(out["text"], str) and "".join(out["pieces"]) == out["text"]
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


def test_llama_index_complete_chat_and_stream(tiny_model_path, llama_index_path):
    out = _run(_LLAMA_INDEX, llama_index_path, MODEL=tiny_model_path)
    assert out["text"] and "".join(d or "" for d in out["deltas"]) == out["text"]
    assert isinstance(out["chat"], str) and out["chat"]
    assert "".join(d or "" for d in out["streamed"]).strip() == out["chat"].strip()
    assert out["window"] == 512


_OUTLINES = '''
from typing import Literal
from pydantic import BaseModel
import llama_cpp, outlines

class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: int

llm = llama_cpp.Llama(MODEL, chat_format="chatml", verbose=False)
chat_mode = outlines.from_llamacpp(llm)
weather = chat_mode("Weather?", Weather, max_tokens=100, temperature=0)
choice = chat_mode("Yes or no?", Literal["yes", "no"], max_tokens=5)
plain = outlines.from_llamacpp(llm, chat_mode=False)
plain_choice = plain("The quick brown fox", Literal["jumps", "sleeps"], max_tokens=5)
streamed = list(plain.stream("The quick brown fox", Literal["jumps", "sleeps"], max_tokens=5))
print(json.dumps({"weather": weather, "choice": choice, "plain": plain_choice, "streamed": streamed}))
'''


def test_outlines_json_schema_and_choice(tiny_model_path):
    out = _run(_OUTLINES, MODEL=tiny_model_path)
    weather = json.loads(out["weather"])
    assert weather["city"] in ("Paris", "Rome") and isinstance(weather["days"], int)
    assert out["choice"] in ("yes", "no") and out["plain"] in ("jumps", "sleeps")
    assert "".join(out["streamed"]) in ("jumps", "sleeps")


_INSTRUCTOR = '''
from typing import Literal
from pydantic import BaseModel
import instructor, llama_cpp

class Weather(BaseModel):
    city: Literal["Paris", "Rome"]
    days: Literal[1, 2, 3]

llm = llama_cpp.Llama(MODEL, chat_format="chatml", verbose=False)
create = instructor.patch(create=llm.create_chat_completion_openai_v1, mode=instructor.Mode.JSON_SCHEMA)
weather = create(messages=[{"role": "user", "content": "Weather in Rome?"}], response_model=Weather,
                 max_tokens=200, temperature=0)
assert isinstance(weather, Weather)
print(json.dumps(weather.model_dump()))
'''


def test_instructor_response_model(tiny_model_path):
    out = _run(_INSTRUCTOR, MODEL=tiny_model_path)
    assert out["city"] in ("Paris", "Rome") and out["days"] in (1, 2, 3)
