"""The daemon's C heap after a burst: capping glibc's malloc arenas and handing freed heap back.

Why: glibc keeps freed chunks in per-thread arenas. One burst of large requests parsed on worker
threads (a maximal LookupBatch is ~160 MB of protobuf) is freed when the requests end, yet stays in
the daemon's RSS for good unless the heap is trimmed. ``kvstore.ops.cli`` sets the related MALLOC_*
environment (read only when a process starts); this works on the running process.
"""

from __future__ import annotations

import mmap
import time


class HeapTrimmer:
    """Hands memory the C heap has freed back to the OS (glibc's ``malloc_trim``; a no-op
    elsewhere) whenever the process is more than ``slack`` bytes above the smallest size it has
    had, at most once per ``min_interval_s``. Meant for a housekeeping thread: checking costs one
    small /proc read; a trim that finds memory still in use is repeated on a later tick."""

    def __init__(self, slack: int = 32 << 20, min_interval_s: float = 2.0) -> None:
        self.slack = slack
        self.min_interval_s = min_interval_s
        libc = _find_libc()
        self._malloc_trim = None if libc is None else libc.malloc_trim
        self._low = resident_bytes()
        self._last = float("-inf")

    def maybe_trim(self) -> bool:
        now = time.monotonic()
        if self._malloc_trim is None or now - self._last < self.min_interval_s:
            return False
        if resident_bytes() < self._low + self.slack:
            return False
        self._malloc_trim(0)
        self._last = now
        self._low = min(self._low, resident_bytes())
        return True


def limit_heap_arenas(arenas: int = 2) -> bool:
    """Cap glibc's malloc arenas (``M_ARENA_MAX``) for threads created from now on: memory freed
    in one of many per-thread arenas is hard to hand back (freed chunks interleave with live
    ones); with two, ``HeapTrimmer`` brings a daemon back near its baseline after a burst (Python's
    small objects use their own allocator). False where glibc is not in use."""
    malloc = _find_libc()
    if malloc is None or not hasattr(malloc, "mallopt"):
        return False
    return bool(malloc.mallopt(_M_ARENA_MAX, arenas))


def resident_bytes() -> int:
    """This process's resident set size (0 where /proc is not available)."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return 0


_M_ARENA_MAX = -8   # glibc's malloc.h


def _find_libc():
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None
    return libc if hasattr(libc, "malloc_trim") else None
