"""Interfaces: the command line, the OpenAI-compatible HTTP server, replicas on Ray Serve, the benchmark command."""
