"""Warm restart: rebuild the index from what the durable tiers still hold.

Each durable tier yields the intact blocks it finds, a batch of columns at a time
(``RecoveredBlocks``; torn or corrupt ones are deleted by the tier, never yielded). Each block
becomes one ``Entry`` whose copy is a shared ``PlainCopy`` (its record made only when asked
for: the tier keeps the rest), so an index of millions holds one object per block. Recovered
blocks are visible at once and count against their tenant's quota (a block whose namespace is
no longer registered counts against no one). Chain
links are made only after every block is known, since a child may be found before its parent, and
the policies hear about each copy last, when its chain state is final. Everything is added in
bulk (one count, one quota charge per tenant, no policy refresh per link): recovery runs once per
block, before any request.
"""

from __future__ import annotations

import gc
from collections import defaultdict
from collections.abc import Callable

from kvstore.keys import NAMESPACE_ID_BYTES
from kvstore.store.cascade import Cascade
from kvstore.store.index import CHARGED, READY, Entry, PlainCopies
from kvstore.tiers.base import RecoveredBlocks

#: told (tier name, blocks found in it so far, whether that tier is done) during a recovery
RecoveryProgress = Callable[[str, int, bool], None]


def _found_in(tier, on_progress: RecoveryProgress | None) -> list[RecoveredBlocks]:
    """The batches of blocks ``tier`` finds; ``on_progress`` hears a durable tier's count as they
    come, after each batch (a slab's: a large NVMe tier takes seconds, the daemon shows it), and
    once more when the tier is done."""
    if on_progress is None or not tier.durable:
        return list(tier.recover_blocks())
    batches: list[RecoveredBlocks] = []
    on_progress(tier.name, 0, False)
    count = 0
    for found in tier.recover_blocks():
        batches.append(found)
        count += len(found)
        on_progress(tier.name, count, False)
    on_progress(tier.name, count, True)
    return batches


def recover(cascade: Cascade, on_progress: RecoveryProgress | None = None) -> None:
    """Rebuild ``cascade``'s index from its tiers, then the chain links, then the policies.
    ``on_progress``: see ``_found_in``. The cyclic collector is off meanwhile: recovery makes an
    entry per block, all kept, which it would walk again and again for nothing, run every few
    hundred allocations (it halves a restart's CPU)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        _recover(cascade, on_progress)
    finally:
        if enabled:
            gc.enable()


def _recover(cascade: Cascade, on_progress: RecoveryProgress | None) -> None:
    index = cascade.index
    entries, namespace_bytes = index.entries, index.namespace_bytes
    tenants: dict[bytes, str | None] = {}
    restored: dict[str, int] = defaultdict(int)
    found = [_found_in(tier, on_progress) for tier in cascade.tiers]   # the tiers' I/O, before the lock
    copy_of = PlainCopies()
    with cascade.lock:
        for t, batches in enumerate(found):
            for batch in batches:
                # a key is one object, shared by the tier, the entry and the policy
                for key, parent_key, raw_size, stored_size, codec in zip(
                        batch.keys, batch.parent_keys, batch.raw_sizes, batch.stored_sizes, batch.codecs):
                    entry = entries.get(key)
                    if entry is None:
                        nsid = key[:NAMESPACE_ID_BYTES]
                        if nsid not in tenants:
                            ns = cascade.namespaces.find(nsid)
                            tenants[nsid] = None if ns is None else ns.tenant
                        tenant = tenants[nsid]
                        entry = entries[key] = Entry(key, parent_key, raw_size,
                                                     READY | CHARGED if tenant is not None else READY)
                        namespace_bytes[nsid] += raw_size
                        if tenant is not None:  # whatever the quota now: these bytes are already stored
                            restored[tenant] += raw_size
                    entry.hold_plain(copy_of(t, stored_size, codec))
        for nsid, tenant in tenants.items():
            if tenant is not None:
                cascade.quotas.charges(nsid, tenant)
        for tenant, nbytes in restored.items():
            cascade.quotas.restore(tenant, nbytes)
        recovered = sum(len(batch) for batches in found for batch in batches)
        if recovered:
            cascade.counters["recovered_blocks"] += recovered
        index.link_recovered()
        index.track_recovered()
