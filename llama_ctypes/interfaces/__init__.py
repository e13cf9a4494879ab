"""Interfaces: the command line (and, later, HTTP)."""
