"""The code blocks of README.md and docs/*.md, and how each one runs as a user would run it.

A block is fenced (```lang) or indented by four spaces after a blank line. What a block is, is
read from it, or from a marker comment on the line before it:

* ``<!-- docs-test: skip REASON -->``: not run here (docker, kubectl, a GPU, an engine, a command
  shown with placeholders); REASON is required.
* ``<!-- docs-test: output -->``: output or a log excerpt, nothing to run.
* ``<!-- docs-test: file NAME -->``: the block is a file the commands after it use (written into
  the session directory as NAME).
* ``<!-- docs-test: config -->``: a daemon configuration: parsed and validated as ``kvstore serve``
  would (``kvstore.service.config``), nothing started.
* ``<!-- docs-test: daemon -->``: the block talks to a daemon the text asks the reader to start
  (``make serve``): a small one is started first (``kvstore serve`` on the session's port), then
  the block runs as if unmarked.
* no marker: a ``python`` block whose first line is ``# NAME.py`` is a file (as above); any other
  ``python`` block is run; a block of ``$ command`` lines (output lines between them) is run
  command by command; a ``yaml`` block is parsed. Anything else must be marked.

Commands run with bash in one directory per document, in order, with the venv's ``kvstore`` and
``python`` first on PATH. A ``kvstore serve`` command runs in the background (its output in
``serve.log``, its pid in ``serve.pid``) until the next one or the end of the document. An
``exit N`` line in the block's output is the exit status the command before it must print (the
docs show ``; echo "exit $?"``); otherwise a command must exit 0. No command may print a Python
traceback.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!--\s*docs-test:\s*(skip|output|file|config|daemon)\b\s*(.*?)\s*-->\s*$")


@dataclasses.dataclass
class Block:
    path: str        # relative to the repository
    line: int        # first line of the block's content
    lang: str
    text: str
    marker: str = ""   # skip / output / file / config, or "" (decided from the block)
    arg: str = ""      # the skip reason, or the file name

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"

    def kind(self) -> tuple[str, str]:
        """(kind, argument): skip / output / file / config / python / commands / yaml / unmarked."""
        if self.marker and self.marker != "daemon":
            return self.marker, self.arg
        first = self.text.lstrip("\n").split("\n", 1)[0]
        if self.lang == "python":
            named = re.match(r"#\s*([\w.-]+\.py)\b", first)
            return ("file", named.group(1)) if named else ("python", "")
        if any(line.startswith("$ ") for line in self.text.splitlines()):
            return "commands", ""
        if self.lang in ("yaml", "yml"):
            return "yaml", ""
        return "unmarked", ""


def blocks_of(path: str) -> list[Block]:
    rel = os.path.relpath(path, REPO)
    lines = open(path, encoding="utf-8").read().split("\n")
    out: list[Block] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(lines[i - 1].strip()) if i else None
        if line.startswith("```"):
            lang = line[3:].strip()
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            out.append(Block(rel, i + 2, lang, "\n".join(lines[i + 1:j]),
                             *(marker.groups() if marker else ("", ""))))
            i = j + 1
            continue
        if line.startswith("    ") and line.strip() and (i == 0 or not lines[i - 1].strip() or marker):
            previous = next((lines[k] for k in range(i - 1, -1, -1) if lines[k].strip()), "")
            if not re.match(r"^\s*([-*]|\d+\.)\s", previous) and not previous.startswith("    "):
                j = i
                while j < len(lines) and (lines[j].startswith("    ") or not lines[j].strip()):
                    j += 1
                body = "\n".join(ln[4:] for ln in lines[i:j]).rstrip("\n")
                marker = MARKER.match(lines[i - 1].strip()) if i else None
                if marker is None and i >= 2 and not lines[i - 1].strip():
                    marker = MARKER.match(lines[i - 2].strip())
                out.append(Block(rel, i + 1, "", body, *(marker.groups() if marker else ("", ""))))
                i = j
                continue
        i += 1
    return out


def documents() -> list[str]:
    return [os.path.join(REPO, "README.md")] + sorted(glob.glob(os.path.join(REPO, "docs", "*.md")))


@dataclasses.dataclass
class Command:
    text: str                  # what follows "$ " (continuation lines joined)
    expected_exit: int | None  # from an "exit N" output line, when the docs show one


def commands_of(block: Block) -> list[Command]:
    out: list[Command] = []
    lines = block.text.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("$ "):
            text = line[2:]
            while text.rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text = text.rstrip()[:-1] + " " + lines[i].strip()
            out.append(Command(text.split("  #", 1)[0].strip(), None))
        elif out and re.fullmatch(r"exit \d+", line.strip()):
            out[-1].expected_exit = int(line.split()[1])
        i += 1
    return out
