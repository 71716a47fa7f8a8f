"""Runs ``fast_cpu`` kernels over a block: where each of its tensors sits (computed once per block
shape), the 16- and 32-bit word views the kernels read and write, and the split of their work
units across threads.

Kernels are single-threaded and release the GIL; a call's work is cut into pieces (ranges of
every tensor's units) that the caller's thread and ``n - 1`` pool threads take in turn, so a block
costs one hand-off per extra thread, a thread slowed by another process on its core delays the
call by one piece at most, there is no second OpenMP runtime spinning against torch's, and
concurrent requests from the daemon's threads simply run side by side. ``n`` is
``kvstore.threads.BUDGET.codec`` (``threads_at_most`` lowers it while open); small blocks run on
the caller's thread alone.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvstore.codecs import layout as kvlayout
from kvstore.threads import BUDGET

#: below this many elements a block runs on the caller's thread alone (a hand-off costs ~20 us)
MIN_PARALLEL_ELEMENTS = 1 << 17

Geometry = tuple[int, int, int, int, int, int, int, int]   # offset, L, T, H, D, stride_l, stride_t, stride_h


def _geometry(view: torch.Tensor) -> Geometry | None:
    """(offset, L, T, H, D, stride_l, stride_t, stride_h) of a ``[L, T, H, D]`` view in elements
    of the flat block it was cut from (0 for an axis of size 1, whose stride means nothing); None
    if its rows (D) are not contiguous."""
    if view.stride(3) != 1 and view.shape[3] > 1:
        return None
    strides = [0 if n == 1 else s for n, s in zip(view.shape[:3], view.stride()[:3])]
    return (view.storage_offset(), *view.shape, *strides)


@functools.lru_cache(maxsize=512)
def geometries(shape: kvlayout.BlockShape) -> tuple[Geometry | None, ...]:
    """Each tensor's geometry inside a block of ``shape`` (from views of a storage-less tensor)."""
    block = torch.empty(shape.numel, dtype=shape.dtype, device="meta")
    return tuple(_geometry(v) for v in kvlayout.part_views(block, shape))


@functools.lru_cache(maxsize=512)
def words32_ok(shape: kvlayout.BlockShape) -> bool:
    """Whether every row of every tensor starts on a 32-bit word (INT4 kernels read pairs)."""
    geoms = geometries(shape)
    return shape.dim % 2 == 0 and all(g is None or all(x % 2 == 0 for x in (g[0], *g[5:])) for g in geoms)


def shares(section: np.ndarray, parts: int) -> list[np.ndarray]:
    """A payload section laid out tensor after tensor, cut into each tensor's equal share."""
    n = section.size // parts
    return [section[i * n:(i + 1) * n] for i in range(parts)]


def words16(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU tensor's bytes as a writable numpy uint16 array sharing memory."""
    return t.view(torch.int16).numpy().view(np.uint16)


class Tensors:
    """The tensors of one block as (16-bit words, geometry) to read or write in place; a tensor
    whose rows are strided (vllm_cpu keys) goes through a contiguous copy, which ``finish()``
    writes back after a decode."""

    def __init__(self, block: torch.Tensor, shape: kvlayout.BlockShape, writing: bool) -> None:
        self.items: list[tuple[np.ndarray, Geometry]] = []
        self._copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        whole = block.numpy().view(np.uint16)  # (a flat uint8 CPU tensor: numpy() never copies)
        views = None
        for i, geom in enumerate(geometries(shape)):
            if geom is not None:
                self.items.append((whole, geom))
                continue
            views = views or kvlayout.part_views(block.view(shape.dtype), shape)
            copy = torch.empty(views[i].shape, dtype=shape.dtype) if writing else views[i].contiguous()
            if writing:
                self._copies.append((views[i], copy))
            self.items.append((words16(copy.view(-1)), _geometry(copy)))

    def finish(self) -> None:
        for view, copy in self._copies:
            view.copy_(copy)


_POOL: tuple[ThreadPoolExecutor, int] | None = None   # (pool, its workers)
_POOL_LOCK = threading.Lock()


def _pool(workers: int) -> ThreadPoolExecutor:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None or _POOL[1] < workers:
            _POOL = (ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvstore-codec"), workers)
        return _POOL[0]


Job = tuple[Callable[[int, int], int | None], int]   # kernel call over units [u0, u1), units

#: pieces per thread each job is cut into; threads take pieces as they go, so a thread that shares
#: its core with another process (a busy machine) costs the call a piece, not half of it
PIECES_PER_THREAD = 4


_limit: int | None = None   # (see ``threads_at_most``)


@contextlib.contextmanager
def threads_at_most(n: int) -> Iterator[None]:
    """Calls made while this is open run on at most ``n`` threads, not ``BUDGET.codec``: how
    ``bench_codecs.py`` measures the kernels on one thread and on two."""
    global _limit
    saved, _limit = _limit, n
    try:
        yield
    finally:
        _limit = saved


def run(jobs: Sequence[Job], numel: int) -> list[int]:
    """Run every job over all of its units, on up to ``BUDGET.codec`` threads; each job's summed
    result."""
    most = BUDGET.codec if _limit is None else _limit
    n = 1 if numel < MIN_PARALLEL_ELEMENTS else max(1, min(most, max(u for _, u in jobs)))
    if n == 1:
        return [fn(0, units) or 0 for fn, units in jobs]
    pieces = iter([(j, units * p // (n * PIECES_PER_THREAD), units * (p + 1) // (n * PIECES_PER_THREAD))
                   for j, (_, units) in enumerate(jobs) for p in range(n * PIECES_PER_THREAD)])

    def work() -> list[int]:
        done = [0] * len(jobs)
        for j, a, b in pieces:  # (next() on a list iterator is atomic under the GIL)
            if b > a:
                done[j] += jobs[j][0](a, b) or 0
        return done

    futures = [_pool(n - 1).submit(work) for _ in range(n - 1)]
    results = work()
    for f in futures:
        results = [a + b for a, b in zip(results, f.result())]
    return results
