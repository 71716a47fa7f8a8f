"""Warm restart: rebuild the index from what the durable tiers still hold.

Each durable tier yields the record of every intact block it finds (torn or corrupt files are
deleted by the tier, never yielded); recovered blocks are visible at once and count against their
tenant's quota (a block whose namespace is no longer registered counts against no one). Chain
links are made only after every block is known, since a child may be found before its parent, and
the policies hear about each copy last, when its chain state is final.
"""

from __future__ import annotations

from kvstore.store.cascade import Cascade
from kvstore.store.index import Entry


def recover(cascade: Cascade) -> None:
    """Rebuild ``cascade``'s index from its tiers, then the chain links, then the policies."""
    index = cascade.index
    for t, tier in enumerate(cascade.tiers):
        for record in tier.recover():
            entry = index.entries.get(record.key)
            if entry is None:
                ns = cascade.namespaces.find(record.namespace_id)
                entry = Entry(record.namespace_id, record.block_hash, record.parent_hash,
                              record.raw_size, ready=True, charged_to=None if ns is None else ns.tenant)
                index.entries[record.key] = entry
                index.namespace_bytes[record.namespace_id] += record.raw_size
                if ns is not None:  # whatever the quota now: these bytes are already stored
                    cascade.quotas.restore(ns.tenant, record.raw_size)
            entry.copies[t] = record
            cascade.count("recovered_blocks")
    for entry in index.entries.values():
        index.link(entry)
    for entry in index.entries.values():
        for t in entry.copies:
            index.track_copy(entry, t)
