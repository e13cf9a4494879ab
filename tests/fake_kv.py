"""A stand-in for the slot pool's KV operations (``slots.KVOps``), for tests without a model."""

from __future__ import annotations


class FakeKV:
    """Records every KV call; ``partial=False`` behaves like a recurrent memory (no tail cut)."""

    def __init__(self, partial: bool = True, state_size: int = 100, windowed: bool = False):
        self.partial = partial
        self.windowed = windowed
        self.state_size = state_size
        self.calls: list[tuple] = []

    def complete(self, seq, n):
        return True

    def cut_floor(self, seq):
        return 0

    def forget(self, seq):
        self.calls.append(("forget", seq))

    def truncate(self, seq, keep):
        self.calls.append(("truncate", seq, keep))
        return self.partial

    def copy(self, src, dst, n):
        self.calls.append(("copy", src, dst, n))

    def save(self, seq):
        return b"x" * self.state_size

    def restore(self, seq, state):
        return True
