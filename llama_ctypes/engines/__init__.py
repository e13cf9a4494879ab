"""Engines: the continuous-batching server (with its prefix cache), speculative decoding, the model manager."""
