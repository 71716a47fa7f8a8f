"""Replaced tenant segments that a client may still hold, counted until the kernel says nobody does.

A tenant segment handed to a tenant's clients and later given fresh memory (it passed to another
tenant: ``cpu.SegmentedArena.renew``) lives on for as long as any descriptor or mapping of it
does, in any process; the daemon cannot take it back. The daemon releases its pages when it
replaces it, but a client holding it can fault pages in again, up to the segment's size (its seals
forbid growing it). So each one counts, at its full size, against the tenant it was handed to,
until its last descriptor and mapping anywhere are gone: an inotify watch on the ``memfd``
reports that (``IN_IGNORED`` once the inode is freed; the watch does not keep it alive). A
segment that cannot be watched (the user's inotify instance or watch limit reached) counts until
the daemon exits.
"""

from __future__ import annotations

import ctypes
import logging
import os
import struct
import threading
from typing import NamedTuple

log = logging.getLogger("kvstore.tiers.replaced_segments")

_IN_DELETE_SELF = 0x400
_IN_IGNORED = 0x8000
_EVENT = struct.Struct("iIII")   # wd, mask, cookie, name length (then the name)


class Replaced(NamedTuple):
    tenant: str
    segment: int
    generation: int
    nbytes: int


class ReplacedSegments:
    def __init__(self) -> None:
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)   # -1: nothing is watched
        if self._fd < 0:
            log.warning("no inotify instance (errno %d): replaced tenant segments count against their tenant "
                        "until the daemon exits", ctypes.get_errno())
        self._held: dict[int, Replaced] = {}   # watch descriptor (negative: unwatched) -> segment
        self._unwatched = 0
        self._lock = threading.Lock()

    def add(self, fd: int, replaced: Replaced) -> None:
        """Count ``replaced`` (open as ``fd``, which the caller still holds and closes) until gone."""
        wd = self._libc.inotify_add_watch(self._fd, f"/proc/self/fd/{fd}".encode(), _IN_DELETE_SELF) \
            if self._fd >= 0 else -1
        with self._lock:
            if wd < 0:
                if self._fd >= 0:   # (without an instance, said once at start)
                    log.warning("cannot watch a replaced segment (errno %d): it counts against tenant %r until "
                                "the daemon exits", ctypes.get_errno(), replaced.tenant)
                self._unwatched -= 1
                wd = self._unwatched
            self._held[wd] = replaced

    def held_by(self, tenant: str) -> list[Replaced]:
        """``tenant``'s replaced segments that a descriptor or mapping somewhere still holds."""
        with self._lock:
            self._drain()
            return [r for r in self._held.values() if r.tenant == tenant]

    def stats(self) -> dict[str, int]:
        with self._lock:
            self._drain()
            return {"replaced_segments_held": len(self._held),
                    "replaced_segment_bytes_held": sum(r.nbytes for r in self._held.values())}

    def _drain(self) -> None:
        while self._fd >= 0:
            try:
                data = os.read(self._fd, 64 * 1024)
            except BlockingIOError:
                return
            at = 0
            while at + _EVENT.size <= len(data):
                wd, mask, _, name_len = _EVENT.unpack_from(data, at)
                at += _EVENT.size + name_len
                if mask & _IN_IGNORED:
                    self._held.pop(wd, None)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
