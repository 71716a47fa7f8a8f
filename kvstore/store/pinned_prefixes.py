"""Pinned prefixes: chains an operator declared must never be evicted (``kvstore pin``), kept in the CPU tier.

A pin is a declaration about block hashes of one namespace, whether the blocks are stored yet or
not, so a system prompt can be pinned before its first request: blocks already stored are held at
once and copied into the CPU tier (``Transfers.warm``); blocks published later are held as they
arrive (this is a store listener while any prefix is pinned, so puts pay nothing for it otherwise). A held block (``Entry.held``) is skipped by every tier's
eviction. A client's Delete still removes it (the tenant's own data), and a later put of the same
block is held again; ``kvstore ns drop`` forgets the namespace's pins with it.

Bound: each tenant may pin at most ``limit_bytes`` (None: unbounded) of the CPU tier, counted as
what its pins hold there, whether their blocks are stored yet or not: each pinned block's slot
footprint (a 2 KiB block in a 256 KiB slot costs 256 KiB) and, with tenant segments, every
segment a pinned block keeps from passing to another tenant (at least the footprints rounded up
to whole segments). So one tenant cannot pin the CPU tier away from the others: a pin beyond it is
refused whole (``QuotaExceeded`` naming the setting) and leaves nothing pinned. Whatever the
limits add up to, all tenants' pins together hold at most ``PINNED_SHARE`` of the CPU tier: the
rest always holds blocks eviction can move, so no tenant's put or promotion meets a wall of other
tenants' pins. Pins live in memory: a restarted daemon starts with none.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from kvstore.errors import QuotaExceeded
from kvstore.keys import Namespace
from kvstore.store.cascade import Cascade
from kvstore.store.listeners import StoreListener
from kvstore.store.transfers import WARMED

#: the daemon setting that sets ``PinnedPrefixes.limit_bytes`` (named in refusals)
LIMIT_SETTING = "max_pinned_bytes_per_tenant"
#: the most of the CPU tier all tenants' pins together may hold
PINNED_SHARE = 0.5


@dataclasses.dataclass
class PinOutcome:
    """What one pin or unpin did: blocks newly (un)pinned of those named, how many of them are
    stored now, how many were copied into the CPU tier, and the tenant's pinned bytes after it."""

    pinned: int = 0
    stored: int = 0
    warmed: int = 0
    tenant_pinned_bytes: int = 0


class PinnedPrefixes(StoreListener):
    """Pinned hashes per namespace, and what each tenant's pins hold. Takes the store lock itself,
    except in the listener callbacks, which the cascade calls with it held."""

    def __init__(self, cascade: Cascade) -> None:
        self.cascade = cascade
        self.limit_bytes: int | None = None   # set by ``StoreAdmin.set_limits``
        self._hashes: dict[bytes, dict[bytes, None]] = {}   # namespace id -> pinned hashes (ordered)
        self._namespaces: dict[bytes, Namespace] = {}

    def pin(self, ns: Namespace, hashes: Sequence[bytes]) -> PinOutcome:
        cascade = self.cascade
        with cascade.lock:
            pins = self._hashes.setdefault(ns.id, {})
            self._namespaces[ns.id] = ns
            cascade.listeners.add(self)
            new = [h for h in dict.fromkeys(hashes) if h not in pins]
            for h in new:
                pins[h] = None
            stored = []
            for h in hashes:   # every block named, new or not: an earlier pin may predate its arrival
                entry = cascade.index.visible(ns.id, h)
                if entry is not None:
                    entry.held = True
                    stored.append(entry)
            self._refuse_beyond_limit(ns, new)
        warmed = sum(1 for entry in stored if cascade.transfers.warm(entry) == WARMED)   # its I/O without the lock
        with cascade.lock:   # the copies just made may keep more segments than the footprints say
            self._refuse_beyond_limit(ns, new)
            return PinOutcome(pinned=len(new), stored=len(stored), warmed=warmed,
                              tenant_pinned_bytes=self._cost(ns.tenant))

    def _refuse_beyond_limit(self, ns: Namespace, new: Sequence[bytes]) -> None:
        """Take back the pins of ``new`` and raise ``QuotaExceeded`` if the tenant's pins now hold
        more than ``limit_bytes`` (naming the setting), or all tenants' more than ``PINNED_SHARE``
        of the CPU tier. Caller holds the lock."""
        cost, cpu = self._cost(ns.tenant), self._cpu()
        share = int(cpu.capacity_bytes * PINNED_SHARE) if cpu is not None else None
        total = sum(self._cost(t) for t in {self._namespaces[nsid].tenant for nsid in self._hashes})
        if self.limit_bytes is not None and cost > self.limit_bytes:
            refused = QuotaExceeded(
                f"{LIMIT_SETTING}: with {len(new)} more blocks pinned, tenant {ns.tenant!r}'s pins would hold "
                f"{cost} bytes of the CPU tier (slot footprints"
                f"{', and the segments they keep' if self._segment_bytes() else ''}), which would exceed its limit "
                f"of {self.limit_bytes} bytes; nothing was pinned (unpin something, or raise {LIMIT_SETTING})",
                field=LIMIT_SETTING)
        elif share is not None and total > share:
            refused = QuotaExceeded(
                f"pins: with {len(new)} more blocks pinned, all tenants' pins would hold {total} bytes of the "
                f"CPU tier, more than the {share} bytes ({PINNED_SHARE:.0%} of it) pins may hold together, so that "
                "every tenant keeps room; nothing was pinned (unpin something)", field="hashes")
        else:
            return
        self._release(ns.id, new)
        self.cascade.counters["pins_refused_limit"] += 1
        raise refused

    def _cpu(self):
        c = self.cascade.cpu_index
        return None if c is None else self.cascade.tiers[c]

    def _segment_bytes(self) -> int:
        cpu = self._cpu()
        return cpu.segment_bytes if cpu is not None else 0

    def _cost(self, tenant: str) -> int:
        """What ``tenant``'s pins hold of the CPU tier (see the module docstring). Caller holds the lock."""
        cpu = self._cpu()
        footprints, held_keys = 0, []
        for nsid, pins in self._hashes.items():
            ns = self._namespaces[nsid]
            if ns.tenant != tenant or not pins:
                continue
            footprints += len(pins) * (cpu.footprint(ns.block_bytes) if cpu is not None else ns.block_bytes)
            held_keys += [nsid + h for h in pins]
        segment = self._segment_bytes()
        if not segment:
            return footprints
        return max(-(-footprints // segment), len(cpu.segments_of(held_keys))) * segment

    def _release(self, namespace_id: bytes, hashes: Sequence[bytes]) -> list[bytes]:
        """Forget the pins of ``hashes``; their blocks stay stored, evictable again. Returns those
        that were pinned. Caller holds the lock."""
        pins = self._hashes.get(namespace_id, {})
        gone = [h for h in dict.fromkeys(hashes) if h in pins]
        for h in gone:
            del pins[h]
            entry = self.cascade.index.find(namespace_id, h)
            if entry is not None:
                entry.held = False   # still in its tiers' policies: evictable again
        if not pins:
            self._hashes.pop(namespace_id, None)
            self._namespaces.pop(namespace_id, None)
        if not self._hashes:
            self.cascade.listeners.remove(self)
        return gone

    def unpin(self, namespace_id: bytes, hashes: Sequence[bytes] | None = None) -> PinOutcome:
        """Release the pins of ``hashes`` (None: every pin of the namespace); blocks stay stored,
        evictable again."""
        with self.cascade.lock:
            ns = self._namespaces.get(namespace_id)
            gone = self._release(namespace_id, list(self._hashes.get(namespace_id, {})) if hashes is None else hashes)
            return PinOutcome(pinned=len(gone), tenant_pinned_bytes=self._cost(ns.tenant) if ns is not None else 0)

    def of_namespace(self, namespace_id: bytes) -> tuple[int, int]:
        """(pinned blocks, pinned bytes) declared for one namespace."""
        with self.cascade.lock:
            n = len(self._hashes.get(namespace_id, ()))
            ns = self._namespaces.get(namespace_id)
            return n, n * (ns.block_bytes if ns is not None else 0)

    def by_tenant(self) -> dict[str, int]:
        """What each tenant's pins hold of the CPU tier (tenants with pins only)."""
        with self.cascade.lock:
            tenants = {self._namespaces[nsid].tenant for nsid, pins in self._hashes.items() if pins}
            return {t: self._cost(t) for t in tenants}

    # -- listener: blocks of a pinned prefix that arrive after the pin ----------------------------

    def blocks_added(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        pins = self._hashes.get(namespace_id)
        if not pins:
            return
        for h in block_hashes:
            if h in pins:
                entry = self.cascade.index.find(namespace_id, h)
                if entry is not None:
                    entry.held = True
