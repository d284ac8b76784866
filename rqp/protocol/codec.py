"""``construct`` declares, :mod:`struct` executes: fixed-size codecs derived from declarations.

Every format of the project is declared once with ``construct`` (the spec's layout, the docs,
the validation). On the hot paths the same bytes are read and written with a precompiled
:class:`struct.Struct` made here from the declaration, field by field in order, so nothing is
written twice by hand: a changed declaration changes its codec. The tests check that both
read and write the same bytes for generated values.
"""

from __future__ import annotations

import struct

from construct import Bytes, Const, FormatField, Struct

__all__ = ["struct_of", "constants_of"]


def _leaf(field):
    while not isinstance(field, (FormatField, Bytes)):
        field = field.subcon
    return field


def struct_of(declaration: Struct) -> struct.Struct:
    """The :class:`struct.Struct` of a fixed-size, big-endian ``construct`` Struct: integers as
    their format, fixed byte strings (``Bytes(n)``, ``Const(b"...")``) as ``ns``."""
    formats = []
    for sub in declaration.subcons:
        leaf = _leaf(sub)
        if isinstance(leaf, FormatField):
            if leaf.fmtstr[0] != ">":
                raise ValueError(f"field {sub.name!r} is not big-endian ({leaf.fmtstr!r})")
            formats.append(leaf.fmtstr[1:])
        elif isinstance(leaf.length, int):
            formats.append(f"{leaf.length}s")
        else:
            raise ValueError(f"field {sub.name!r} has no fixed size")
    return struct.Struct(">" + "".join(formats))


def constants_of(declaration: Struct) -> dict[int, object]:
    """The values of its ``Const`` fields, by position (what a struct-read header must hold)."""
    out = {}
    for i, sub in enumerate(declaration.subcons):
        field = sub
        while not isinstance(field, (FormatField, Bytes)):
            if isinstance(field, Const):
                out[i] = field.value
                break
            field = field.subcon
    return out
