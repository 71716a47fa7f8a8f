"""Progress of work that takes seconds, on stderr: the operator commands (``bench``, ``plan``,
``prewarm``, ``pin``, ``evict``) and the daemon's start (filling the CPU arena, a warm restart's
recovery).

On a terminal: rich's progress bar (how far, the rate, the time elapsed, what is being done now),
gone when the work ends (lines printed to the same terminal meanwhile appear above it). Piped or redirected: plain lines, the first at once and then at most one
every ``KVSTORE_PROGRESS_EVERY_S`` seconds (2 by default), so a log shows where a slow run is
without a flood, and a script reading stdout gets only the result. ``quiet``: nothing.

Work moves in one of two ways:

    with Progress("kvstore bench", total=6) as p:
        p.advance("1MiB shm")             # a step begins: its label is shown until the next one

    with Progress("nvme tier: recovering", unit="blocks", say=log.info) as p:
        p.update(n)                       # n of the (possibly unknown) total done; a rate is shown

``say``: where plain lines go (the daemon passes its logger, so they carry its timestamps).
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

from kvstore.errors import InvalidArgument
from kvstore.units import format_size

#: the environment variable that sets how often plain lines come (seconds)
EVERY_S_VARIABLE = "KVSTORE_PROGRESS_EVERY_S"
EVERY_S_DEFAULT = 2.0


def every_s() -> float:
    """Seconds between plain progress lines: ``KVSTORE_PROGRESS_EVERY_S``, else 2."""
    text = os.environ.get(EVERY_S_VARIABLE)
    if text is None:
        return EVERY_S_DEFAULT
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise InvalidArgument(EVERY_S_VARIABLE, f"{text!r} is not a number of seconds >= 0")
    return value


def _amount(n: float, unit: str | None) -> str:
    if unit == "bytes":
        return format_size(n, "readable")
    return f"{n:,.0f} {unit}" if unit else f"{n:,.0f}"


def _rate(n: float, seconds: float, unit: str | None, short: bool = False) -> str:
    per_s = n / seconds if seconds > 0 else 0.0
    if unit == "bytes":
        return f"{per_s / 1e9:.2f} GB/s"
    return f"{per_s:,.0f}/s" if short else f"{per_s:,.0f} {unit or 'items'}/s"


class Progress:
    def __init__(self, command: str, total: int | None = None, *, unit: str | None = None, quiet: bool = False,
                 stream=None, say: Callable[[str], None] | None = None) -> None:
        """``command``: what is working (the start of every line); ``total``: steps or units in
        all (None: not known); ``unit``: counted work (``update``) in these (``"bytes"`` is shown
        as a size and a GB/s rate)."""
        self.command = command
        self.total = total
        self.unit = unit
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self._say = say
        self.done = 0
        self._bar = None
        self._task = None
        self._every_s = every_s()
        self._t0 = time.monotonic()
        # a step's first plain line comes at once; counted work's after one interval (a command
        # that starts counted work says so itself)
        self._next_line = self._t0 + (self._every_s if unit else 0.0)

    def __enter__(self) -> Progress:
        if not self.quiet and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn, TimeElapsedColumn

            counted = [TextColumn("{task.fields[amount]}")] if self.unit else [MofNCompleteColumn()]
            self._bar = Bar(TextColumn(f"{self.command}: [bold]{{task.description}}"), BarColumn(bar_width=20), *counted,
                            TimeElapsedColumn(), console=Console(file=self.stream), transient=True,
                            redirect_stdout=sys.stdout.isatty())   # stdout lines above the bar, not into it
            self._bar.start()
            self._next_line = self._t0
            self._task = self._bar.add_task("starting" if not self.unit else "", total=self.total, amount="")
        return self

    @property
    def elapsed_s(self) -> float:
        return time.monotonic() - self._t0

    def _due(self) -> bool:
        """A plain line may come now (then the next one ``every_s`` later)."""
        now = time.monotonic()
        if now < self._next_line:
            return False
        self._next_line = now + self._every_s
        return True

    def _line(self, text: str) -> None:
        if self._say is not None:
            self._say(text)
        else:
            print(text, file=self.stream, flush=True)

    def advance(self, label: str) -> None:
        """Step ``label`` begins (the one before it is done)."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=label)
        else:
            of = f"/{self.total}" if self.total else ""
            if self._due():
                self._line(f"{self.command}: [{self.done + 1}{of}] {label} ({self.elapsed_s:.0f}s)")
        self.done += 1

    def rate(self) -> str:
        """``600 blocks/s``: counted work's rate since the start."""
        return _rate(self.done, self.elapsed_s, self.unit)

    def counted(self) -> str:
        """``1,200 of 4,000 blocks (600 blocks/s)``: how far counted work is, and its rate."""
        if not self.total:
            return f"{_amount(self.done, self.unit)} ({self.rate()})"
        done = _amount(self.done, "bytes" if self.unit == "bytes" else None)
        return f"{done} of {_amount(self.total, self.unit)} ({self.rate()})"

    def _compact(self) -> str:
        """``1,200/4,000 blocks 600/s``: ``counted`` for the bar's column (80 columns hold it)."""
        done = _amount(self.done, "bytes" if self.unit == "bytes" else None)
        of = f"/{_amount(self.total, self.unit)}" if self.total else f" {self.unit}"
        return f"{done}{of} {_rate(self.done, self.elapsed_s, self.unit, short=True)}"

    def update(self, done: int, label: str | None = None, total: int | None = None) -> None:
        """``done`` units of counted work are done (``label``: what is being done now; ``total``:
        the work in all, when it is known only now)."""
        self.done = done
        if total is not None:
            self.total = total
        if self.quiet:
            return
        if self._bar is not None:
            now = time.monotonic()
            if now >= self._next_line or (self.total and done >= self.total):   # the bar redraws 10x a second
                self._next_line = now + 0.1
                fields = {"description": label} if label is not None else {}
                self._bar.update(self._task, completed=done, total=self.total, amount=self._compact(), **fields)
        elif self._due():
            self._line(f"{self.command}: {label + ', ' if label else ''}{self.counted()}, {self.elapsed_s:.1f}s")

    def note(self, text: str) -> None:
        """A line that stays (above the bar on a terminal; in plain mode, always printed)."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.console.print(f"{self.command}: {text}", highlight=False, markup=False)
        else:
            self._line(f"{self.command}: {text}")

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, **({"amount": self._compact()} if self.unit else {}))
            self._bar.stop()
            self._bar = None
