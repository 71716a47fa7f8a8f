"""Where a benchmark's result goes: ``PREFIX.json`` (everything measured, for tools) and
``PREFIX.md`` (the table a reader sees), written together so the two never disagree."""

from __future__ import annotations

import json
import os
from collections.abc import Callable


def write_report(prefix: str, report: dict, markdown: Callable[[dict], str], echo: bool = True) -> str:
    """Write ``report`` as ``prefix.json`` and ``markdown(report)`` as ``prefix.md``; returns the
    markdown (printed too unless ``echo`` is False)."""
    directory = os.path.dirname(prefix)
    if directory:
        os.makedirs(directory, exist_ok=True)
    text = markdown(report)
    with open(prefix + ".json", "w") as f:
        json.dump(report, f, indent=1, default=str)
    with open(prefix + ".md", "w") as f:
        f.write(text)
    if echo:
        print(text)
    return text
