"""Fetching planned blocks from the daemon into vLLM's paged cache, now or in the background.

A ``LoadJob`` is a set of blocks to bring in: it fetches every block into a staging buffer of its
own (one ``get_into``; a shared-memory copy on the same host), notes which arrived whole, and
scatters those into the paged cache — all layers at once, or one layer at a time when the forward
pass asks for it (``scatter_layer``). A block that did not arrive whole is a *load error*: its
vLLM block id goes back to vLLM, which recomputes from there. With ``blocks_per_chunk`` N > 1 a
stored block is a chunk: each layer of the vLLM blocks the plan names (not -1) is placed straight
out of it (``chunks.ChunkPacking.place_layer``); a chunk that did not arrive whole makes all of
them errors.

A layer-wise load from a remote daemon (``fetch_by_layers``) fetches byte ranges of the blocks a
group of layers at a time — layer 0 alone, then 2, 4, 8... layers (a block's layers are
consecutive byte ranges of it, a chunk's too) — so the forward pass places and runs layer 0 while
the rest is still on the wire, for a handful of round trips rather than one per layer. Every layer
of every planned block is placed; a block that missed any range is a load error, recomputed by
vLLM with whatever was placed in its pages overwritten.

``BackgroundLoader`` runs jobs on one thread, in order, so loads overlap the engine's forward
passes; finished jobs are collected by the worker (``take_finished``) at the end of each step.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable

import torch

from kvstore.client import NamespaceHandle
from kvstore.connectors.vllm.chunks import ChunkPacking
from kvstore.connectors.vllm.metadata import BlockTransfer
from kvstore.connectors.vllm.paged_blocks import PagedBlocks

logger = logging.getLogger("kvstore.connectors.vllm")


class LoadJob:
    """Blocks of one or more requests to bring in from the daemon."""

    def __init__(self, transfers: list[BlockTransfer], paged: PagedBlocks, asynchronous: bool = False,
                 packing: ChunkPacking | None = None) -> None:
        self.asynchronous = asynchronous   # lands between steps: reported through get_finished
        self.req_ids = [t.req_id for t in transfers]
        self.slots = [b for t in transfers for b in t.block_ids]     # N per hash, -1: not placed
        self.block_ids = [b for b in self.slots if b >= 0]            # the vLLM blocks to place
        self.num_local = len(self.slots) - len(self.block_ids)       # ... and those vLLM computed
        self.hashes = [h for t in transfers for h in t.hashes]
        self.paged = paged
        self.packing = packing
        self.n = packing.n if packing is not None else 1
        self.good: list[int] = []          # positions (in hashes) that arrived whole
        self.bad: set[int] = set()         # vLLM block ids to recompute
        self.done = threading.Event()
        self._staging: torch.Tensor | None = None
        self._good_ids: list[int] = []
        self._good_slots: list[int] = []
        self._plan: list = []              # chunks: index tensors for placing them (``placement``)
        self._good_rows: torch.Tensor | None = None
        self._layers_placed: set[int] = set()
        self._fetched = [threading.Event() for _ in paged.layers]   # by_layers: layer i is in
        self.by_layers = False
        self.ranged_gets = 0               # by_layers: one per group of layers

    def wait_fetched(self, layer: int) -> None:
        """Until layer ``layer``'s bytes are in (the whole job, unless fetched by layers)."""
        (self._fetched[layer] if self.by_layers else self.done).wait()

    def layer_groups(self) -> list[tuple[int, int]]:
        """Layers [a, b) fetched together: 0 alone, then groups twice as large each time."""
        groups, a, size = [], 0, 1
        while a < len(self.paged.layers):
            groups.append((a, min(a + size, len(self.paged.layers))))
            a, size = a + size, size * 2
        return groups

    def fetch_by_layers(self, handle: NamespaceHandle) -> None:
        """``fetch``, a group of layers at a time (``layer_groups``), each group's byte range of
        every block with one ranged get; ``wait_fetched(i)`` returns as soon as layer i's group is
        in. Never raises: a failure makes every block a load error (the layers still unfetched are
        released to the waiters and placed from whatever the buffer holds)."""
        per, offsets = self.n, self.paged.offsets
        keep = list(range(len(self.hashes))) if per > 1 else [i for i, b in enumerate(self.slots) if b >= 0]
        hashes, size = [self.hashes[i] for i in keep], per * self.paged.block_bytes
        missing: set[int] = set(keep)
        try:
            staging = self.paged.host_buffer(len(keep) * per)
            rows = staging.view(len(keep), size)
            host = rows.numpy()
            self._staging, self.good, self._good_ids = staging, list(keep), list(self.block_ids)
            if self.packing is not None:
                self._plan = self.packing.placement(self.slots, len(keep), self.paged.device)
            missing = set()
            for a, b in self.layer_groups():
                lo, hi = per * offsets[a], per * offsets[b]
                got = handle.get_into(hashes, [host[k][lo:hi] for k in range(len(keep))], byte_range=(lo, hi - lo))
                self.ranged_gets += 1
                missing |= {keep[k] for k, n in enumerate(got) if n != hi - lo}
                self._good_rows = self.paged.to_device_columns(rows, lo, hi, self._good_rows)
                for layer in range(a, b):
                    self._fetched[layer].set()
        except Exception as e:  # noqa: BLE001
            logger.warning("kvstore connector: load failed: %s", e)
            missing = set(keep)
        finally:
            for event in self._fetched:
                event.set()
        self.good = [i for i in keep if i not in missing]
        self.bad = {b for i in missing for b in self.slots[i * per:(i + 1) * per] if b >= 0}
        if not self.good:
            self._good_ids = []

    def fetch(self, handle: NamespaceHandle, staging: torch.Tensor | None = None) -> None:
        """Copy the blocks from the daemon into ``staging`` (uint8 [hashes x N, vLLM block bytes];
        a new buffer when None). Never raises: a failure makes every block a load error."""
        n, per = len(self.hashes), self.n
        size = per * self.paged.block_bytes
        try:
            staging = self.paged.host_buffer(n * per) if staging is None else staging[:n * per]
            chunks = staging.view(n, size)
            rows = chunks.numpy()
            sizes = handle.get_into(self.hashes, [rows[i] for i in range(n)])
            self.good = [i for i, got in enumerate(sizes) if got == size]
            slots = self.slots
            self.bad = {b for i, got in enumerate(sizes) if got != size for b in slots[i * per:(i + 1) * per] if b >= 0}
            self._staging = staging
            self._good_slots = [b for i in self.good for b in slots[i * per:(i + 1) * per]]
            self._good_ids = [b for b in self._good_slots if b >= 0]
            if self._good_ids:   # on CUDA: one DMA to the device now, placed layer by layer later
                keep = self.good if per > 1 else [i for i in self.good if slots[i] >= 0]
                self._good_rows = self.paged.to_device(chunks, None if len(keep) == n else keep)
                if self.packing is not None:
                    self._plan = self.packing.placement(self._good_slots, len(self.good), self.paged.device)
        except Exception as e:  # noqa: BLE001
            logger.warning("kvstore connector: load failed: %s", e)
            self.good, self.bad = [], set(self.block_ids)

    def scatter(self) -> None:
        """Place every layer of the blocks that arrived."""
        for i in range(len(self.paged.layers)):
            self.scatter_layer(i)

    def scatter_layer(self, i: int) -> None:
        """Place layer ``i`` of the blocks that arrived (once). Never raises: it runs inside
        vLLM's step (sync loads, ``wait_for_layer_load``), so a failure makes every block of the
        job a load error, which vLLM recomputes, and the remaining layers are not placed."""
        if i in self._layers_placed:
            return
        self._layers_placed.add(i)
        if not self._good_ids:
            return
        try:
            if self.packing is not None:   # chunks: each layer straight out of the fetched chunks
                self.packing.place_layer(self.paged, i, self._good_rows, self._plan)
            else:
                self.paged.scatter_layer(i, self._good_ids, self._good_rows)
        except Exception as e:  # noqa: BLE001 - the engine must never see a connector failure
            logger.warning("kvstore connector: placing loaded blocks failed: %s", e)
            self.bad |= set(self.block_ids)
            self.good, self._good_ids = [], []

    def add_stats(self, stats_add: Callable[[str, int | float], None]) -> None:
        """Counted in kvstore blocks (chunks), plus vLLM blocks of them not placed."""
        stats_add("loaded_blocks", len(self.good))
        stats_add("load_failed_blocks", len(self.hashes) - len(self.good))
        stats_add("load_local_blocks", self.num_local)
        if self.ranged_gets:
            stats_add("load_ranged_gets", self.ranged_gets)

    @property
    def layers_placed(self) -> frozenset[int]:
        return frozenset(self._layers_placed)

    def release(self) -> None:
        """Drop the staging buffer (the job is reported; its bytes are placed)."""
        self._staging = self._good_rows = None


class BackgroundLoader:
    """Runs load jobs on a background thread, in order; finished ones wait for ``take_finished``."""

    def __init__(self, handle: NamespaceHandle, stats_add: Callable[[str, int | float], None]) -> None:
        self.handle = handle
        self.stats_add = stats_add
        self._jobs: queue.Queue = queue.Queue()
        self._finished: list[LoadJob] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="kvstore-load", daemon=True)
        self._thread.start()

    def submit(self, job: LoadJob, place_all: bool) -> None:
        """Fetch ``job`` in the background; with ``place_all`` also scatter it into every layer."""
        self._jobs.put((job, place_all))

    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            if item is None:
                return
            job, place_all = item
            t0 = time.perf_counter()
            if job.by_layers:
                job.fetch_by_layers(self.handle)
            else:
                job.fetch(self.handle)
            if place_all:
                job.scatter()
                job.release()
            job.add_stats(self.stats_add)
            self.stats_add("load_seconds", time.perf_counter() - t0)
            with self._lock:
                self._finished.append(job)
            job.done.set()

    def take_finished(self) -> list[LoadJob]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def close(self) -> None:
        self._jobs.put(None)
