"""Engines: the continuous-batching server (and, later, prefix cache, speculative decoding, model manager)."""
