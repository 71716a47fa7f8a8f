"""Slab files: one file of equal slots per block footprint, one block per slot (the NVMe tier's medium).

Why: a file per block costs a create, a rename and an unlink in the filesystem's journal per
block, which at 64 KiB blocks costs more than moving the bytes. A slab is created once; a block
is one positional write into a free slot, and dropping it punches the slot out again.

Why one footprint per file: every slot starts at a multiple of the footprint, so a block's
header sits only at a slot start, and no payload byte ever lands where a header is looked for.
A client that puts a payload shaped like a header cannot make recovery find it.

A ``Slab`` knows which slots are used and hands out the lowest free one (so a chain stored in
one go lies in adjacent slots), and each used slot's payload checksum (``checksum``: one column,
8 bytes a slot, where the block's record would hold a 36-byte int of its own). It moves no block bytes itself: the tier does, at
``offset(slot)``, reading through ``fd`` and writing through a ``writer()``. Its slot
bookkeeping is not thread-safe: the tier's lock guards it.

Each slab file has a record file beside it (``slab-<footprint>-<random>.kvi``): slot ``i``'s
block header again, in a ``RECORD_BYTES`` record at ``i * RECORD_BYTES``. It is written after the
slot and erased before the slot is punched, so it never names a block whose slot was given back.
Why: recovery reads one small file per slab instead of one header page per block at a slot
start, which costs a disk seek each (about 10 s per 100k blocks on a virtual disk).

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
from collections.abc import Sequence

import numpy as np

from kvstore.tiers.private_files import create_exclusive, unlink_quietly

_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_libc = None


def slab_name(slot_bytes: int) -> str:
    """A fresh name: random, so nothing planted in advance can hold the name a slab will take."""
    return f"slab-{slot_bytes}-{secrets.token_hex(4)}.kvs"


SLAB_NAME = re.compile(r"slab-([0-9]{1,15})-[0-9a-f]{8}\.kvs")
RECORDS_NAME = re.compile(r"slab-([0-9]{1,15})-[0-9a-f]{8}\.kvi")
#: one slot's record in a slab's record file (a block header is 188 bytes)
RECORD_BYTES = 256
#: attempts at a fresh random name when one of the pair is taken by something we may not remove
_NAME_ATTEMPTS = 8


def records_path(slab_path: str) -> str:
    """The record file beside slab file ``slab_path``."""
    return slab_path[:-len(".kvs")] + ".kvi"


class Slab:
    def __init__(self, directory: str, slot_bytes: int, direct: bool, path: str | None = None) -> None:
        self.directory = directory
        self.path = path        # named when the file is created, or the file recovery found
        self.slot_bytes = slot_bytes
        self._direct = direct
        self.fd = -1            # opened on the first write (allocation must not do I/O)
        self.records_fd = -1    # its record file, read-only like ``fd``
        self._free: list[int] = []   # a heap: the lowest free slot first
        self._end = 0                # slots at or past this were never handed out
        self.used = 0
        self._sums = np.zeros(0, np.uint64)   # by slot: the payload's xxh3_64 once written, else 0

    # -- slots (no I/O) --------------------------------------------------------------------------

    def take(self) -> int:
        """The lowest free slot, now used."""
        slot = heapq.heappop(self._free) if self._free else self._next_new()
        self.used += 1
        if slot < len(self._sums):
            self._sums[slot] = 0
        return slot

    def _next_new(self) -> int:
        self._end += 1
        return self._end - 1

    def checksum(self, slot: int) -> int:
        """The xxh3_64 of the payload written into ``slot`` (0: none written since it was taken)."""
        return int(self._sums[slot]) if slot < len(self._sums) else 0

    def set_checksums(self, slots, sums) -> None:
        """Note the checksums of the payloads just written into (or found in) ``slots``."""
        slots = np.asarray(slots, np.int64)
        if not len(slots):
            return
        need = int(slots.max()) + 1
        if need > len(self._sums):
            grown = np.zeros(max(need, 2 * len(self._sums)), np.uint64)
            grown[:len(self._sums)] = self._sums
            self._sums = grown
        self._sums[slots] = np.asarray(sums, np.uint64)

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

    def open(self, fd: int | None = None, records_fd: int | None = None) -> int:
        """The file's descriptor, creating the slab and its record file 0600 (``create_exclusive``)
        the first time; ``fd``/``records_fd``: the read-only descriptors recovery already opened."""
        if fd is not None:
            self.fd, self.records_fd = fd, records_fd if records_fd is not None else -1
        if self.fd < 0:
            for attempt in range(_NAME_ATTEMPTS):
                path = os.path.join(self.directory, slab_name(self.slot_bytes))
                wfd = create_exclusive(path)
                try:
                    rfd = create_exclusive(records_path(path))
                except OSError as e:
                    os.close(wfd)
                    unlink_quietly(path)
                    if e.errno != errno.EEXIST or attempt + 1 == _NAME_ATTEMPTS:
                        raise
                    continue
                try:
                    self.fd = _reopen(wfd, os.O_RDONLY | self._direct_flag)
                    self.records_fd = _reopen(rfd, os.O_RDONLY)
                finally:
                    os.close(wfd)
                    os.close(rfd)
                self.path = path
                break
        return self.fd

    def create_records(self) -> None:
        """Give a slab recovery found without a record file an empty one (``write_records`` fills it)."""
        wfd = create_exclusive(records_path(self.path))
        try:
            self.records_fd = _reopen(wfd, os.O_RDONLY)
        finally:
            os.close(wfd)

    @property
    def _direct_flag(self) -> int:
        return os.O_DIRECT if self._direct else 0

    def writer(self) -> int:
        """A descriptor to write this slab with, for one write: the caller closes it."""
        return _reopen(self.fd, os.O_WRONLY | self._direct_flag)

    def linked(self) -> bool:
        """Whether the file and its record file are still in the directory under their names:
        writes to a removed or replaced one would not survive a restart."""
        return _same_file(self.fd, self.path) and _same_file(self.records_fd, records_path(self.path))

    def write_records_at(self, first: int, records: list[bytes], durable: bool) -> None:
        """Name the blocks now in slots ``first``.. (their headers, at most ``RECORD_BYTES`` each;
        ``b""``: none) in the record file, with one write; ``durable``: flushed before returning.
        Called after the slots themselves are written."""
        data = b"".join(r.ljust(RECORD_BYTES, b"\0") for r in records)
        wfd = _reopen(self.records_fd, os.O_WRONLY)
        try:
            done = 0
            while done < len(data):
                n = os.pwrite(wfd, data[done:], first * RECORD_BYTES + done)
                if n <= 0:
                    raise OSError(errno.EIO, "short write")
                done += n
            if durable:
                os.fdatasync(wfd)
        finally:
            os.close(wfd)

    def write_records(self, records: np.ndarray) -> None:
        """Replace the record file's contents with ``records`` (one row per slot), flushed: how
        recovery gives a slab found without a record file its records again."""
        wfd = _reopen(self.records_fd, os.O_WRONLY)
        try:
            os.ftruncate(wfd, 0)
            data, done = memoryview(np.ascontiguousarray(records)).cast("B"), 0
            while done < len(data):
                done += os.pwrite(wfd, data[done:], done)
            os.fdatasync(wfd)
        finally:
            os.close(wfd)

    def read_records(self, count: int) -> np.ndarray:
        """The records of the first ``count`` slots, one row each; rows past the record file's end
        are zeros (no block)."""
        out = np.zeros((count, RECORD_BYTES), np.uint8)
        view = memoryview(out).cast("B")
        want = min(count * RECORD_BYTES, os.fstat(self.records_fd).st_size // RECORD_BYTES * RECORD_BYTES)
        done = 0
        while done < want:
            got = os.preadv(self.records_fd, [view[done:want]], done)
            if got <= 0:
                break
            done += got
        return out

    def flush(self) -> None:
        """Make every write to the slab and its record file so far durable."""
        os.fdatasync(self.fd)
        if self.records_fd >= 0:
            os.fdatasync(self.records_fd)

    def punch(self, slots: Sequence[int]) -> None:
        """Release dropped blocks' disk space and erase them, so no restart finds them: their
        records are zeroed first, then their slots punched (a punched range reads back as zeros),
        each run of neighbouring slots with one write and one punch (evictions free their slots
        in runs: a put's victims were written together). Where the filesystem cannot punch, each
        slot's header page is overwritten with zeros instead (the space is reused by the slot's
        next block)."""
        if self.fd < 0 or not slots:
            return
        runs = _neighbour_runs(sorted(set(slots)))
        if self.records_fd >= 0:
            for first, count in runs:
                try:
                    self.write_records_at(first, [b""] * count, durable=False)
                except OSError:
                    pass   # best effort, as below: the slot's own header is erased next
        try:
            wfd = self.writer()
        except OSError:
            return   # best effort (a read-only filesystem): a header left behind is a block the index no longer names
        try:
            for first, count in runs:
                try:
                    _fallocate(wfd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, self.offset(first),
                               count * self.slot_bytes)
                except OSError:
                    for slot in range(first, first + count):
                        try:
                            os.pwrite(wfd, _zero_page(), self.offset(slot))
                        except OSError:
                            pass
        finally:
            os.close(wfd)

    def remove_files(self) -> None:
        """Unlink the slab and its record file, if they are still the ones held open."""
        if self.fd >= 0 and self.linked():
            unlink_quietly(self.path)
            unlink_quietly(records_path(self.path))

    def close(self) -> None:
        for fd in (self.fd, self.records_fd):
            if fd >= 0:
                os.close(fd)
        self.fd = self.records_fd = -1


def _neighbour_runs(slots: list[int]) -> list[tuple[int, int]]:
    """Sorted, distinct ``slots`` as (first, count) runs of neighbours."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and runs[-1][0] + runs[-1][1] == slot:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((slot, 1))
    return runs


def _same_file(fd: int, path: str) -> bool:
    try:
        held, named = os.fstat(fd), os.lstat(path)
    except OSError:
        return False
    return held.st_nlink > 0 and (held.st_dev, held.st_ino) == (named.st_dev, named.st_ino)


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
