"""Second-level prompt cache: KV states of evicted prefixes, kept in RAM.

When a slot's cached tokens are about to be overwritten, its sequence state
(``llama_state_seq_get_data``) is saved here under its token sequence. A new
request looks up the stored sequence sharing the longest prefix with its
prompt through a token trie (walk the prompt, not scan the entries), and the
state is restored into its slot. Entries are evicted least-recently-used
first to stay within the byte budget.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field


@dataclass(eq=False)
class Entry:
    tokens: tuple[int, ...]
    state: bytes

    @property
    def nbytes(self) -> int:
        return len(self.state)


@dataclass(eq=False)
class _Node:
    children: dict[int, "_Node"] = field(default_factory=dict)
    entry: Entry | None = None  # a stored sequence that ends exactly here
    below: int = 0  # entries in this subtree, including this node's


class PromptCache:
    """Byte-budgeted LRU of sequence states, looked up by longest common prefix."""

    def __init__(self, budget_bytes: int):
        if budget_bytes < 0:
            raise ValueError("prompt cache budget must be >= 0")
        self.budget = budget_bytes
        self.used = 0
        self._root = _Node()
        self._lru: OrderedDict[tuple[int, ...], Entry] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def __len__(self) -> int:
        return len(self._lru)

    def put(self, tokens: list[int], state: bytes) -> bool:
        """Store a sequence's state; False when it alone exceeds the budget."""
        key = tuple(tokens)
        if not key or len(state) > self.budget:
            return False
        if key in self._lru:
            self._remove(self._lru[key])
        entry = Entry(key, state)
        node = self._root
        node.below += 1
        for tok in key:
            node = node.children.setdefault(tok, _Node())
            node.below += 1
        node.entry = entry
        self._lru[key] = entry
        self.used += entry.nbytes
        while self.used > self.budget:
            self._remove(next(iter(self._lru.values())))
        return True

    def lookup(self, prompt: list[int], exact_only: bool = False) -> tuple[Entry | None, int]:
        """The entry sharing the longest prefix with ``prompt``, and that prefix's length.

        With ``exact_only`` the entry must be a prefix of the prompt as a whole
        (what a recurrent memory can resume from).
        """
        node, depth = self._root, 0
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
            found = (self._any_entry(node), depth)
        if found[0] is not None:
            self._lru.move_to_end(found[0].tokens)
            self.hits += 1
        else:
            self.misses += 1
        return found

    def _any_entry(self, node: _Node) -> Entry | None:
        while node.entry is None:
            node = next((c for c in node.children.values() if c.below), None)
            if node is None:
                return None
        return node.entry

    def _remove(self, entry: Entry) -> None:
        del self._lru[entry.tokens]
        self.used -= entry.nbytes
        node = self._root
        path = [node]
        for tok in entry.tokens:
            node = node.children[tok]
            path.append(node)
        node.entry = None
        for i, n in enumerate(path):
            n.below -= 1
        # prune empty branches
        for parent, tok, child in reversed([(path[i], entry.tokens[i], path[i + 1]) for i in range(len(entry.tokens))]):
            if child.below == 0:
                del parent.children[tok]
