"""A benchmark's result: ``PREFIX.json`` (everything measured, for tools) and ``PREFIX.md`` (the
table a reader sees), written together so the two never disagree; the machine line every table
states; and the entry point that renders a written result again."""

from __future__ import annotations

import json
import os
import sys
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


def run_or_render(main: Callable[[], None], markdown: Callable[[dict], str], argv: list[str] | None = None) -> None:
    """A benchmark's entry point: ``--render RESULT.json`` prints ``markdown`` of a result already
    written (nothing runs, so a table's wording can change without a new measurement); anything
    else runs ``main``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--render"]:
        with open(argv[1]) as f:
            print(markdown(json.load(f)), end="")
    else:
        main()


def machine_line(m: dict, *versions: str, load: tuple = (), directory: bool = False) -> str:
    """``Machine: …``, the facts of ``machine_facts`` a reader weighs a figure by: CPU, usable
    cores, RAM, kernel, Python, the library ``versions`` named; with ``directory``, the filesystem
    and O_DIRECT of the directory measured; the kvstore commit measured (``+``: with uncommitted
    changes); then the load average at start (``load[0]``, else the 1-minute load
    ``machine_facts`` saw; left out when neither is known) and at end (``load[1]``, when given).
    No closing full stop: the report goes on."""
    cores = m.get("cores_usable", m.get("cores"))
    ram_gib = m.get("ram_gib", round(m.get("ram_bytes", 0) / 2**30, 1))
    facts = [str(m.get("cpu_model", "?")), f"{cores} usable cores", f"{ram_gib} GiB RAM",
             f"kernel {m.get('kernel', '?')}", f"Python {m.get('python', '?')}"]
    facts += [f"{name} {m.get(name, '-')}" for name in versions]
    text = "Machine: " + ", ".join(facts)
    if directory:
        text += (f"; directory {m.get('dir', '?')} on {m.get('dir_fs_type', '?')} "
                 f"(O_DIRECT {'yes' if m.get('dir_o_direct') else 'no'})")
    if m.get("kvstore_commit"):
        text += f"; kvstore at {m['kvstore_commit']}"
    start = load[0] if load else m.get("load_avg_1m")
    if start is not None:
        text += f"; load average {_load(start)} at start"
        if len(load) > 1:
            text += f", {_load(load[1])} at end"
    return text


def _load(value) -> str:
    if isinstance(value, (list, tuple)):   # os.getloadavg(): the 1-minute figure first
        value = value[0] if value else None
    if value is None or isinstance(value, str):   # str: a result that wrote its figures as text
        return value or "?"
    return f"{value:.1f}"
