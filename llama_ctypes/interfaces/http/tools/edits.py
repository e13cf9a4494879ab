"""edit_file's matching, as llama-server does it: exact replacement, else a whitespace/typography-tolerant match.

Everything works on bytes, so a file that is not valid UTF-8 is rewritten byte for byte outside the edits.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

# smart quotes, dashes and odd spaces that models and editors swap for their ASCII look-alikes
_FUZZY_REPLACEMENTS: tuple[tuple[bytes, bytes], ...] = (
    *((b"\xe2\x80" + bytes([b]), b"'") for b in (0x98, 0x99, 0x9A, 0x9B)),
    *((b"\xe2\x80" + bytes([b]), b'"') for b in (0x9C, 0x9D, 0x9E, 0x9F)),
    *((b"\xe2\x80" + bytes([b]), b"-") for b in range(0x90, 0x96)),
    (b"\xe2\x88\x92", b"-"),  # minus sign
    (b"\xc2\xa0", b" "),  # no-break space
    *((b"\xe2\x80" + bytes([b]), b" ") for b in range(0x82, 0x8B)),
    (b"\xe2\x80\xaf", b" "),  # narrow no-break space
    (b"\xe2\x81\x9f", b" "),  # medium mathematical space
    (b"\xe3\x80\x80", b" "),  # ideographic space
)


class EditError(ValueError):
    """An edit that cannot be applied; the message is llama-server's."""


@dataclass
class MatchedEdit:
    """One edit located in the base content: its request index, byte offset and length, and replacement."""

    edit_index: int
    match_index: int
    match_length: int
    new_text: bytes


def _normalize_line(line: bytes) -> bytes:
    line = line.rstrip(b" \t\r")
    for old, new in _FUZZY_REPLACEMENTS:
        line = line.replace(old, new)
    return line


def normalize_for_fuzzy_match(content: bytes) -> bytes:
    """Trailing blanks stripped and typography made ASCII, line by line; the line count is preserved."""
    return b"\n".join(_normalize_line(line) for line in content.split(b"\n"))


def count_occurrences(content: bytes, needle: bytes) -> int:
    """Non-overlapping occurrences of ``needle`` (0 for an empty needle)."""
    return content.count(needle) if needle else 0


def _split_on_newline(content: bytes) -> list[bytes]:
    # bytes.splitlines also splits on '\r'; llama-server splits on '\n' only
    lines = [line + b"\n" for line in content.split(b"\n")]
    lines[-1] = lines[-1][:-1]
    return lines if lines[-1] else lines[:-1]


def _apply(content: bytes, reps: Sequence[MatchedEdit], offset: int) -> bytes:
    # back to front, so earlier offsets stay valid
    for rep in reversed(reps):
        at = rep.match_index - offset
        content = content[:at] + rep.new_text + content[at + rep.match_length:]
    return content


def _line_range(spans: list[tuple[int, int]], start: int, length: int) -> tuple[int, int] | None:
    """The lines (start, exclusive end) a byte range touches, or None when it lies outside."""
    first = next((i for i, (s, e) in enumerate(spans) if s <= start < e), None)
    if first is None:
        return None
    last = first
    while last < len(spans) and spans[last][1] < start + length:
        last += 1
    if last >= len(spans):
        return None
    return first, last + 1


def _apply_preserving_unchanged_lines(original: bytes, base: bytes, reps: list[MatchedEdit], path: str) -> bytes:
    """Replacements located in the normalized ``base``; lines no edit touches are copied from ``original``,
    so a fuzzy match does not strip every other line's trailing blanks."""
    original_lines = _split_on_newline(original)
    spans = []
    offset = 0
    for line in _split_on_newline(base):
        spans.append((offset, offset + len(line)))
        offset += len(line)

    groups: list[tuple[int, int, list[MatchedEdit]]] = []
    for rep in reps:
        rng = _line_range(spans, rep.match_index, rep.match_length)
        if rng is None:
            # llama-server reads past its line table here; report the edit as not found instead
            raise EditError(f"could not find edits[{rep.edit_index}].old_text in {path}, "
                            "it must match the file's current content exactly")
        if groups and rng[0] < groups[-1][1]:
            start, end, members = groups[-1]
            groups[-1] = (start, max(end, rng[1]), [*members, rep])
        else:
            groups.append((rng[0], rng[1], [rep]))

    out = []
    line_index = 0
    for start, end, members in groups:
        out.extend(original_lines[line_index:start])
        lo, hi = spans[start][0], spans[end - 1][1]
        out.append(_apply(base[lo:hi], members, lo))
        line_index = end
    out.extend(original_lines[line_index:])
    return b"".join(out)


def apply_edits(original: bytes, edits: Sequence[tuple[bytes, bytes]], path: str) -> tuple[bytes, int]:
    """Apply ``(old_text, new_text)`` edits to ``original`` as llama-server's edit_file does: every old_text
    is matched against the original (not incrementally), must be unique and must not overlap another.
    Returns the new content and the number of edits; raises :class:`EditError` with llama-server's message."""
    fuzzy_original = normalize_for_fuzzy_match(original)
    any_fuzzy = False
    for i, (old, _new) in enumerate(edits):
        if old in original:
            continue
        if normalize_for_fuzzy_match(old) not in fuzzy_original:
            raise EditError(f"could not find edits[{i}].old_text in {path}, "
                            "it must match the file's current content exactly")
        any_fuzzy = True

    base = fuzzy_original if any_fuzzy else original
    matched = []
    for i, (old, new) in enumerate(edits):
        fuzzy_old = normalize_for_fuzzy_match(old)
        needle = fuzzy_old if any_fuzzy else old
        # uniqueness always counts on normalized text, so a whitespace-only duplicate still counts
        occurrences = count_occurrences(fuzzy_original, fuzzy_old)
        if occurrences > 1:
            raise EditError(f"found {occurrences} occurrences of edits[{i}].old_text in {path}, it must be unique")
        idx = base.find(needle)
        if idx < 0:
            # llama-server would go on with an invalid offset; report it as not found instead
            raise EditError(f"could not find edits[{i}].old_text in {path}, "
                            "it must match the file's current content exactly")
        matched.append(MatchedEdit(i, idx, len(needle), new))

    matched.sort(key=lambda m: m.match_index)
    for prev, cur in zip(matched, matched[1:]):
        if prev.match_index + prev.match_length > cur.match_index:
            raise EditError(f"edits[{prev.edit_index}] and edits[{cur.edit_index}] overlap in {path}; "
                            "merge them into one edit or target disjoint regions")

    if any_fuzzy:
        new_content = _apply_preserving_unchanged_lines(original, base, matched, path)
    else:
        new_content = _apply(base, matched, 0)
    if new_content == original:
        raise EditError("no changes made: the replacement(s) produced identical content")
    return new_content, len(matched)
