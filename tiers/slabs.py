"""Slab files: one file of equal slots per block footprint, one block per slot (the NVMe tier's medium).

Why: a file per block costs a create, a rename and an unlink in the filesystem's journal per
block, which at 64 KiB blocks costs more than moving the bytes. A slab is created once; a block
is one positional write into a free slot, and dropping it punches the slot out again.

Why one footprint per file: every slot starts at a multiple of the footprint, so a block's
header sits only at a slot start, and no payload byte ever lands where a header is looked for.
A client that puts a payload shaped like a header cannot make recovery find it.

A ``Slab`` knows which slots are used and hands out the lowest free one (so a chain stored in
one go lies in adjacent slots). It moves no block bytes itself: the tier does, at
``offset(slot)``, reading through ``fd`` and writing through a ``writer()``. Its slot
bookkeeping is not thread-safe: the tier's lock guards it.

Why ``fd`` is read-only: a file held open for writing keeps its filesystem from being remounted
read-only. A write reopens the same file (``/proc/self/fd``: the inode held, never the name
again, so a file swapped in under the name is never written) for the length of one write.
"""

from __future__ import annotations

import ctypes
import errno
import heapq
import os
import re
import secrets

from kvstore.tiers.private_files import create_exclusive

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = None


def slab_name(slot_bytes: int) -> str:
    """A fresh name: random, so nothing planted in advance can hold the name a slab will take."""
    return f"slab-{slot_bytes}-{secrets.token_hex(4)}.kvs"


SLAB_NAME = re.compile(r"slab-([0-9]{1,15})-[0-9a-f]{8}\.kvs")


class Slab:
    def __init__(self, directory: str, slot_bytes: int, direct: bool, path: str | None = None) -> None:
        self.directory = directory
        self.path = path        # named when the file is created, or the file recovery found
        self.slot_bytes = slot_bytes
        self._direct = direct
        self.fd = -1            # opened on the first write (allocation must not do I/O)
        self._free: list[int] = []   # a heap: the lowest free slot first
        self._end = 0                # slots at or past this were never handed out
        self.used = 0

    # -- slots (no I/O) --------------------------------------------------------------------------

    def take(self) -> int:
        """The lowest free slot, now used."""
        slot = heapq.heappop(self._free) if self._free else self._next_new()
        self.used += 1
        return slot

    def _next_new(self) -> int:
        self._end += 1
        return self._end - 1

    def give_back(self, slot: int) -> None:
        heapq.heappush(self._free, slot)
        self.used -= 1

    def adopt(self, used_slots: list[int], slot_count: int) -> None:
        """After recovery: ``used_slots`` hold blocks, the rest of the file's ``slot_count`` are free."""
        taken = set(used_slots)
        self._end = slot_count
        self._free = [s for s in range(slot_count) if s not in taken]
        heapq.heapify(self._free)
        self.used = len(taken)

    def offset(self, slot: int) -> int:
        return slot * self.slot_bytes

    # -- the file --------------------------------------------------------------------------------

    def open(self, fd: int | None = None) -> int:
        """The file's descriptor, creating the file 0600 (``create_exclusive``) the first time;
        ``fd``: the read-only descriptor recovery already opened."""
        if fd is not None:
            self.fd = fd
        if self.fd < 0:
            self.path = os.path.join(self.directory, slab_name(self.slot_bytes))
            wfd = create_exclusive(self.path)
            try:
                self.fd = _reopen(wfd, os.O_RDONLY | self._direct_flag)
            finally:
                os.close(wfd)
        return self.fd

    @property
    def _direct_flag(self) -> int:
        return os.O_DIRECT if self._direct else 0

    def writer(self) -> int:
        """A descriptor to write this slab with, for one write: the caller closes it."""
        return _reopen(self.fd, os.O_WRONLY | self._direct_flag)

    def linked(self) -> bool:
        """Whether the file is still in the directory under its name: writes to a removed or
        replaced one would not survive a restart."""
        try:
            held, named = os.fstat(self.fd), os.lstat(self.path)
        except OSError:
            return False
        return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)

    def punch(self, slot: int) -> None:
        """Release a dropped block's disk space and erase its header, so no restart finds it: a
        punched range reads back as zeros. Where the filesystem cannot punch, the header page is
        overwritten with zeros instead (the space is reused by the slot's next block)."""
        if self.fd < 0:
            return
        off, n = self.offset(slot), self.slot_bytes
        try:
            wfd = self.writer()
        except OSError:
            return   # best effort (a read-only filesystem): a header left behind is a block the index no longer names
        try:
            _fallocate(wfd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, off, n)
        except OSError:
            try:
                os.pwrite(wfd, _zero_page(), off)
            except OSError:
                pass
        finally:
            os.close(wfd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _reopen(fd: int, flags: int) -> int:
    """The file behind ``fd`` opened again with ``flags``: the same inode, whatever its name is now."""
    return os.open(f"/proc/self/fd/{fd}", flags)


_ZERO_PAGE = None


def _zero_page():
    global _ZERO_PAGE
    if _ZERO_PAGE is None:
        import mmap
        _ZERO_PAGE = mmap.mmap(-1, 4096)   # page-aligned, as O_DIRECT needs
    return _ZERO_PAGE


def _fallocate(fd: int, mode: int, offset: int, length: int) -> None:
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
        if hasattr(_libc, "fallocate"):
            _libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
    if not hasattr(_libc, "fallocate"):
        raise OSError(errno.EOPNOTSUPP, "no fallocate")
    if _libc.fallocate(fd, mode, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
