"""Features built on the core: chat templates and chat, OpenAI shapes, tool calls, grammars, schemas,
structured output, embeddings and reranking, the Hub client."""
