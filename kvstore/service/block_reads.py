"""Blocks read for sending: zero-copy views of the pinned CPU arena, a window at a time.

Both ways of sending blocks to a remote client (the gRPC Get stream and the bulk side channel)
read through here: their requests are checked in one place (``asked``), both send straight from
the arena, and both refuse to vouch for bytes whose pin ran out while they were being sent. A
block is sent as stored when the client decodes its codec itself (``accept``: the request's
``accept_codecs``), else decoded here first.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable, Collection, Iterator
from typing import NamedTuple

import numpy as np

from kvstore.buffers import window
from kvstore.errors import InvalidArgument, LeaseExpired
from kvstore.keys import Namespace
from kvstore.service.validation import check_hashes, check_range
from kvstore.store import Store

PIN_WINDOW_BYTES = 256 << 20   # reads pin at most this much of the arena at a time


class Run(NamedTuple):
    """Consecutive blocks of a read, valid until the generator moves on: each as the views of its
    bytes in order (several where its slots are not contiguous) with its codec id, or None for a
    miss; ``expires`` is when their pin runs out (inf: they are copies, nothing pinned)."""
    blocks: list[tuple[list[np.ndarray], int] | None]
    expires: float


class Asked(NamedTuple):
    """What a Get or BulkGet asks for, checked (``asked``): ``accept`` is empty with a byte range (a
    range of an encoded payload is no one's bytes); ``byte_range`` is (offset, length) or None."""
    ns: Namespace
    hashes: list[bytes]
    accept: frozenset[int]
    byte_range: tuple[int, int] | None


def asked(service, request, context) -> Asked:
    """The checked ``Asked`` of a ``GetRequest`` or ``BulkRequest`` (``service``: the ``ServiceState``)."""
    ns = service.caller_namespace(context, request.namespace_id, request.block_bytes)
    hashes = check_hashes(request.hashes)
    accept = accepted_codecs(service.store, request.accept_codecs)
    byte_range = check_range(request.range_offset, request.range_bytes, ns.block_bytes)
    return Asked(ns, hashes, frozenset() if byte_range else accept, byte_range)


def pinned_runs(store: Store, request: Asked, buffer: Callable[[int], np.ndarray]) -> Iterator[Run]:
    """The blocks asked for as views of the CPU arena while they are pinned, a run at a time (one
    per lease of at most ``PIN_WINDOW_BYTES`` or an eighth of the arena); with a byte range only
    those bytes of each block. A run whose sending outlived its lease raises LeaseExpired: its
    slots may have been reused meanwhile. Blocks that cannot be viewed in the arena (no arena;
    present but not stageable right now; encoded with a codec the client does not take) are
    copied, a run of their own, into ``buffer(nbytes)``, asked once per call and reused (a fresh
    buffer of a large block would page fault at a fraction of the decode's speed). Close the
    generator (``contextlib.closing``) so an early exit unpins its window."""
    ns, hashes, accept, byte_range = request
    buffer = functools.lru_cache(maxsize=1)(buffer)   # asked for one block's size, once per call
    arena = store.shared_arena()
    per_lease = 1 if arena is None else max(1, min(PIN_WINDOW_BYTES, arena.capacity_bytes // 8) // ns.block_bytes)
    start = 0
    while start < len(hashes):
        if arena is None:  # no arena: copy through the buffer
            yield Run([_copied(store, ns, hashes[start], buffer, accept, byte_range)], math.inf)
            start += 1
            continue
        asked = len(hashes[start:start + per_lease])
        lease = store.leases.prepare_load(ns.id, hashes[start:start + per_lease], accept)
        try:
            if lease.extents:
                yield Run([(arena.views(extents if byte_range is None else window(extents, *byte_range)), codec)
                           for extents, codec in zip(lease.extents, lease.codecs)], lease.expires)
                if time.monotonic() >= lease.expires:
                    raise LeaseExpired("lease_id: sending a block outlived its pin (lease_seconds too short for "
                                       "this link); retry")
        finally:
            try:
                store.leases.complete_load(lease.id)
            except LeaseExpired:
                pass
        start += len(lease.extents)
        if len(lease.extents) < asked:
            # the block that stopped the lease, copied if present: a false miss would make an
            # engine recompute a block that is sitting on NVMe
            h = hashes[start]
            yield Run([_copied(store, ns, h, buffer, accept, byte_range) if store.contains(ns.id, [h])[0] else None],
                      math.inf)
            start += 1


def _copied(store: Store, ns: Namespace, block_hash: bytes, buffer: Callable[[int], np.ndarray],
            accept: Collection[int], byte_range: tuple[int, int] | None = None) -> tuple[list[np.ndarray], int] | None:
    buf = buffer(ns.block_bytes)
    got = store.get_payloads_into(ns.id, [block_hash], [buf], accept)[0]
    if got is None:
        return None
    offset, nbytes = byte_range or (0, got[0])
    return [buf[offset:offset + nbytes]], got[1]


MAX_ACCEPT_CODECS = 64


def accepted_codecs(store: Store, requested) -> frozenset[int]:
    """The codecs of a request's ``accept_codecs`` that blocks here may be stored with."""
    if not requested:
        return frozenset()
    if len(requested) > MAX_ACCEPT_CODECS:
        raise InvalidArgument("accept_codecs", f"{len(requested)} codec ids; at most {MAX_ACCEPT_CODECS}")
    asked = set(requested)
    return frozenset(c for c in store.stored_codecs() if c in asked)
