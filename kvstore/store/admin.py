"""Operator operations on the store: where the space goes per namespace, dropping a namespace,
evicting a prefix, pinning, prewarming, and limits changed while serving.

These are what ``kvstore ns list / ns drop / evict / pin / unpin / prewarm / reload`` do inside the
daemon. Authorisation (which tenant may touch which namespace) is the service's; everything here
trusts its caller. Walking every block of a namespace is O(blocks in the store): fine for an
operator's command, never on a request path. Footprints are counted from a snapshot taken under
the lock, outside it, so listing a large store does not stall reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from kvstore.store.cascade import Cascade
from kvstore.store.index import Entry
from kvstore.store.leases import Leases
from kvstore.store.namespaces import NamespaceRegistry
from kvstore.store.pinned_prefixes import PinnedPrefixes
from kvstore.store.transfers import ALREADY_WARM, WARMED


@dataclasses.dataclass
class Footprint:
    """One namespace's share of the store: visible blocks and their raw bytes, and per tier the
    copies held there and the bytes they occupy (encoded size), plus what is pinned."""

    blocks: int = 0
    bytes: int = 0
    tiers: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    pinned_blocks: int = 0
    pinned_bytes: int = 0


@dataclasses.dataclass
class Freed:
    """What a drop or an evict removed; ``held`` counts pinned blocks an evict left in place."""

    blocks: int = 0
    bytes: int = 0
    held: int = 0


@dataclasses.dataclass
class Warmed:
    """What a prewarm did with the blocks it was given."""

    warmed: int = 0      # copied into the CPU tier
    already: int = 0     # had a CPU (or faster) copy
    missing: int = 0     # not stored here
    failed: int = 0      # no room in the CPU tier (everything pinned) or a damaged copy (dropped)


class StoreAdmin:
    """The store's operator seam (``Store.admin``); ``pins`` holds ``kvstore pin``'s pinned prefixes;
    ``leases`` are the store's, whose budget ``set_limits`` sets."""

    def __init__(self, cascade: Cascade, namespaces: NamespaceRegistry, leases: Leases) -> None:
        self.cascade = cascade
        self.namespaces = namespaces
        self.pins = PinnedPrefixes(cascade)
        self.leases = leases

    # -- limits changed while serving (reload) ----------------------------------------------------

    def set_limits(self, quotas: Mapping[str, int], max_pinned_bytes_per_tenant: int | None,
                   max_leased_bytes_per_tenant: int | None = None) -> None:
        """New per-tenant byte quotas, pin bound and load-lease budget (None: half the CPU tier,
        ``leases.LEASED_SHARE``). Bytes already stored, pinned or leased stay: a lower limit only
        refuses what comes next."""
        with self.cascade.lock:
            self.cascade.quotas.limits = dict(quotas)
            self.pins.limit_bytes = max_pinned_bytes_per_tenant
            self.leases.limit_bytes = max_leased_bytes_per_tenant

    def quota_limits(self) -> dict[str, int]:
        """Tenant -> byte quota, for tenants that have one."""
        with self.cascade.lock:
            return dict(self.cascade.quotas.limits)

    # -- where the space goes ---------------------------------------------------------------------

    def footprints(self, namespace_ids: Iterable[bytes]) -> dict[bytes, Footprint]:
        cascade = self.cascade
        with cascade.lock:
            entries = list(cascade.index.entries.values())
        names = [t.name for t in cascade.tiers]
        out = {ns_id: Footprint(tiers={n: {"blocks": 0, "bytes": 0} for n in names}) for ns_id in namespace_ids}
        for entry in entries:
            fp = out.get(entry.namespace_id)
            if fp is None or not entry.visible:
                continue
            fp.blocks += 1
            fp.bytes += entry.raw_size
            for t, stored_size, _ in entry.copies.sizes_and_codecs():
                fp.tiers[names[t]]["blocks"] += 1
                fp.tiers[names[t]]["bytes"] += stored_size
        for ns_id, fp in out.items():
            fp.pinned_blocks, fp.pinned_bytes = self.pins.of_namespace(ns_id)
        return out

    # -- dropping ---------------------------------------------------------------------------------

    def drop_namespace(self, namespace_id: bytes) -> Freed:
        """Unregister the namespace (its file too), forget its pins and drop every block of it
        from every tier. Unregistered first, so a put arriving after it is refused; a reservation
        already in flight (never visible yet) is left to its writer, whose slot it still is."""
        self.namespaces.remove(namespace_id)
        self.pins.unpin(namespace_id)
        with self.cascade.lock:
            return self._drop([e for e in self.cascade.index.entries.values()
                               if e.namespace_id == namespace_id and e.visible])

    def evict(self, namespace_id: bytes, hashes: Sequence[bytes] | None = None) -> Freed:
        """Drop the blocks of ``hashes`` (None: the whole namespace) from every tier, leaving
        pinned ones in place (counted in ``held``: unpin them first)."""
        index = self.cascade.index
        with self.cascade.lock:
            if hashes is None:
                found = [e for e in index.entries.values() if e.namespace_id == namespace_id and e.visible]
            else:
                found = [e for e in (index.visible(namespace_id, h) for h in dict.fromkeys(hashes)) if e is not None]
            freed = self._drop([e for e in found if not e.held])
            freed.held = sum(1 for e in found if e.held)
            return freed

    def _drop(self, entries: list[Entry]) -> Freed:
        """Caller holds the lock. A block a reader has pinned right now is doomed (invisible at
        once, freed on its last unpin), as a client's Delete does."""
        freed = Freed(blocks=len(entries), bytes=sum(e.raw_size for e in entries))
        for entry in entries:
            entry.held = False
        self.cascade.delete(entries)
        self.cascade.count("admin_dropped_blocks", freed.blocks)
        return freed

    # -- warming ----------------------------------------------------------------------------------

    def prewarm(self, namespace_id: bytes, hashes: Sequence[bytes]) -> Warmed:
        """Copy the stored blocks of ``hashes`` into the CPU tier, one at a time, each read and
        written with the lock released (``Transfers.warm``), so requests interleave with a long prewarm."""
        result = Warmed()
        for h in dict.fromkeys(hashes):
            with self.cascade.lock:
                entry = self.cascade.index.visible(namespace_id, h)
            if entry is None:
                result.missing += 1
                continue
            done = self.cascade.transfers.warm(entry)
            if done == WARMED:
                result.warmed += 1
            elif done == ALREADY_WARM:
                result.already += 1
            else:
                result.failed += 1
        return result
