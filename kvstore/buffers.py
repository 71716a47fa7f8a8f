"""Byte views, gather/scatter over a block's extents, and scratch buffers that are trimmed after an
oversized request.

A leaf: every layer that moves payload bytes (tiers, the store, the client's shared-memory
transport, the server, the codecs) needs the same small things, and none of them should import
another layer to get them. Imports nothing from kvstore but the errors module; torch only inside
``as_byte_tensor`` (and for a tensor given to ``as_bytes``).
"""

from __future__ import annotations

import mmap
import os
import threading
import warnings
from bisect import bisect_left
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate, count

import numpy as np

from kvstore.errors import CodecError, InvalidArgument
from kvstore.threads import BUDGET

Extent = tuple[int, int]  # (byte offset in an arena, length)

#: the largest scratch buffer a thread keeps between requests (``Scratch.trim_above``): typical
#: blocks reuse one buffer, a larger one is freed after its request
SCRATCH_KEEP_BYTES = 8 << 20


#: the dtype of a plain byte array (numpy's own object: compared by identity, much cheaper than ``==``)
BYTE_DTYPE = np.dtype(np.uint8)


def as_bytes(buf, field: str = "blocks") -> np.ndarray:
    """A flat uint8 numpy view (no copy) of bytes, bytearray, memoryview, mmap, a numpy array or
    a CPU torch tensor. A device tensor is refused (naming ``field``): it must be staged by a
    connector, never silently copied here."""
    if type(buf) is np.ndarray and buf.dtype is BYTE_DTYPE and buf.ndim == 1 and buf.flags.c_contiguous:
        return buf   # already one (what the store hands itself per block): returned as it is
    if isinstance(buf, np.ndarray):
        return np.ascontiguousarray(buf).reshape(-1).view(np.uint8)
    if type(buf).__module__.startswith("torch"):
        t = buf.detach()
        if t.device.type != "cpu":
            raise InvalidArgument(field, "tensors must be on the CPU (GPU tensors go through a connector)")
        import torch

        return t.contiguous().reshape(-1).view(torch.uint8).numpy()
    return np.frombuffer(buf, dtype=np.uint8)


def writable_bytes(buf, field: str) -> np.ndarray:
    """``as_bytes`` for a destination: a flat uint8 view of the caller's own memory, never a copy.
    ``as_bytes`` makes a contiguous copy of a strided array or tensor, and bytes written there
    would never reach the caller, who would read what the buffer held before as if it were the
    block; so a strided or read-only destination is refused instead, naming ``field``."""
    if (type(buf) is np.ndarray and buf.dtype is BYTE_DTYPE and buf.ndim == 1
            and (flags := buf.flags).c_contiguous and flags.writeable):
        return buf   # the usual destination, taken as it is (a get checks one per block)
    if isinstance(buf, np.ndarray) and not buf.flags.c_contiguous:
        raise InvalidArgument(field, "buffer is not contiguous (a copy would not reach it)")
    if type(buf).__module__.startswith("torch") and not buf.is_contiguous():
        raise InvalidArgument(field, "tensor is not contiguous (a copy would not reach it)")
    try:
        arr = as_bytes(buf, field)
    except (TypeError, ValueError, BufferError) as e:   # e.g. a strided memoryview
        raise InvalidArgument(field, f"not a contiguous writable buffer: {e}") from None
    if not arr.flags.writeable:
        raise InvalidArgument(field, "buffer is read-only")
    return arr


def as_byte_array(buf, field: str) -> np.ndarray:
    """``as_byte_tensor`` without torch (the core install's codecs, raw and zstd): a flat uint8
    numpy view of bytes, bytearray, memoryview or a C-contiguous numpy array, copying nothing;
    anything else is refused with ``CodecError`` naming ``field``."""
    if isinstance(buf, np.ndarray) and not buf.flags.c_contiguous:
        raise CodecError(f"{field}: array must be C-contiguous")
    if not isinstance(buf, (np.ndarray, bytes, bytearray, memoryview)):
        raise CodecError(f"{field}: expected bytes, a numpy array or a torch tensor, got {type(buf).__name__}")
    return as_bytes(buf, field)


def as_byte_tensor(buf, field: str):
    """``as_bytes`` as a flat uint8 torch tensor, for code that computes in torch (the codecs):
    bytes, bytearray, memoryview, a numpy array or a tensor on any device (kept there), copying
    nothing. What would need a copy is refused instead, with ``CodecError`` naming ``field``: a
    non-contiguous array or tensor, or any other type."""
    import torch

    if isinstance(buf, torch.Tensor):
        if not buf.is_contiguous():
            raise CodecError(f"{field}: tensor must be contiguous")
        return buf.reshape(-1).view(torch.uint8)
    arr = as_byte_array(buf, field)
    if arr.flags.writeable:
        return torch.from_numpy(arr)
    with warnings.catch_warnings():  # read-only buffers are only ever read from
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def scatter(arena: np.ndarray, extents: Sequence[Extent], src: np.ndarray) -> int:
    """Copy flat ``src`` into a block's pieces of ``arena``; returns the bytes copied."""
    pos = 0
    for off, length in extents:
        np.copyto(arena[off:off + length], src[pos:pos + length])
        pos += length
    return pos


def window(extents: Sequence[Extent], offset: int, nbytes: int) -> list[Extent]:
    """The pieces of a block's ``extents`` that hold its bytes [offset, offset + nbytes): a
    payload shorter than its slots (written at their start), or one layer's range of it."""
    out, at = [], 0
    for off, length in extents:
        lo, hi = max(offset, at), min(offset + nbytes, at + length)
        if lo < hi:
            out.append((off + lo - at, hi - lo))
        at += length
    return out


def gather(arena: np.ndarray, extents: Sequence[Extent], dst: np.ndarray) -> int:
    """Copy a block's pieces of ``arena`` into flat ``dst``; returns the bytes copied."""
    pos = 0
    for off, length in extents:
        np.copyto(dst[pos:pos + length], arena[off:off + length])
        pos += length
    return pos


def copy_each(arena, offsets: Sequence[int], lengths: Sequence[int], dsts: Sequence[np.ndarray]) -> None:
    """``dsts[i][:] = arena[offsets[i]:offsets[i] + lengths[i]]`` for every i: many one-extent
    blocks with a single call's worth of Python per block (small blocks are bound by it). A run
    of at least ``2 * COPY_PART_BYTES`` is copied by up to ``COPY_THREADS`` threads (numpy copies
    without the GIL; one core's copy loop leaves memory bandwidth unused), each taking the next
    part of about ``COPY_PART_BYTES`` until none is left, so a thread the scheduler holds back
    (the daemon shares the cores) does not hold the others up."""
    _copy_parts(arena, offsets, lengths, dsts, False, None)


def copy_each_in(arena, offsets: Sequence[int], srcs: Sequence[np.ndarray], before_part=None,
                 threads: int | None = None) -> None:
    """``arena[offsets[i]:offsets[i] + len(srcs[i])] = srcs[i]`` for every i, as ``copy_each``
    copies out, on at most ``threads`` threads (default ``COPY_THREADS``); ``before_part()`` runs
    before each part is copied (it may raise to stop: a store lease about to run out)."""
    _copy_parts(arena, offsets, [s.nbytes for s in srcs], srcs, True, before_part, threads)


def _copy_parts(arena, offsets, lengths, bufs, into_arena: bool, before_part, threads: int | None = None) -> None:
    total = sum(lengths)
    threads = min(COPY_THREADS if threads is None else threads, total // COPY_PART_BYTES)
    if threads < 2 and before_part is None:   # a small get: one loop, no parts to cut
        _copy_run(arena, offsets, lengths, bufs, 0, len(bufs), into_arena)
        return
    parts = max(1, -(-total // COPY_PART_BYTES))
    ends = list(accumulate(lengths))
    cuts = [0] + [bisect_left(ends, total * k // parts) + 1 for k in range(1, parts)] + [len(bufs)]
    spans = [(a, b) for a, b in zip(cuts, cuts[1:]) if a < b]
    taken = count()   # next() on it is atomic: each span is copied once
    failed: list[BaseException] = []

    def worker() -> None:
        try:
            for k in taken:
                if k >= len(spans) or failed:
                    return
                if before_part is not None:
                    before_part()
                _copy_run(arena, offsets, lengths, bufs, *spans[k], into_arena)
        except BaseException as e:   # the others stop at their next part
            failed.append(e)

    if threads < 2:
        worker()
    else:
        others = [_copy_pool().submit(worker) for _ in range(threads - 1)]
        worker()
        for f in others:   # every copy has ended before the caller hears of a failure (and
            f.result()     # releases the lease, or hands the buffers back)
    if failed:
        raise failed[0]


#: ``copy_each`` splits a run into parts of about this many bytes, copied by at most this many threads
COPY_PART_BYTES = 2 << 20
COPY_THREADS = BUDGET.copy
_pool: tuple[int, ThreadPoolExecutor] | None = None
_pool_lock = threading.Lock()


def _copy_run(arena, offsets, lengths, bufs, start: int, stop: int, into_arena: bool = False) -> None:
    copyto = np.copyto
    if into_arena:
        for k in range(start, stop):
            off = offsets[k]
            copyto(arena[off:off + lengths[k]], bufs[k])
        return
    for k in range(start, stop):
        off = offsets[k]
        copyto(bufs[k], arena[off:off + lengths[k]])


def _copy_pool() -> ThreadPoolExecutor:
    """The threads that copy the other parts of a split run, made on first use in this process
    (a forked child makes its own: it has none of its parent's threads)."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[0] != os.getpid():
            _pool = os.getpid(), ThreadPoolExecutor(COPY_THREADS - 1, thread_name_prefix="kvstore-copy")
        return _pool[1]


class Scratch:
    """A grow-only uint8 buffer, one per thread, so hot paths allocate once rather than per
    request. ``trim_above`` bytes: a request larger than that gets a buffer that is dropped after
    use, so one oversized request does not pin its size in memory for good (every worker thread
    would otherwise keep the largest block it ever saw). ``aligned``: buffers start on a page
    boundary (an anonymous mmap), which O_DIRECT reads and writes need; the kept one is touched
    once, so the hot path takes no page faults. ``min_bytes``: the smallest buffer kept, so a run
    of slowly growing requests does not reallocate each time."""

    def __init__(self, trim_above: int | None = None, aligned: bool = False, min_bytes: int = 0) -> None:
        self._local = threading.local()
        self.trim_above = trim_above
        self.aligned = aligned
        self.min_bytes = min_bytes if trim_above is None else min(min_bytes, trim_above)

    def get(self, nbytes: int) -> np.ndarray:
        if self.trim_above is not None and nbytes > self.trim_above:
            return self._allocate(nbytes, touch=False)
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            buf = self._allocate(max(nbytes, self.min_bytes), touch=True)
            self._local.buf = buf
        return buf[:nbytes]

    def _allocate(self, nbytes: int, touch: bool) -> np.ndarray:
        if not self.aligned:
            return np.empty(nbytes, dtype=np.uint8)
        pages = -(-max(nbytes, 1) // mmap.PAGESIZE)
        buf = np.frombuffer(mmap.mmap(-1, pages * mmap.PAGESIZE), dtype=np.uint8)  # unmapped with its last view
        if touch:
            buf[::mmap.PAGESIZE] = 0
        return buf
