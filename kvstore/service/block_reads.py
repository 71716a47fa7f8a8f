"""Blocks read for sending: zero-copy views of the pinned CPU arena, a window at a time.

Both ways of sending blocks to a remote client (the gRPC Get stream and the bulk side channel)
read through here, so both send straight from the arena and both refuse to vouch for bytes whose
pin ran out while they were being sent.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import numpy as np

from kvstore.errors import LeaseExpired
from kvstore.keys import Namespace
from kvstore.store import Store

PIN_WINDOW_BYTES = 256 << 20   # reads pin at most this much of the arena at a time


def pinned_blocks(store: Store, ns: Namespace, hashes: list[bytes],
                  buffer: Callable[[int], np.ndarray]) -> Iterator[np.ndarray | None]:
    """Each block as one view of the CPU arena while it is pinned (None = miss).

    Blocks are pinned a window at a time (at most ``PIN_WINDOW_BYTES`` or an eighth of the arena)
    under a store lease; if sending a block outlived the lease, its slots may have been reused
    meanwhile, so that raises LeaseExpired and the caller signals an error instead of vouching for
    those bytes. Blocks that cannot be viewed in the arena (no arena; present but not stageable
    right now) are copied into ``buffer(nbytes)``, whose view is valid until the next block.
    Close the generator (``contextlib.closing``) so an early exit unpins its window."""
    arena = store.shared_arena()
    window = 1 if arena is None else max(1, min(PIN_WINDOW_BYTES, arena.capacity_bytes // 8) // ns.block_bytes)
    start = 0
    while start < len(hashes):
        if arena is None:  # no arena: copy through the buffer
            yield _copied(store, ns, hashes[start], buffer)
            start += 1
            continue
        asked = len(hashes[start:start + window])
        lease = store.prepare_load(ns.id, hashes[start:start + window])
        try:
            for extents in lease.extents:
                views = arena.views(extents)
                yield views[0] if len(views) == 1 else np.concatenate(views)
                if time.monotonic() >= lease.expires:
                    raise LeaseExpired("lease_id: sending a block outlived its pin (lease_seconds too short "
                                       "for this link); retry")
        finally:
            try:
                store.complete_load(lease.id)
            except LeaseExpired:
                pass
        start += len(lease.extents)
        if len(lease.extents) < asked:
            # The block that stopped the lease: absent, or present but not stageable in the arena
            # right now (every slot pinned). Read the latter through the buffer: a false miss would
            # make an engine recompute a block that is sitting on NVMe.
            h = hashes[start]
            yield _copied(store, ns, h, buffer) if store.contains(ns.id, [h])[0] else None
            start += 1


def _copied(store: Store, ns: Namespace, block_hash: bytes, buffer: Callable[[int], np.ndarray]) -> np.ndarray | None:
    buf = buffer(ns.block_bytes)
    n = store.get_into(ns.id, [block_hash], [buf])[0]
    return None if n is None else buf[:n]

