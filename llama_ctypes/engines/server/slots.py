"""The slot pool and its KV: which sequence serves which request, and what each sequence holds.

With ``cache_prompt`` a finished request leaves its tokens in its sequence's
KV. A new request then goes to the free slot whose tokens share the longest
prefix with its prompt (its session's slot first; the least recently used
slot when nothing matches), keeps that prefix and drops the rest. With a
unified KV cache a longer prefix held by any other slot is adopted by a
metadata-only sequence copy, so a shared system prompt is computed once. A
second-level RAM cache keeps the states of evicted prefixes (see
``prompt_cache.py``).

Recurrent and hybrid memories cannot drop a tail of their state: there only
a request that continues a slot's whole history exactly reuses it. A
sliding-window cache (``swa_full=False``) drops cells that fell out of the
window; a prefix is reused, adopted or restored only while the window before
its end is still held (``KVOps.complete``), as llama-server checks.
"""

from __future__ import annotations

import itertools
import os
import struct
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import numpy as np

from ... import telemetry
from ...core.positions import PositionMap
from ...core.prompt import common_prefix
from ...errors import InvalidArgumentError
from .prompt_cache import PromptCache
from .request import Request

#: Shortest evicted prefix worth saving in the RAM cache, in tokens.
MIN_SAVED_TOKENS = 16

#: A sliding-window prompt's checkpoint is taken this many tokens before its end (llama-server's offset): the
#: same prompt again, or a next turn whose text reads back a little differently at the seam, still finds it
#: whole, and a cut back into the prompt's last batch is still complete.
CHECKPOINT_BACK = 4

#: The KV tag of prefixes computed by the base model alone (no LoRA adapter from position 0 on).
BASE_TAG: tuple = ((0, ()),)
_BASE = BASE_TAG


def _whole_media(prompt: list[int], n: int) -> int:
    """``n`` reusable entries of ``prompt``, moved back to the start of a media span they would split (a
    MediaPrompt's image or clip is decoded whole)."""
    cut = getattr(prompt, "cut_point", None)
    return cut(n) if cut is not None else n


def agreement(a: Any, b: Any) -> int:
    """How many leading positions two KV tags (``((start, LoraSet), ...)``) compute under the same
    adapters: a prefix held under ``a`` serves a request tagged ``b`` up to there."""
    if a == b:
        return 1 << 62
    points = sorted({start for start, _ in a} | {start for start, _ in b})

    def at(tag: Any, pos: int) -> Any:
        current = ()
        for start, loras in tag:
            if start <= pos:
                current = loras
        return current

    for pos in points:
        if at(a, pos) != at(b, pos):
            return pos
    return 1 << 62


class KVOps(Protocol):
    """The KV operations the pool needs (implemented over the server's context). ``n``, ``keep``: a
    position (where a prefix ends: its token count unless an M-RoPE image in it took fewer positions).
    ``windowed``: a sliding-window cache, which cannot serve a prefix of a sequence that grew well past it;
    ``cut_floor``: the shortest prefix of the sequence that is still complete (a window's start + its size)."""

    windowed: bool

    def cut_floor(self, seq: int) -> int: ...
    def forget(self, seq: int) -> None: ...
    def complete(self, seq: int, n: int) -> bool: ...
    def truncate(self, seq: int, keep: int) -> bool: ...
    def copy(self, src: int, dst: int, n: int) -> None: ...
    def save(self, seq: int) -> bytes: ...
    def restore(self, seq: int, state: bytes) -> bool: ...
    def last_position(self, seq: int) -> int: ...


@dataclass(eq=False)
class Slot:
    """One sequence (``seq_id``) of the server's context."""

    seq_id: int
    request: Request | None = None
    tokens: list[int] = field(default_factory=list)  # tokens whose KV this sequence holds
    last_used: int = 0
    session: Any = None
    sample: Callable[[int], int] | None = None  # the request's sampler, bound to the context
    kv_tag: Any = ((0, ()),)  # which LoRA sets computed its tokens, by position (Request.kv_tag)
    positions: PositionMap = field(default_factory=PositionMap)  # (M-RoPE media in ``tokens``)

    @property
    def free(self) -> bool:
        return self.request is None

    @property
    def n_past(self) -> int:
        return len(self.tokens)

    @property
    def next_pos(self) -> int:
        """The position of the next token in the sequence (``n_past`` unless M-RoPE media took fewer)."""
        return len(self.tokens) + self.positions.shift

    def hold(self, prompt: list[int], n: int) -> None:
        """The sequence holds ``prompt[:n]`` now."""
        self.tokens = prompt[:n]
        self.positions = PositionMap.of(prompt, n)

    def drop(self) -> None:
        """The sequence holds nothing now."""
        self.tokens = []
        self.positions.clear()

    def cut(self, n: int) -> None:
        """The sequence holds its first ``n`` tokens now (never a part of a media chunk)."""
        self.positions.cut(n)
        del self.tokens[n:]

    def add_media(self, tokens: list[int], n_pos: int) -> None:
        """A media chunk's placeholders were decoded at the end, taking ``n_pos`` positions."""
        self.positions.add(len(self.tokens), len(tokens), n_pos)
        self.tokens += tokens


#: llama.cpp's sequence state files: magic 'ggsq' (LLAMA_STATE_SEQ_MAGIC) and LLAMA_STATE_SEQ_VERSION.
_SEQ_MAGIC, _SEQ_VERSION = 0x67677371, 3
#: llama-server packs a slot's tokens behind this header: LLAMA_TOKEN_NULL, a version, the token count.
_PACKED = -1


def write_state_file(path: str | os.PathLike, tokens: Sequence[int], state: Any) -> None:
    """A sequence state file as ``llama_state_seq_save_file`` writes it: magic, version, the token count,
    the tokens (int32), then the sequence's state (``llama_state_seq_get_data``)."""
    with open(path, "wb") as f:
        f.write(struct.pack("<III", _SEQ_MAGIC, _SEQ_VERSION, len(tokens)))
        f.write(np.asarray(tokens, dtype="<i4").tobytes())
        f.write(memoryview(state).cast("B"))


def read_state_file(path: str | os.PathLike, n_vocab: int | None = None) -> tuple[list[int], np.ndarray]:
    """(tokens, state) of a sequence state file, ours or llama-server's (whose tokens may be packed); with
    ``n_vocab``, a token id outside the vocabulary refuses it (a slot's tokens go back to llama.cpp: drafts,
    detokenizing)."""
    with open(path, "rb") as f:
        head = f.read(12)
        if len(head) != 12:
            raise InvalidArgumentError(f"{path}: not a sequence state file (too short)")
        magic, version, n = struct.unpack("<III", head)
        if magic != _SEQ_MAGIC or version != _SEQ_VERSION:
            raise InvalidArgumentError(f"{path}: not a llama.cpp sequence state file of version {_SEQ_VERSION}")
        raw = f.read(4 * n)
        if len(raw) != 4 * n:
            raise InvalidArgumentError(f"{path}: the file ends inside its token list")
        tokens = np.frombuffer(raw, dtype="<i4").tolist()
        state = np.frombuffer(f.read(), dtype=np.uint8)
    if tokens and tokens[0] == _PACKED:  # llama-server's packed tokens: NULL, version, count, tokens, media
        if len(tokens) < 3 or tokens[2] > len(tokens) - 3:
            raise InvalidArgumentError(f"{path}: a packed token list that does not hold its own count")
        packed, tokens = tokens[3 + tokens[2]:], tokens[3:3 + tokens[2]]
        if packed:
            raise InvalidArgumentError(f"{path}: the slot held images or audio, which this server cannot restore")
    if any(t < 0 for t in tokens):
        raise InvalidArgumentError(f"{path}: the slot held images or audio, which this server cannot restore")
    if n_vocab is not None and any(t >= n_vocab for t in tokens):
        raise InvalidArgumentError(f"{path}: a token id past this model's vocabulary of {n_vocab} (another model?)")
    return tokens, state


@dataclass
class CacheStats:
    hits: int = 0  # requests that reused some cached prefix
    misses: int = 0
    cached_tokens: int = 0  # prompt tokens served from cache
    adopted: int = 0  # prefixes copied from another slot
    restored: int = 0  # prefixes restored from the RAM cache
    checkpoints: int = 0  # prompts' states kept in the RAM cache as they were read (sliding-window caches)
    instabilities: int = 0


class SlotPool:
    """``n_parallel`` slots over one context, with prefix reuse."""

    def __init__(self, n_parallel: int, kv: KVOps, *, unified: bool, partial_reuse: bool,
                 ram_cache: PromptCache | None = None):
        self.slots = [Slot(i) for i in range(n_parallel)]
        self.kv = kv
        self.unified = unified
        self.partial_reuse = partial_reuse  # False for recurrent/hybrid memories
        self.ram = ram_cache
        self.stats = CacheStats()
        self._clock = itertools.count(1)

    @property
    def active(self) -> list[Slot]:
        return [s for s in self.slots if not s.free]

    @property
    def n_free(self) -> int:
        return sum(1 for s in self.slots if s.request is None)

    @property
    def n_active(self) -> int:
        return sum(1 for s in self.slots if s.request is not None)

    # ---- acquire ------------------------------------------------------------------------------
    def _reusable(self, slot: Slot, prompt: list[int], tag: Any = _BASE) -> int:
        """Prompt tokens ``slot``'s sequence can serve to a request whose tokens are computed as ``tag``
        says (at least one prompt token stays to decode)."""
        tokens = slot.tokens
        c = _whole_media(prompt, min(common_prefix(tokens, prompt), len(prompt) - 1, agreement(slot.kv_tag, tag)))
        if not self.partial_reuse and c < len(tokens):
            return 0  # a recurrent state cannot be cut back
        if slot.positions.splits(c):
            return 0  # (the same placeholders as other chunks: never with one projector, but cheap to rule out)
        if c > 0 and not self.kv.complete(slot.seq_id, slot.positions.pos(c)):
            return 0  # a sliding-window cache already dropped cells this prefix needs
        return c

    def acquire(self, request: Request, promised: frozenset[int] = frozenset()) -> Slot | None:
        """A free slot for ``request`` with as much of its prompt in KV as the caches allow: its pinned
        slot (``request.pin``), else any free slot not ``promised`` to a pinned request."""
        if request.pin is not None:
            free = [s for s in self.slots if s.free and s.seq_id == request.pin]
        else:
            free = [s for s in self.slots if s.free and s.seq_id not in promised]
        if not free:
            return None
        prompt = request.prompt
        cache = request.params.cache_prompt
        slot = None
        if request.pin is not None:
            slot = free[0]
        elif cache and request.session is not None:
            slot = next((s for s in free if s.session == request.session), None)
        tag = request.kv_tag
        if slot is None and cache:
            reuse = {s.seq_id: self._reusable(s, prompt, tag) for s in free}
            best = max(free, key=lambda s: (reuse[s.seq_id], -s.last_used))
            if reuse[best.seq_id] > 0:
                slot = best
        if slot is None:
            slot = min(free, key=lambda s: s.last_used)
        reused = self._reusable(slot, prompt, tag) if cache else 0
        if cache and request.session is not None and slot.session == request.session \
                and 0 < common_prefix(slot.tokens, prompt) < len(slot.tokens) - 1:
            # The session's history changed before its end (e.g. a template rewrote earlier turns).
            self.stats.instabilities += 1
            telemetry.emit("server.prefix_instability", {
                "cached_tokens": len(slot.tokens), "common_tokens": common_prefix(slot.tokens, prompt)},
                {"id": request.id, "session": request.session, "seq_id": slot.seq_id})
        if cache and request.pin is None:  # (a pinned request reads its own slot's cache, as llama-server)
            reused = self._better_source(slot, prompt, reused, tag)
        self._keep_prefix(slot, reused)
        slot.kv_tag = tag  # (what it keeps agrees with the request's tag; what it adds follows it)
        slot.request = request
        slot.session = request.session
        slot.last_used = next(self._clock)
        request.n_prefilled = reused
        request.cached_tokens = reused
        if reused:
            self.stats.hits += 1
            self.stats.cached_tokens += reused
        else:
            self.stats.misses += 1
        return slot

    def _better_source(self, slot: Slot, prompt: list[int], reused: int, tag: Any = _BASE) -> int:
        """Adopt a longer prefix computed as ``tag`` says from another slot (unified KV) or the RAM
        cache; returns the reuse length."""
        if self.unified and self.partial_reuse:
            donor, n = None, reused
            for other in self.slots:
                if other is not slot:
                    c = _whole_media(prompt, min(common_prefix(other.tokens, prompt), len(prompt) - 1,
                                                 agreement(other.kv_tag, tag)))
                    if c > n and not other.positions.splits(c) \
                            and self.kv.complete(other.seq_id, other.positions.pos(c)):
                        donor, n = other, c
            if donor is not None:
                self._evict(slot)
                self.kv.copy(donor.seq_id, slot.seq_id, donor.positions.pos(n))
                slot.hold(prompt, n)
                self.stats.adopted += 1
                return n
        if self.ram is not None and not self.ram.empty:
            # The entry sharing the longest prefix, cut back to it, and the longest entry that is a prefix of the
            # prompt as a whole (a checkpoint), restored as it is: the deeper first. An entry whose window no
            # longer holds the cells before the cut (its floor) is not tried: a saved sliding-window state holds
            # only the window before its end.
            tries = []
            for exact in ((False, True) if self.partial_reuse else (True,)):
                entry, n = self.ram.lookup(prompt, exact_only=exact, tag=tag)
                n = _whole_media(prompt, min(n, len(prompt) - 1))
                whole = entry is not None and n == len(entry.tokens)
                if entry is None or n <= reused or (not whole and (exact or not self.partial_reuse)) \
                        or (not whole and entry.floor > n):
                    continue
                tries.append((n, whole, entry))
            for n, whole, entry in sorted(tries, key=lambda t: -t[0]):
                if n <= reused:
                    continue
                if slot.tokens:
                    self._evict(slot)
                at = PositionMap.of(prompt, n).pos(n)  # (the entry's tokens up to n are the prompt's)
                if self.kv.restore(slot.seq_id, entry.state) and (whole or self.kv.truncate(slot.seq_id, at)) \
                        and self.kv.complete(slot.seq_id, at):
                    slot.hold(prompt, n)
                    self.stats.restored += 1
                    return n
                self.kv.forget(slot.seq_id)
                slot.drop()
                reused = 0  # (the slot's own prefix went with the failed restore)
        return reused

    def _keep_prefix(self, slot: Slot, n: int) -> None:
        """Cut the slot's KV back to its first ``n`` tokens (saving what is dropped, if worth it)."""
        if n >= len(slot.tokens):
            return
        if n == 0:
            self._evict(slot)
            return
        self._save(slot)
        if self.kv.truncate(slot.seq_id, slot.positions.pos(n)):
            slot.cut(n)
            if self.kv.windowed:
                # Where two prompts part (a shared system prompt, say): a third one sharing it finds it whole in
                # RAM, where a saved state (only its window) can never be cut back to it.
                self.checkpoint(slot)
        else:
            self.kv.forget(slot.seq_id)
            slot.drop()

    def checkpoint_at(self, request: Request) -> int | None:
        """The prompt length at which ``request``'s state is kept in the RAM cache as its prompt is read (a
        checkpoint: the scheduler ends a prompt chunk there, then calls :meth:`checkpoint`), or None.

        On a sliding-window cache only (llama-server's context checkpoints): a saved state holds only the
        window before its end, so it can never be cut back; a conversation's next turn extends this prompt and
        restores the checkpoint whole, where the state saved when the slot is taken over holds the reply too.
        :data:`CHECKPOINT_BACK` tokens before the prompt's end, as llama-server (at its end with images or
        audio, which a cut must not split): the same prompt again, or a next turn whose text reads back
        differently in those last tokens, still finds it whole. Those tokens then take a batch of their own,
        a tick more before the first token (bench/prefix_cache.py, 4 busy slots: TTFT median 314 ms, 252 ms
        with the checkpoint at the end); at the end, 8 conversations per slot recomputed 3x the tokens and the
        p90 was 12x (bench/prefix_cache_http.py 8x3t1k: 6832 tokens, 2900 ms against 2296, 243 ms)."""
        if self.ram is None or not self.kv.windowed or not request.params.cache_prompt:
            return None
        n = len(request.prompt) - (0 if request.has_media else CHECKPOINT_BACK)
        if n < MIN_SAVED_TOKENS:  # (a short prompt: kept whole, not split)
            n = len(request.prompt)
        return n if n >= MIN_SAVED_TOKENS and n > request.n_prefilled else None

    def checkpoint(self, slot: Slot) -> None:
        """Keep ``slot``'s state in the RAM cache (its request's prompt read up to its checkpoint, or its prefix
        cut back to where a new prompt parts from it)."""
        if self.ram is not None and len(slot.tokens) >= MIN_SAVED_TOKENS:
            self.ram.put(list(slot.tokens), self.kv.save(slot.seq_id), tag=slot.kv_tag,
                         floor=self.kv.cut_floor(slot.seq_id))
            self.stats.checkpoints += 1

    def rollback(self, slot: Slot, keep: int) -> bool:
        """Cut a running slot's sequence back to its first ``keep`` tokens (rejected drafts);
        False when the memory cannot (nothing changed then)."""
        if keep >= len(slot.tokens):
            return True
        if not self.kv.truncate(slot.seq_id, slot.positions.pos(keep)):
            return False
        slot.cut(keep)
        return True

    # ---- slot files (llama-server's /slots/{id}?action=save|restore|erase) ------------------------
    def save_file(self, slot: Slot, path: str | os.PathLike) -> int:
        """Write a free slot's tokens and KV state in llama.cpp's sequence state format; the token count.
        Refused for a cache computed with LoRA adapters: the file cannot say so, and a restore would
        hand it to requests without them."""
        if slot.kv_tag != _BASE and slot.tokens:
            raise InvalidArgumentError(f"slot {slot.seq_id} holds a cache computed with LoRA adapters; slot files "
                                       "carry no adapter information")
        if any(t < 0 for t in slot.tokens):
            raise InvalidArgumentError(f"slot {slot.seq_id} holds images or audio; slot files carry token ids only")
        write_state_file(path, slot.tokens, self.kv.save(slot.seq_id))
        return len(slot.tokens)

    def restore_file(self, slot: Slot, path: str | os.PathLike, n_vocab: int | None = None) -> int:
        """Load a sequence state file into a free slot (what it held is dropped first); the token count.
        ``n_vocab``: the model's, which every token id of the file must be under."""
        tokens, state = read_state_file(path, n_vocab)
        self._evict(slot)
        if not self.kv.restore(slot.seq_id, state):
            self.kv.forget(slot.seq_id)
            raise InvalidArgumentError(f"{path}: llama.cpp refused the state (another model or context size?)")
        # The token list and the state must describe the same sequence: one KV position per token, or a
        # later request would trust a cache that is not there (or decode onto cells that are).
        last = self.kv.last_position(slot.seq_id)
        if last != len(tokens) - 1 or not self.kv.complete(slot.seq_id, len(tokens)):
            self.kv.forget(slot.seq_id)
            raise InvalidArgumentError(f"{path}: its state holds {last + 1} positions, not one per each of its "
                                       f"{len(tokens)} tokens")
        slot.drop()
        slot.tokens = list(tokens)  # (files hold no media: every token at its own position)
        slot.kv_tag = _BASE  # (a saved slot's adapters are not in the file: taken as the base model's)
        slot.session = None
        slot.last_used = next(self._clock)
        return len(tokens)

    def erase(self, slot: Slot) -> int:
        """Drop a free slot's tokens and KV (not into the RAM cache: erased is erased); the token count."""
        n = len(slot.tokens)
        self.kv.forget(slot.seq_id)
        slot.drop()
        slot.session = None
        return n

    # ---- release and eviction ---------------------------------------------------------------------
    def release(self, slot: Slot, keep: bool) -> None:
        """Free a slot; with ``keep`` its tokens stay in KV for the next request."""
        slot.request = None
        slot.sample = None
        slot.last_used = next(self._clock)
        if not keep:
            self.kv.forget(slot.seq_id)
            slot.drop()

    def evict_idle(self) -> int:
        """Drop the KV of every free slot (under KV pressure); returns how many were dropped."""
        dropped = 0
        for slot in self.slots:
            if slot.free and slot.tokens:
                self._evict(slot)
                dropped += 1
        return dropped

    def _evict(self, slot: Slot) -> None:
        if slot.tokens:
            self._save(slot)
            self.kv.forget(slot.seq_id)
            slot.drop()

    def persist(self) -> int:
        """Write every slot's prefix computed by the base model to the disk tier (the server is closing: the
        next one on this model starts with them); how many were queued."""
        disk = self.ram.disk if self.ram is not None else None
        if disk is None:
            return 0
        n = 0
        for slot in self.slots:
            if len(slot.tokens) >= MIN_SAVED_TOKENS and slot.kv_tag == _BASE:
                n += disk.put(list(slot.tokens), self.kv.save(slot.seq_id), self.kv.cut_floor(slot.seq_id))
        return n

    def forget_adapter(self, adapter: Any) -> int:
        """Drop every cached prefix computed under a set holding ``adapter`` (being unloaded): the free
        slots' KV and the RAM cache's entries. Returns how many were dropped."""
        def doomed(tag: Any) -> bool:
            return any(a is adapter for _, loras in tag for a, _ in loras)

        dropped = 0
        for slot in self.slots:
            if slot.free and doomed(slot.kv_tag):
                if slot.tokens:
                    self.kv.forget(slot.seq_id)
                    slot.drop()
                    dropped += 1
                slot.kv_tag = _BASE
        if self.ram is not None:
            dropped += self.ram.drop_tags(doomed)
        return dropped

    def _save(self, slot: Slot) -> None:
        if self.ram is not None and len(slot.tokens) >= MIN_SAVED_TOKENS:
            self.ram.put(slot.tokens, self.kv.save(slot.seq_id), tag=slot.kv_tag, floor=self.kv.cut_floor(slot.seq_id))
