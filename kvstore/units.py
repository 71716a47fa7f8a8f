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


def format_size(n: int) -> str:
    """The shortest binary spelling: 4294967296 -> ``4GiB``, 1610612736 -> ``1.50GiB``, 100 -> ``100B``."""
    for unit, size in (("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size and n % (size // 1024 or 1) == 0:
            v = n / size
            return f"{v:g}{unit}" if v == int(v) else f"{v:.2f}{unit}"
    return f"{n}B"
