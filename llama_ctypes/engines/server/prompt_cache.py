"""Second-level prompt cache: KV states of evicted prefixes, kept in RAM.

When a slot's cached tokens are about to be overwritten, its sequence state
(``llama_state_seq_get_data``) is saved here under its token sequence. A new
request looks up the stored sequence sharing the longest prefix with its
prompt through a token trie (walk the prompt, not scan the entries), and the
state is restored into its slot. Entries are evicted least-recently-used
first to stay within the byte budget. With a disk tier (``prompt_cache_disk.py``)
every state of the base model is also written to a file, and a lookup the RAM
cannot serve as far is tried there.
"""

from __future__ import annotations

from ...errors import InvalidArgumentError

from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from .prompt_cache_disk import DiskPromptCache

#: Approximate Python memory per token of a stored sequence: its trie node (object, child dict,
#: key) and its slot in the entry's token tuple (measured with tracemalloc: about 316 bytes).
NODE_BYTES = 320


@dataclass(eq=False)
class Entry:
    tokens: tuple[int, ...]
    state: Any  # a bytes-like sequence state (len() = bytes)
    tag: Any = ()  # what else the state depends on (the LoRA set it was computed under)
    floor: int = 0  # its shortest prefix still complete once restored (a sliding window's start + size)

    @property
    def nbytes(self) -> int:
        return len(self.state)


class _Node:
    __slots__ = ("children", "entry", "below")

    def __init__(self) -> None:
        self.children: dict[int, _Node] = {}
        self.entry: Entry | None = None  # a stored sequence that ends exactly here
        self.below = 0  # entries in this subtree, including this node's


class PromptCache:
    """Byte-budgeted LRU of sequence states, looked up by longest common prefix.

    ``on_evict(entry)`` is called for each entry dropped to stay within the budget. ``disk``: a tier of
    files behind this one, for the states computed under ``disk_tag`` (the base model's)."""

    def __init__(self, budget_bytes: int, *, on_evict: Callable[[Entry], None] | None = None,
                 disk: "DiskPromptCache | None" = None, disk_tag: Any = ()):
        if budget_bytes < 0:
            raise InvalidArgumentError("prompt cache budget must be >= 0")
        self.budget = budget_bytes
        self._on_evict = on_evict
        self.disk = disk
        self._disk_tag = disk_tag
        self.state_bytes = 0
        self.nodes = 0  # trie nodes, the root excepted
        self._roots: dict[Any, _Node] = {}  # one trie per tag: a state is found only under its own tag
        self._lru: OrderedDict[tuple[Any, tuple[int, ...]], Entry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        """Entries in RAM."""
        return len(self._lru)

    @property
    def empty(self) -> bool:
        """Nothing to look up, in RAM or on disk."""
        return not self._lru and (self.disk is None or len(self.disk) == 0)

    def contains(self, tokens: tuple[int, ...], tag: Any = ()) -> bool:
        return (tag, tokens) in self._lru

    @property
    def used(self) -> int:
        """Bytes counted against the budget: the states plus the trie's approximate size."""
        return self.state_bytes + self.nodes * NODE_BYTES

    def put(self, tokens: list[int], state: Any, tag: Any = (), floor: int = 0) -> bool:
        """Store a sequence's state (computed under ``tag``; complete when cut back to ``floor`` tokens or
        more); False when it alone exceeds the budget."""
        if self.disk is not None and tag == self._disk_tag:
            self.disk.put(tokens, state, floor)
        return self._put_ram(tokens, state, tag, floor)

    def _put_ram(self, tokens: list[int], state: Any, tag: Any, floor: int) -> bool:
        key = tuple(tokens)
        if not key or len(state) + len(key) * NODE_BYTES > self.budget:
            return False
        if (tag, key) in self._lru:
            self._remove(self._lru[(tag, key)])
        entry = Entry(key, state, tag, floor)
        node = self._roots.get(tag)
        if node is None:
            node = self._roots[tag] = _Node()
        node.below += 1
        for tok in key:
            child = node.children.get(tok)
            if child is None:
                child = node.children[tok] = _Node()
                self.nodes += 1
            node = child
            node.below += 1
        node.entry = entry
        self._lru[(tag, key)] = entry
        self.state_bytes += entry.nbytes
        while self.used > self.budget:
            oldest = next(iter(self._lru.values()))
            self._remove(oldest)
            if self._on_evict is not None:
                self._on_evict(oldest)
        return True

    def lookup(self, prompt: list[int], exact_only: bool = False, tag: Any = ()) -> tuple[Entry | None, int]:
        """The entry of ``tag`` sharing the longest prefix with ``prompt``, and that prefix's length (among
        those, one that can be cut back to it: its ``floor`` not past it, when there is one).

        With ``exact_only`` the entry must be a prefix of the prompt as a whole
        (what a recurrent memory can resume from). With a disk tier, a file sharing a longer prefix than any
        entry in RAM is read back (into RAM, when it fits).
        """
        found = self._lookup_ram(prompt, exact_only, tag)
        if self.disk is None or tag != self._disk_tag or found[1] >= len(prompt):
            return found
        on_disk, n = self.disk.find(prompt, exact_only)
        if on_disk is None or n <= found[1]:
            return found
        entry = self.disk.load(on_disk)
        if entry is None:
            return found
        if self._put_ram(list(entry.tokens), entry.state, tag, entry.floor):
            entry = self._lru[(tag, entry.tokens)]
        return entry, n

    def _lookup_ram(self, prompt: list[int], exact_only: bool, tag: Any) -> tuple[Entry | None, int]:
        node, depth = self._roots.get(tag), 0
        if node is None:
            self.misses += 1
            return None, 0
        best_exact: tuple[Entry | None, int] = (None, 0)
        for tok in prompt:
            child = node.children.get(tok)
            if child is None or child.below == 0:
                break
            node, depth = child, depth + 1
            if node.entry is not None:
                best_exact = (node.entry, depth)
        if exact_only or depth == 0:
            found = best_exact
        else:
            found = (self._any_entry(node, min(depth, len(prompt) - 1)), depth)  # (a cut leaves a token to read)
        if found[0] is not None:
            self._lru.move_to_end((tag, found[0].tokens))
            self.hits += 1
        else:
            self.misses += 1
        return found

    def _any_entry(self, node: _Node, depth: int, budget: int = 4096) -> Entry | None:
        """An entry below ``node`` whose floor allows a cut at ``depth`` (looking at up to ``budget`` nodes),
        else the first one found."""
        first: Entry | None = None
        stack = [node]
        while stack and budget > 0:
            budget -= 1
            here = stack.pop()
            entry = here.entry
            if entry is not None:
                if entry.floor <= depth:
                    return entry
                if first is None:
                    first = entry
            stack.extend(c for c in here.children.values() if c.below)
        if first is None:  # (the budget ran out first)
            while node.entry is None:
                node = next(c for c in node.children.values() if c.below)
            first = node.entry
        return first

    def drop_tags(self, doomed: Callable[[Any], bool]) -> int:
        """Remove every entry whose tag ``doomed(tag)`` (e.g. computed under an unloaded adapter)."""
        entries = [e for e in self._lru.values() if doomed(e.tag)]
        for entry in entries:
            self._remove(entry)
        return len(entries)

    def remove(self, entry: Entry) -> None:
        """Drop ``entry`` (one this cache holds)."""
        self._remove(entry)

    def close(self) -> None:
        """Write what the disk tier has queued; the RAM entries go with this object."""
        if self.disk is not None:
            self.disk.close()

    def _remove(self, entry: Entry) -> None:
        del self._lru[(entry.tag, entry.tokens)]
        self.state_bytes -= entry.nbytes
        node = self._roots[entry.tag]
        path = [node]
        for tok in entry.tokens:
            node = node.children[tok]
            path.append(node)
        node.entry = None
        for i, n in enumerate(path):
            n.below -= 1
        # prune the branch no entry uses any more (the first empty node on the path, and all below it)
        for i in range(1, len(path)):
            if path[i].below == 0:
                del path[i - 1].children[entry.tokens[i - 1]]
                self.nodes -= len(path) - i
                break
        if path[0].below == 0:
            del self._roots[entry.tag]
