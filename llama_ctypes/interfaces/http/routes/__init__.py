"""The endpoints, one module per group: chat, completions, embeddings (and rerank), service."""
