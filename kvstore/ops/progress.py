"""Progress of long operator commands (``bench``, ``plan``, ``prewarm``) on stderr.

On a terminal: rich's progress bar (a step count, elapsed time and what is being done now). Piped
or redirected: one plain line per step, so a log shows where a slow run is and a script reading
stdout gets only the result. ``quiet``: nothing.

    with Steps("bench", total=6) as steps:
        steps.advance("1MiB shm")      # a step begins: its label is shown until the next one
"""

from __future__ import annotations

import sys
import time


class Steps:
    def __init__(self, command: str, total: int | None, *, quiet: bool = False, stream=None) -> None:
        self.command = command
        self.total = total
        self.quiet = quiet
        self.stream = stream or sys.stderr
        self.done = 0
        self._bar = None
        self._task = None
        self._t0 = time.monotonic()

    def __enter__(self) -> Steps:
        if not self.quiet and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self._bar = Progress(TextColumn(f"{self.command}: [bold]{{task.description}}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(),
                                 console=Console(file=self.stream), transient=True)
            self._bar.start()
            self._task = self._bar.add_task("starting", total=self.total)
        return self

    def advance(self, label: str) -> None:
        """Step ``label`` begins (the one before it is done)."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, description=label)
        else:
            of = f"/{self.total}" if self.total else ""
            print(f"{self.command}: [{self.done + 1}{of}] {label} ({time.monotonic() - self._t0:.0f}s)",
                  file=self.stream, flush=True)
        self.done += 1

    def note(self, text: str) -> None:
        """A line that stays (above the bar on a terminal)."""
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.console.print(f"{self.command}: {text}", highlight=False, markup=False)
        else:
            print(f"{self.command}: {text}", file=self.stream, flush=True)

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done)
            self._bar.stop()
