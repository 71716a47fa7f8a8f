"""Byte sizes as people write them: one parser and one formatter, so "16GB" means the same everywhere.

A leaf (the daemon's settings, ``kvstore plan`` and ``kvstore bench`` all read sizes). Units follow
IEC 80000-13 through pydantic's ``ByteSize``: ``16GB`` is 16 x 10^9 bytes, ``16GiB`` is
16 x 2^30, a bare ``k``/``m``/``g``/``t`` is decimal like ``KB``/``MB``/``GB``/``TB``, and a plain
number is bytes. Imports nothing from kvstore but the errors module.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

from kvstore.errors import InvalidArgument

KiB, MiB, GiB, TiB = 1 << 10, 1 << 20, 1 << 30, 1 << 40

# ByteSize matches a prefix ("16GiB junk" would pass) and knows bit units; a size here is the
# whole string and counts bytes
_WHOLE_SIZE = re.compile(r"^\s*[0-9]*\.?[0-9]+\s*(?:[a-z]*b|[kmgtpe])?\s*$", re.IGNORECASE)
_BYTE_SIZE = TypeAdapter(ByteSize)


def parse_size(value: Any, field: str = "size") -> int:
    """``"4GiB"`` -> 4294967296, ``"1.5GB"`` -> 1500000000, ``4096`` -> 4096.

    Raises ``InvalidArgument`` (a ``ValueError``) naming ``field`` for anything else: negative
    numbers, booleans, unknown or bit units."""
    if isinstance(value, bool):
        raise InvalidArgument(field, "a size must be a number of bytes or a string like '4GiB'")
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, int):
        if value < 0:
            raise InvalidArgument(field, f"{value} is negative; a size is a number of bytes >= 0")
        return value
    if isinstance(value, str) and _WHOLE_SIZE.match(value):
        try:
            return int(_BYTE_SIZE.validate_python(value.strip()))
        except ValidationError:
            pass
    raise InvalidArgument(field, f"{value!r} is not a size; write bytes or a number with a unit "
                                 "(KiB, MiB, GiB, TiB = powers of 2; KB, MB, GB, TB = powers of 10)")


def parse_sizes(text: str, field: str) -> list[int]:
    """``"8GiB,16GiB,0"`` -> the distinct sizes, ascending."""
    return sorted({parse_size(s, field) for s in text.split(",") if s.strip()})


_BINARY_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")


def format_size(n: float, style: str = "exact") -> str:
    """Bytes in binary units, spelled for where they are shown:

    * ``"exact"`` (settings, the planner; reads back through ``parse_size``): the shortest binary
      spelling, 4294967296 -> ``4GiB``, 1610612736 -> ``1.50GiB``, 100 -> ``100B``.
    * ``"readable"`` (operator output, rates): one decimal, 786432 -> ``768.0 KiB``, 100 -> ``100 B``.
    * ``"cell"`` (narrow table cells): about three significant digits and one-letter units,
      8388608 -> ``8.0M``, 106954752 -> ``102M``, 39117 -> ``38.2K``, 512 -> ``512B``.
    """
    if style == "exact":
        for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
            if n >= size and n % (size // 1024 or 1) == 0:
                v = n / size
                return f"{v:g}{unit}" if v == int(v) else f"{v:.2f}{unit}"
        return f"{n}B"
    if style not in ("readable", "cell"):
        raise ValueError(f"format_size: unknown style {style!r}")
    below = 1024 if style == "readable" else 1000   # a cell stays within three digits
    for unit in _BINARY_UNITS:
        if abs(n) < below or unit == _BINARY_UNITS[-1]:
            break
        n /= 1024
    if style == "readable":
        return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    return f"{n:.0f}{unit[0]}" if unit == "B" or n >= 100 else f"{n:.1f}{unit[0]}"
