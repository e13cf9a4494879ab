"""Compare ctypes struct mirrors with the layouts the native adapter reports.

A mirror that disagrees with the compiled library would make every call that
passes the struct read or write the wrong bytes; we refuse to run instead.
"""

from __future__ import annotations

from ctypes import Structure, Union, c_char_p, c_size_t, sizeof
from typing import Mapping

from ..errors import LayoutMismatchError

Layout = dict[str, dict[str, tuple[int, int]]]


def native_layouts(lib) -> Layout:
    """Read the adapter's table: {struct: {field ("" = whole struct): (offset, size)}}."""
    out: Layout = {}
    type_, field = c_char_p(), c_char_p()
    offset, size = c_size_t(), c_size_t()
    for i in range(lib.lcx_layout_count()):
        if not lib.lcx_layout_get(i, type_, field, offset, size):
            break
        out.setdefault(type_.value.decode(), {})[field.value.decode()] = (offset.value, size.value)
    return out


def python_layout(struct: type[Structure]) -> dict[str, tuple[int, int]]:
    """{field: (offset, size)} of a ctypes struct, anonymous members flattened."""
    fields: dict[str, tuple[int, int]] = {"": (0, sizeof(struct))}
    anonymous = set(getattr(struct, "_anonymous_", ()))
    for name, ctype, *_ in struct._fields_:
        base = getattr(struct, name).offset
        if name in anonymous and issubclass(ctype, (Structure, Union)):
            for sub, sub_type, *_ in ctype._fields_:
                fields[sub] = (base + getattr(ctype, sub).offset, sizeof(sub_type))
        else:
            fields[name] = (base, sizeof(ctype))
    return fields


def check_layouts(native: Layout, structs: Mapping[str, type[Structure]]) -> None:
    """Raise LayoutMismatchError naming every difference between mirrors and native layouts."""
    problems = []
    for cname, struct in structs.items():
        theirs = native.get(cname)
        if theirs is None:
            problems.append(f"{cname}: not reported by the native library")
            continue
        ours = python_layout(struct)
        for field in sorted(set(ours) | set(theirs)):
            label = f"{cname}.{field}" if field else f"sizeof({cname})"
            if field not in theirs:
                problems.append(f"{label}: mirrored in Python but absent from the native struct")
            elif field not in ours:
                problems.append(f"{label}: present in the native struct but not mirrored")
            elif ours[field] != theirs[field]:
                (po, ps), (no, ns) = ours[field], theirs[field]
                problems.append(f"{label}: Python offset {po} size {ps}, native offset {no} size {ns}")
    if problems:
        raise LayoutMismatchError(
            "ctypes struct layouts do not match the native llama.cpp library (was it built from a "
            "different llama.cpp version?):\n  " + "\n  ".join(problems)
        )
