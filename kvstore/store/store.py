"""The Store: put / get / lookup / delete over the tier cascade, and the seams other layers use.

Everything a caller may need from the store's state goes through a public method here: listener
registration with a snapshot (``subscribe``), a pinned view of one block (``pinned``), the shared
arena's description (``shared_arena``), the size bound of a block (``largest_block_bytes``), a
tenant's quota accounting (``tenant_bytes``, ``quota_hold``) and the figures one tenant may see
(``tenant_stats``), and a snapshot of the index for inspection (``block_states``).
``lookup`` pins what it reports for ``lease_seconds``, so the get that follows never races an
eviction; the two-phase zero-copy operations are ``Store.leases`` (``leases.Leases``).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator, Sequence

import numpy as np

from kvstore.buffers import writable_bytes
from kvstore.errors import BlockTooLarge, InvalidArgument, QuotaExceeded, TierIOError
from kvstore.keys import Namespace
from kvstore.store.admin import StoreAdmin
from kvstore.store.cascade import Cascade
from kvstore.store.config import StoreConfig
from kvstore.store.leases import Leases
from kvstore.store.listeners import StoreListener
from kvstore.store.namespaces import NamespaceRegistry
from kvstore.store.puts import checked_payloads, put_chain
from kvstore.store.reads import read_blocks
from kvstore.store.recovery import RecoveryProgress, recover
from kvstore.store.transfers import COPIED
from kvstore.store.views import BlockState, PinnedBlock, SharedArena
from kvstore.tiers.base import Tier
from kvstore.wire import Lookup

log = logging.getLogger("kvstore.store")
#: a memory tier taking more than this many times a block's bytes for it is worth a warning ...
SLACK_WARN_RATIO = 1.1
#: ... for this many block sizes at most
SLACK_WARNINGS = 32
#: the longest ``flush`` waits for demotions writing blocks down when it starts
FLUSH_WAITS_S = 10.0


class Store:
    def __init__(self, tiers: Sequence[Tier], config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, on_recovery: RecoveryProgress | None = None) -> None:
        """``clock`` measures leases; the sizing planner passes trace time. ``on_recovery``: told
        how a warm restart's recovery advances (``kvstore.store.recovery.recover``)."""
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.config = config or StoreConfig()
        durable = next((t for t in tiers if t.durable), None)
        self._namespaces = NamespaceRegistry(getattr(durable, "path") if durable is not None else None,
                                             self.config.max_namespaces_per_tenant)
        self._cascade = Cascade(tiers, self.config, self._namespaces, clock)
        for tier in tiers:   # a tier that splits its room by tenant (CPU tenant segments) asks whose
            tier.assign_owners(self._tenant_of_namespace)
        self.leases = Leases(self._cascade)   # the two-phase operations (leases.py)
        self._lock = self._cascade.lock
        self._index = self._cascade.index.entries
        self.tiers = self._cascade.tiers
        self.policies = self._cascade.index.policies
        self.counters = self._cascade.counters
        self.durable_index = self._cascade.durable_index
        self.cpu_index = self._cascade.cpu_index
        recover(self._cascade, on_recovery)
        self.admin = StoreAdmin(self._cascade, self._namespaces, self.leases)  # operator commands (admin.py)
        self._slack_warned: set[int] = set()   # block sizes already judged

    # -- namespaces ------------------------------------------------------------------------------

    def _tenant_of_namespace(self, namespace_id: bytes) -> str | None:
        ns = self._namespaces.find(namespace_id)
        return ns.tenant if ns is not None else None

    def register_namespace(self, ns: Namespace) -> bytes:
        """Idempotent: the id is a digest of the namespace, so equal layouts get equal ids. Not
        under the store lock: persisting a new namespace (an fsync) must not stall reads."""
        limit, why = self._block_limit()
        if ns.block_bytes > limit:
            raise BlockTooLarge(f"layout.block_bytes: {ns.block_bytes}-byte blocks exceed {why} ({limit} bytes)",
                                field="layout.block_bytes")
        try:
            self._namespaces.add(ns)
        except TierIOError:
            self._cascade.count("namespace_persist_errors")
            raise
        except QuotaExceeded:
            self._cascade.count("namespaces_refused_cap")
            raise
        self._warn_of_slack(ns)
        return ns.id

    def _warn_of_slack(self, ns: Namespace) -> None:
        """Log once per block size whose blocks fill a memory tier's slots badly: that tier then
        holds fewer of them than its size says (64 KiB blocks in 256 KiB slots: a quarter). The
        tiers' ``slack_bytes`` in stats show what it costs as blocks arrive. Callers choose block
        sizes, so at most ``SLACK_WARNINGS`` sizes are logged, and nothing a caller named (a model)."""
        size = ns.block_bytes
        if size in self._slack_warned or len(self._slack_warned) >= SLACK_WARNINGS:
            return
        self._slack_warned.add(size)
        for tier in self.tiers:
            if not tier.in_memory:
                continue
            try:
                room = tier.footprint(size)
            except BlockTooLarge:
                continue
            if room > size * SLACK_WARN_RATIO:
                log.warning("namespace %s: each %d-byte block takes %d bytes of the %s tier, %.0f%% of it unused; a "
                            "slot size that divides the block size (cpu_slot_bytes) wastes nothing%s",
                            ns.id.hex()[:16], size, room, tier.name, 100 * (1 - size / room),
                            "" if len(self._slack_warned) < SLACK_WARNINGS else " (the last such warning)")

    def namespace(self, namespace_id: bytes) -> Namespace:
        return self._namespaces.get(namespace_id)

    def namespaces(self) -> list[Namespace]:
        return self._namespaces.all()

    def namespace_bytes(self, namespace_id: bytes) -> int:
        return self._cascade.index.namespace_bytes.get(namespace_id, 0)

    # -- seams -----------------------------------------------------------------------------------

    @property
    def largest_block_bytes(self) -> int:
        """No namespace may declare blocks larger than this (see ``_block_limit``)."""
        return self._block_limit()[0]

    def _block_limit(self) -> tuple[int, str]:
        """The block size bound and what sets it: the biggest tier (a block must fit somewhere),
        ``max_block_bytes``, and ``min_blocks_per_tier`` of the smallest tier (a few huge blocks
        must not be able to flush a whole tier, nor pin its size in every scratch buffer)."""
        limits = [(max(t.capacity_bytes for t in self.tiers), "every tier")]
        if self.config.max_block_bytes is not None:
            limits.append((self.config.max_block_bytes, "max_block_bytes"))
        share = self.config.min_blocks_per_tier
        sized = [t for t in self.tiers if t.capacity_bytes > 0]
        if share > 0 and sized:
            smallest = min(sized, key=lambda t: t.capacity_bytes)
            limits.append((smallest.capacity_bytes // share,
                           f"1/{share} of the smallest tier ({smallest.name}, {smallest.capacity_bytes} bytes)"))
        return min(limits, key=lambda limit: limit[0])

    def subscribe(self, listener: StoreListener) -> dict[bytes, list[bytes]]:
        """Register ``listener`` and return the blocks it was not told about: every visible block's
        hash, by namespace. Atomic with the registration, so no block is missed; an event that
        follows may still reach the listener before the caller has handled the snapshot."""
        with self._lock:
            self._cascade.listeners.add(listener)
            return self._cascade.index.held_blocks()

    def held_blocks(self) -> dict[bytes, list[bytes]]:
        """Every served block's hash, by namespace (a snapshot: ``replay`` it to be exact)."""
        with self._lock:
            return self._cascade.index.held_blocks()

    def replay(self, listener: StoreListener, namespace_id: bytes, hashes: Sequence[bytes]) -> None:
        """Tell ``listener`` where each of ``hashes`` stands now, under the store lock so in order
        with live events: ``block_moved`` (fastest tier) for a served block, ``blocks_removed``
        for any other. Replaying ``subscribe``'s snapshot in batches makes a mirror exact without
        holding the lock for the whole snapshot."""
        with self._lock:
            gone = []
            for h in hashes:
                entry = self._cascade.index.visible(namespace_id, h)
                if entry is None:
                    gone.append(h)
                else:
                    listener.block_moved(namespace_id, h, entry.fastest)
            if gone:
                listener.blocks_removed(namespace_id, gone)

    def tier_names(self) -> list[str]:
        return [t.name for t in self.tiers]

    def unsubscribe(self, listener: StoreListener) -> None:
        with self._lock:
            self._cascade.listeners.remove(listener)

    @contextlib.contextmanager
    def pinned(self, namespace_id: bytes, block_hash: bytes) -> Iterator[PinnedBlock | None]:
        """Hold one block's fastest copy in place for the ``with`` body (None: absent). Not a read:
        no hit or miss is counted, the block is not promoted, its recency is unchanged."""
        with self._lock:
            entry = self._cascade.index.visible(namespace_id, block_hash)
            block = None if entry is None else PinnedBlock(self._cascade.pin_entry(entry).copies[entry.fastest],
                                                           self.tiers[entry.fastest])
        try:
            yield block
        finally:
            if entry is not None:
                with self._lock:
                    self._cascade.unpin(entry)

    def shared_arena(self) -> SharedArena | None:
        """The CPU tier's segment that same-host clients map, or None without a CPU tier."""
        if self.cpu_index is None:
            return None
        return SharedArena(self.tiers[self.cpu_index])  # type: ignore[arg-type]

    def block_states(self) -> list[BlockState]:
        """A snapshot of every block the index tracks (reserved, visible, or deleted while still
        pinned): which tiers hold a copy and how many pins hold it. For inspection: tests, debugging."""
        with self._lock:
            return [BlockState(e.namespace_id, e.block_hash, tuple(sorted(e.copies)), e.pins, e.visible)
                    for e in self._index.values()]

    # -- put -------------------------------------------------------------------------------------

    def put(self, namespace_id: bytes, hashes: Sequence[bytes], payloads: Sequence,
            parent: bytes | None = None, codecs: Sequence[int] | None = None) -> list[str]:
        """Store a chain of blocks (``payloads[i]``'s parent is ``hashes[i-1]``, the first's is
        ``parent``), each in the form the tier it lands in keeps (encoded where that tier has a
        codec). ``codecs[i]``: the codec ``payloads[i]`` is already encoded with (a peer's stored
        payload; None: all raw). Returns per block ``"stored"``, ``"exists"`` or ``"persisted"``
        (stored and on the durable tier). Raises ``StoreFull`` if a block fits nowhere; blocks
        before it stay."""
        ns = self._namespaces.check_batch(namespace_id, hashes)
        if len(payloads) != len(hashes):
            raise InvalidArgument("blocks", f"{len(payloads)} payloads for {len(hashes)} hashes")
        return put_chain(self._cascade, ns, hashes, checked_payloads(ns, payloads, codecs), parent, codecs)

    # -- reads -----------------------------------------------------------------------------------

    def lookup(self, namespace_id: bytes, hashes: Sequence[bytes], lease: bool = True) -> Lookup:
        """How many leading blocks of the chain are present, and in which tier; pins them."""
        self._namespaces.check_batch(namespace_id, hashes)
        tiers = []
        now = self._cascade.clock()
        until = now + self.config.lease_seconds
        index = self._cascade.index
        with self._lock:
            hits = []
            for h in hashes:
                entry = index.visible(namespace_id, h)
                if entry is None:
                    break
                hits.append(entry)
                tiers.append(self.tiers[entry.fastest].name)
            if lease:
                index.lease(hits, until, now)
            self._cascade.count("lookups")
        return Lookup(len(tiers), tiers)

    def contains(self, namespace_id: bytes, hashes: Sequence[bytes]) -> list[bool]:
        self._namespaces.check_batch(namespace_id, hashes)
        with self._lock:
            return [self._cascade.index.visible(namespace_id, h) is not None for h in hashes]

    def get_into(self, namespace_id: bytes, hashes: Sequence[bytes], outs: Sequence) -> list[int | None]:
        """Copy each block (decoded) into ``outs[i]``; returns its size, or None for a miss
        (absent or corrupt: a corrupt copy is dropped, counted, and another copy tried)."""
        got = self.get_payloads_into(namespace_id, hashes, outs)
        return [None if g is None else g[0] for g in got]

    def get_payloads_into(self, namespace_id: bytes, hashes: Sequence[bytes], outs: Sequence,
                          accept: Collection[int] = ()) -> list[tuple[int, int] | None]:
        """As ``get_into``, but a block stored with a codec in ``accept`` is copied as stored:
        per block ``(bytes, codec id)`` (codec 0: the block itself), or None for a miss."""
        ns = self._namespaces.check_batch(namespace_id, hashes)
        if len(outs) != len(hashes):
            raise InvalidArgument("outs", f"{len(outs)} buffers for {len(hashes)} hashes")
        try:
            dsts = [writable_bytes(out, "outs") for out in outs]
        except InvalidArgument:   # again, one by one, to name the one refused
            dsts = [writable_bytes(out, f"outs[{i}]") for i, out in enumerate(outs)]
        if dsts and min(map(len, dsts)) < ns.block_bytes:   # (flat byte arrays: a length is its bytes)
            short = min(map(len, dsts))
            raise InvalidArgument("outs", f"buffer of {short} bytes; blocks are {ns.block_bytes}")
        return read_blocks(self._cascade, namespace_id, hashes, dsts, accept)

    def stored_codecs(self) -> list[int]:
        """Ids of the codecs blocks may be stored with here (a reader that decodes them may ask
        for blocks as stored: ``get_payloads_into``, ``prepare_load(accept=...)``)."""
        return self._cascade.transcoder.stored_codecs()

    def get(self, namespace_id: bytes, hashes: Sequence[bytes]) -> list[bytes | None]:
        ns = self.namespace(namespace_id)
        outs = [np.empty(ns.block_bytes, dtype=np.uint8) for _ in hashes]
        sizes = self.get_into(namespace_id, hashes, outs)
        return [None if n is None else o[:n].tobytes() for o, n in zip(outs, sizes)]

    # -- tenants: quotas, and what each may see ---------------------------------------------------

    def tenant_bytes(self, tenant: str) -> int:
        """Bytes counted against ``tenant``'s quota: its blocks plus reservations in flight."""
        with self._lock:
            return self._cascade.quotas.charged.get(tenant, 0)

    @contextlib.contextmanager
    def quota_hold(self, namespace_id: bytes, hashes: Sequence[bytes]) -> Iterator[None]:
        """For a batch that arrives block by block: refuse it whole, now (``QuotaExceeded``), if
        its absent blocks would not fit its tenant's quota, and count them against the quota
        until the ``with`` body ends (see quotas.py). Each block is still charged when reserved."""
        ns = self._namespaces.check_batch(namespace_id, hashes)
        quotas = self._cascade.quotas
        if ns.tenant not in quotas.limits:
            yield
            return
        with self._lock:
            absent = sum(1 for h in hashes if self._cascade.index.find(namespace_id, h) is None)
            try:
                quotas.hold(ns.tenant, absent * ns.block_bytes)
            except QuotaExceeded:
                self._cascade.count("put_rejected_quota")
                raise
        try:
            yield
        finally:
            with self._lock:
                quotas.unhold(ns.tenant, absent * ns.block_bytes)

    def tenant_stats(self, tenant: str) -> dict:
        """The figures one tenant may see: its own namespaces', nothing store-wide."""
        mine = self._namespaces.of_tenant(tenant)
        quotas = self._cascade.quotas
        with self._lock:
            held = {ns.id: self._cascade.index.namespace_bytes.get(ns.id, 0) for ns in mine}
            charged = quotas.charged.get(tenant, 0)
        by_namespace = {ns.id.hex(): {"blocks": held[ns.id] // max(ns.block_bytes, 1), "bytes": held[ns.id]}
                        for ns in mine}
        return {"tenant": tenant, "namespaces": len(mine),
                "blocks": sum(v["blocks"] for v in by_namespace.values()), "bytes": sum(held.values()),
                "charged_bytes": charged, "quota_bytes": quotas.limits.get(tenant), "by_namespace": by_namespace}

    # -- delete, flush, stats --------------------------------------------------------------------

    def delete(self, namespace_id: bytes, hashes: Sequence[bytes]) -> int:
        self._namespaces.check_batch(namespace_id, hashes)
        index = self._cascade.index
        with self._lock:
            found = [e for e in (index.visible(namespace_id, h) for h in dict.fromkeys(hashes)) if e is not None]
            self._cascade.delete(found)
        return len(found)

    def flush(self) -> int:
        """Write every block that has no durable copy to the durable tier (write-back drain), each
        pinned while its copy is read and written with the lock released; a block whose demotion
        is writing that copy right now is left to it and waited for (at most ``FLUSH_WAITS_S``),
        so the one sync at the end covers it too. Returns the blocks written here."""
        d = self.durable_index
        if d is None:
            return 0
        cascade = self._cascade
        written = 0
        demoting, todo = [], []
        with self._lock:
            for entry in self._index.values():
                if not entry.visible or not len(entry.copies) or d in entry.copies:
                    continue
                if entry.writing_down:   # its demotion is writing that copy now (Cascade.clear_room)
                    demoting.append(entry)
                    continue
                todo.append((cascade.pin_entry(entry), entry.fastest))
        for k, (entry, src) in enumerate(todo):
            done = None
            try:
                done = cascade.copy_out(entry, src, d)
            finally:
                with self._lock:   # after a failure, the rest let go too
                    cascade.unpin_all((entry,) if done is not None else [e for e, _ in todo[k:]])
            if done == COPIED:
                written += 1
            else:
                cascade.count("flush_failures")
        deadline = time.monotonic() + FLUSH_WAITS_S
        while any(e.writing_down for e in demoting) and time.monotonic() < deadline:
            time.sleep(0.001)   # a write takes milliseconds; its end needs the lock this loop let go
        self.tiers[d].sync()  # also covers blocks demoted earlier without a sync
        return written

    def stats(self) -> dict:
        """Store-wide figures, every tenant's included (the daemon shows them to admins only
        when auth is on; a tenant gets ``tenant_stats``)."""
        quotas = self._cascade.quotas
        per_tenant = Counter(ns.tenant for ns in self._namespaces.all())   # namespaces of each
        with self._lock:
            codecs = self._cascade.transcoder.tier_stats(self._index.values())
            return {
                "blocks": sum(1 for e in self._index.values() if e.ready),
                "leases": len(self.leases),
                "namespaces": len(self._namespaces),
                "tiers": {t.name: {**t.stats(), "policy": p.name, "policy_blocks": len(p), "codec": codecs[t.name]}
                          for t, p in zip(self.tiers, self.policies)},
                "counters": {**self.counters, **self._namespaces.stats()},
                "tenants": {tenant: {"namespaces": n, "charged_bytes": quotas.charged.get(tenant, 0),
                                     "quota_bytes": quotas.limits.get(tenant),
                                     "leased_bytes": self.leases.leased_bytes(tenant)}
                            for tenant, n in per_tenant.items()},
            }

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
