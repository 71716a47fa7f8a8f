"""Warm restart: rebuild the index from what the durable tiers still hold.

Each durable tier yields the record of every intact block it finds (torn or corrupt files are
deleted by the tier, never yielded); recovered blocks are visible at once and count against their
tenant's quota (a block whose namespace is no longer registered counts against no one). Chain
links are made only after every block is known, since a child may be found before its parent, and
the policies hear about each copy last, when its chain state is final. Everything is added in
bulk (one count, one quota charge per tenant, no policy refresh per link): recovery runs once per
block, before any request.
"""

from __future__ import annotations

import contextlib
import gc
from collections import defaultdict
from collections.abc import Callable, Iterator

from kvstore.keys import NAMESPACE_ID_BYTES
from kvstore.store.cascade import Cascade
from kvstore.store.index import Entry

#: told (tier name, blocks found in it so far, whether that tier is done) during a recovery
RecoveryProgress = Callable[[str, int, bool], None]
#: blocks found between two reports of a tier's count
PROGRESS_EVERY = 256


def _found_in(tier, on_progress: RecoveryProgress | None) -> list:
    """The records ``tier`` finds; ``on_progress`` hears a durable tier's count as they come, each
    ``PROGRESS_EVERY`` blocks (a large NVMe tier takes seconds: the daemon shows it), and once more
    when the tier is done."""
    if on_progress is None or not tier.durable:
        return list(tier.recover())
    records: list = []
    on_progress(tier.name, 0, False)
    for record in tier.recover():
        records.append(record)
        if len(records) % PROGRESS_EVERY == 0:
            on_progress(tier.name, len(records), False)
    on_progress(tier.name, len(records), True)
    return records


@contextlib.contextmanager
def _no_cycle_collection() -> Iterator[None]:
    """Recovery makes several objects per block, all kept: the cyclic collector, run every few
    hundred allocations, would walk them again and again for nothing (it halves a restart's CPU)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def recover(cascade: Cascade, on_progress: RecoveryProgress | None = None) -> None:
    """Rebuild ``cascade``'s index from its tiers, then the chain links, then the policies.
    ``on_progress``: see ``_found_in``."""
    with _no_cycle_collection():
        _recover(cascade, on_progress)


def _recover(cascade: Cascade, on_progress: RecoveryProgress | None) -> None:
    index = cascade.index
    entries, namespace_bytes = index.entries, index.namespace_bytes
    tenants: dict[bytes, str | None] = {}
    restored: dict[str, int] = defaultdict(int)
    found = [_found_in(tier, on_progress) for tier in cascade.tiers]   # the tiers' I/O, before the lock
    with cascade.lock:
        for t, records in enumerate(found):
            for record in records:
                key = record.key   # one object, shared by the tier, the entry and the policy
                entry = entries.get(key)
                if entry is None:
                    nsid = key[:NAMESPACE_ID_BYTES]
                    if nsid not in tenants:
                        ns = cascade.namespaces.find(nsid)
                        tenants[nsid] = None if ns is None else ns.tenant
                    tenant = tenants[nsid]
                    entry = entries[key] = Entry(key, record.parent_key, record.raw_size, ready=True,
                                                 charged_to=tenant)
                    namespace_bytes[nsid] += record.raw_size
                    if tenant is not None:  # whatever the quota now: these bytes are already stored
                        restored[tenant] += record.raw_size
                entry.copies[t] = record
        for tenant, nbytes in restored.items():
            cascade.quotas.restore(tenant, nbytes)
        if any(found):
            cascade.counters["recovered_blocks"] += sum(map(len, found))
        index.link_recovered()
        index.track_recovered()
