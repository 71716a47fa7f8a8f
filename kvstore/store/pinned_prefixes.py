"""Pinned prefixes: chains an operator declared must never be evicted (``kvstore pin``), kept in the CPU tier.

A pin is a declaration about block hashes of one namespace, whether the blocks are stored yet or
not, so a system prompt can be pinned before its first request: blocks already stored are held at
once and copied into the CPU tier (``warming.warm``); blocks published later are held as they
arrive (this is a store listener). A held block (``Entry.held``) is skipped by every tier's
eviction. A client's Delete still removes it (the tenant's own data), and a later put of the same
block is held again; ``kvstore ns drop`` forgets the namespace's pins with it.

Bound: each tenant may pin at most ``limit_bytes`` (None: unbounded), counted at pin time as
``blocks x block_bytes`` whether stored yet or not, so one tenant cannot pin the CPU tier away
from the others; a pin beyond it is refused whole (``QuotaExceeded`` naming the setting). Pins
live in memory: a restarted daemon starts with none.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Sequence

from kvstore.errors import QuotaExceeded
from kvstore.keys import Namespace
from kvstore.store.cascade import Cascade
from kvstore.store.listeners import StoreListener
from kvstore.store.warming import WARMED, warm

#: the daemon setting that sets ``PinnedPrefixes.limit_bytes`` (named in refusals)
LIMIT_SETTING = "max_pinned_bytes_per_tenant"


@dataclasses.dataclass
class PinOutcome:
    """What one pin or unpin did: blocks newly (un)pinned of those named, how many of them are
    stored now, how many were copied into the CPU tier, and the tenant's pinned bytes after it."""

    pinned: int = 0
    stored: int = 0
    warmed: int = 0
    tenant_pinned_bytes: int = 0


class PinnedPrefixes(StoreListener):
    """Pinned hashes per namespace and pinned bytes per tenant. Takes the store lock itself,
    except in the listener callbacks, which the cascade calls with it held."""

    def __init__(self, cascade: Cascade, limit_bytes: int | None = None) -> None:
        self.cascade = cascade
        self.limit_bytes = limit_bytes
        self._hashes: dict[bytes, dict[bytes, None]] = {}   # namespace id -> pinned hashes (ordered)
        self._block_bytes: dict[bytes, int] = {}
        self._tenant_of: dict[bytes, str] = {}
        self.tenant_bytes: Counter[str] = Counter()

    def pin(self, ns: Namespace, hashes: Sequence[bytes]) -> PinOutcome:
        cascade = self.cascade
        with cascade.lock:
            mine = self._hashes.get(ns.id, {})
            new = list(dict.fromkeys(h for h in hashes if h not in mine))
            extra = len(new) * ns.block_bytes
            held = self.tenant_bytes[ns.tenant]
            if self.limit_bytes is not None and held + extra > self.limit_bytes:
                cascade.count("pins_refused_limit")
                raise QuotaExceeded(
                    f"{LIMIT_SETTING}: tenant {ns.tenant!r} has {held} bytes pinned; pinning {len(new)} more blocks "
                    f"({extra} bytes) would exceed its limit of {self.limit_bytes} bytes (unpin something, or raise "
                    f"{LIMIT_SETTING})", field=LIMIT_SETTING)
            pins = self._hashes.setdefault(ns.id, {})
            self._block_bytes[ns.id] = ns.block_bytes
            self._tenant_of[ns.id] = ns.tenant
            self.tenant_bytes[ns.tenant] += extra
            outcome = PinOutcome(pinned=len(new))
            for h in new:
                pins[h] = None
            stored = []
            for h in hashes:   # every block named, new or not: an earlier pin may predate its arrival
                entry = cascade.index.visible(ns.id, h)
                if entry is None:
                    continue
                entry.held = True
                stored.append(entry)
            outcome.stored = len(stored)
            outcome.tenant_pinned_bytes = self.tenant_bytes[ns.tenant]
        outcome.warmed = sum(1 for entry in stored if warm(cascade, entry) == WARMED)   # its I/O without the lock
        return outcome

    def unpin(self, namespace_id: bytes, hashes: Sequence[bytes] | None = None) -> PinOutcome:
        """Release the pins of ``hashes`` (None: every pin of the namespace); blocks stay stored,
        evictable again."""
        with self.cascade.lock:
            pins = self._hashes.get(namespace_id, {})
            gone = [h for h in (list(pins) if hashes is None else dict.fromkeys(hashes)) if h in pins]
            for h in gone:
                del pins[h]
                entry = self.cascade.index.find(namespace_id, h)
                if entry is not None:
                    entry.held = False   # still in its tiers' policies: evictable again
            tenant = self._tenant_of.get(namespace_id, "")
            self.tenant_bytes[tenant] -= len(gone) * self._block_bytes.get(namespace_id, 0)
            if not pins:
                self._forget(namespace_id)
            return PinOutcome(pinned=len(gone), tenant_pinned_bytes=self.tenant_bytes[tenant])

    def _forget(self, namespace_id: bytes) -> None:
        self._hashes.pop(namespace_id, None)
        self._block_bytes.pop(namespace_id, None)
        tenant = self._tenant_of.pop(namespace_id, None)
        if tenant is not None and self.tenant_bytes[tenant] <= 0:
            del self.tenant_bytes[tenant]

    def of_namespace(self, namespace_id: bytes) -> tuple[int, int]:
        """(pinned blocks, pinned bytes) declared for one namespace."""
        with self.cascade.lock:
            n = len(self._hashes.get(namespace_id, ()))
            return n, n * self._block_bytes.get(namespace_id, 0)

    def by_tenant(self) -> dict[str, int]:
        with self.cascade.lock:
            return {t: n for t, n in self.tenant_bytes.items() if n > 0}

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
