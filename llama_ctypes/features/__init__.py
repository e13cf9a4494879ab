"""Features built on the core: chat templates and chat, (later) grammar, schema, embeddings, hub."""
