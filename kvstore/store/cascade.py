"""The tier cascade: placing, moving and dropping copies of blocks across the ordered tiers.

Tiers are ordered fastest first (GPU, CPU, NVMe, Redis). A block may have a copy in several tiers
(the NVMe copy stays when a block is promoted, so demoting it again is free); reads come from the
fastest copy. When a tier is full its policy names a victim, which is *demoted* to the next tier
(write-back) or dropped if it has no lower tier. With ``write_through`` a put also lands on the
durable tier before it is acknowledged as persisted.

A new block is charged to its tenant's quota when it is reserved and released when it leaves
(``quotas.TenantQuotas``), so puts, same-host reservations and peer fetches are all counted.

The cascade owns the books: the index, every tier's policy, pins, quotas, counters and the
listeners' callbacks change only through its methods, under its one lock (``Cascade.lock``); a
method here that changes them expects it held unless its docstring says it takes it itself.

No I/O runs under that lock. Under it the cascade plans (picks victims, allocates room, pins what
a copy reads) and records what was done; disk and network reads and writes run between the two
with it released (``transfers.Transfers``, whose ``clear_room``, ``victims_ahead``, ``copy_out`` and ``copy_out_many``
the cascade answers as its own), the blocks they touch pinned: a victim written down (``clear_room``), a
write-through, a flush, a prewarm or a promotion into a disk tier (``copy_out``), a dropped
block's slot erased (``store_lock.StoreLock`` runs ``Tier.finish_drops`` on release). Under the lock only
memory copies run (a GPU victim into the CPU tier, a promotion into RAM); ``make_room`` there
refuses with ``RoomNotReady`` when room needs a write down, and the caller clears it and retries.

Locks are taken in one order only: the store lock (``Cascade.lock``), then a tier's own lock (its
slot or file table), then a thread pool's or scratch buffer's lock. Nothing holding a tier's lock
calls into the store, and the namespace registry's lock (registering persists a file) is never
taken with the store lock held.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.buffers import SCRATCH_KEEP_BYTES, Scratch
from kvstore.errors import BlockBusy, BlockTooLarge, QuotaExceeded, StoreFull, TierFull, TierIOError
from kvstore.keys import block_key
from kvstore.store.config import StoreConfig
from kvstore.store.index import CHARGED, BlockIndex, Entry, FastestCopies, PlainCopies
from kvstore.store.listeners import Listeners
from kvstore.store.namespaces import NamespaceRegistry
from kvstore.store.policy import make_tier_policies
from kvstore.store.quotas import TenantQuotas
from kvstore.store.store_lock import StoreLock
from kvstore.store.transcoding import StagedBlock, Transcoder
from kvstore.store.transfers import COPIED, PLACEMENT_ERRORS, ROOM_ATTEMPTS, RoomNotReady, Transfers
from kvstore.tiers.base import BlockRecord, Tier
from kvstore.tiers.cpu import CpuTier

#: how often a put of a deleted-but-still-pinned block looks again whether its last reader let go
DOOMED_POLL_S = 0.005
#: puts waiting on such blocks at once (each holds a request thread); past it a put is refused
DOOMED_WAITERS = 4
#: the longest such a put waits: within a client's default 5 s deadline
DOOMED_WAIT_MAX_S = 3.0


class Cascade:
    def __init__(self, tiers: Sequence[Tier], config: StoreConfig, namespaces: NamespaceRegistry,
                 clock: Callable[[], float]) -> None:
        self.tiers = list(tiers)
        self.config = config
        self.namespaces = namespaces
        self.clock = clock
        self.lock = StoreLock(self.tiers)
        self.index = BlockIndex(make_tier_policies(config.eviction_policy, [t.name for t in self.tiers]))
        self.counters: dict[str, int] = defaultdict(int)
        self.listeners = Listeners()
        self.transcoder = Transcoder(self.tiers, config, namespaces, self.count)
        self.durable_index = next((i for i, t in enumerate(self.tiers) if t.durable), None)
        self.cpu_index = next((i for i, t in enumerate(self.tiers) if isinstance(t, CpuTier)), None)
        if self.cpu_index is not None:   # its slots kept in the index's entries: one dict slot per block
            self.tiers[self.cpu_index].keep_slots_in(self.index.entries)
        self.quotas = TenantQuotas(config.tenant_quotas)
        self._plain = PlainCopies()   # the shared stand-in records of runs of new raw blocks (reserve_run)
        self._doomed_waiters = threading.BoundedSemaphore(DOOMED_WAITERS)
        # page-aligned: the NVMe tier reads into it with O_DIRECT
        self._scratch = Scratch(trim_above=SCRATCH_KEEP_BYTES, aligned=True, min_bytes=1 << 20)
        # the copies that do I/O (transfers.py), called as the cascade's own
        self.transfers = Transfers(self)
        self.clear_room = self.transfers.clear_room
        self.victims_ahead = self.transfers.victims_ahead
        self.copy_out = self.transfers.copy_out
        self.copy_out_many = self.transfers.copy_out_many

    # -- pins ------------------------------------------------------------------------------------

    def pin_entry(self, entry: Entry) -> Entry:
        """Hold a visible block the caller found in the index in place (no eviction, freed only on
        the last unpin). Caller holds the lock."""
        self.pin_all((entry,))
        return entry

    def pin_all(self, entries) -> None:
        """``pin_entry`` each of ``entries`` (caller holds the lock)."""
        index = self.index.entries
        for entry in entries:
            assert entry.visible and index.get(entry.key) is entry, "pinned a block the index does not serve"
            entry.add_pin()

    def unpin(self, entry: Entry) -> None:
        """Let go of one pin (caller holds the lock); a deleted block is freed on its last."""
        self.unpin_all((entry,))

    def pin_fastest(self, namespace_id: bytes, hashes: Sequence[bytes], todo: Sequence[int]) -> FastestCopies:
        """The visible blocks of ``hashes[i]`` for ``i`` in ``todo``, pinned (``pin_entry``), and
        where each one's fastest copy is (``BlockIndex.pin_fastest``). Caller holds the lock."""
        return self.index.pin_fastest(namespace_id, hashes, todo)

    def unpin_all(self, entries) -> None:
        """``unpin`` each of ``entries`` (caller holds the lock)."""
        for entry in self.index.drop_pins(entries):
            self.drop_entry(entry)

    def count(self, counter: str, n: int = 1) -> None:
        """Add ``n`` to one of the store's counters (takes the lock itself: increments are never lost)."""
        with self.lock:
            self.counters[counter] += n

    def served(self, t: int, blocks: int, nbytes: int) -> None:
        """Count ``blocks`` reads served from tier ``t``, ``nbytes`` in all: by value and by lease
        alike, here only. Caller holds the lock."""
        self.counters[f"hits_{self.tiers[t].name}"] += blocks
        self.counters["bytes_out"] += nbytes

    def unpin_keys(self, keys: Sequence[bytes]) -> None:
        """Unpin blocks by key (takes the lock itself)."""
        with self.lock:   # (each occurrence of a key in a lease holds a pin of its own)
            self.unpin_all([e for e in map(self.index.entries.get, keys) if e is not None and e.pins > 0])

    def is_pinned(self, key: bytes) -> bool:
        e = self.index.entries.get(key)
        return e is not None and (e.stays() or e.leased and self.index.leased(e, self.clock()))

    # -- writing a new block ---------------------------------------------------------------------

    def reserve(self, namespace_id: bytes, h: bytes, parent: bytes | None, nbytes: int,
                t: int, only_this_tier: bool = False, staged: StagedBlock | None = None) -> Entry | None:
        """Allocate an invisible entry with room in tier ``t`` or, when it cannot make room, the
        next tier down (None if the block exists or is being written), charged to its tenant's
        quota (``QuotaExceeded`` if it does not fit there) for its ``nbytes`` raw bytes. With
        ``staged``, the room is for the block's form in the tier it lands in (encoded when that
        tier has a codec; ``staged.placement(entry.fastest)`` is the payload to write); without,
        for ``nbytes`` raw bytes. Victims bound for a disk or network tier are written down with
        the lock released (``clear_room``), and the allocation retried when another caller took
        the room meanwhile. Takes the lock itself."""
        key = block_key(namespace_id, h)
        tenant = self.namespaces.get(namespace_id).tenant
        self.wait_out_doomed(key)
        clear = t   # the tier to clear room in before the next try
        for attempt in range(ROOM_ATTEMPTS):
            if key not in self.index.entries:   # (checked again below) a block present needs no room
                self.clear_room(clear, staged.placement(clear).record.stored_size if staged is not None else nbytes,
                                namespace_id)
            with self.lock:
                existing = self.index.entries.get(key)
                if existing is not None and existing.doomed:   # doomed again while we waited
                    self.counters["put_rejected_busy"] += 1
                    raise BlockBusy(key)
                if existing is not None:  # present, or being written by someone else
                    return None
                try:
                    self.quotas.charge(tenant, nbytes)
                except QuotaExceeded:
                    self.counters["put_rejected_quota"] += 1
                    raise
                try:
                    return self._new_entry(namespace_id, h, parent, nbytes, tenant, t, only_this_tier, staged,
                                           last_try=attempt + 1 == ROOM_ATTEMPTS)
                except RoomNotReady as e:
                    clear = e.tier
        raise AssertionError("unreachable: the last try falls through to slower tiers")

    def _new_entry(self, namespace_id: bytes, h: bytes, parent: bytes | None, nbytes: int, tenant: str, t: int,
                   only_this_tier: bool, staged: StagedBlock | None, last_try: bool) -> Entry:
        """``reserve``'s allocation under the lock, its quota charged (released again if it fails):
        room in tier ``t`` or, where there is none, a slower one. ``RoomNotReady`` when a victim
        must be written down first, except on the ``last_try``, which then goes on to the next
        tier. Caller holds the lock."""
        record = BlockRecord(namespace_id, h, parent, nbytes, nbytes)
        entry = Entry(record.key, self.index.shared_parent_key(record), nbytes, CHARGED)
        entries = self.index.entries
        entries[entry.key] = entry   # (invisible) before its room is taken: a slot tier keeps its slot in it
        try:
            while True:
                if staged is not None:
                    record = staged.placement(t).record.replace()
                try:
                    self.make_room(t, record.stored_size, namespace_id)
                    self.tiers[t].allocate(record)
                    break
                except RoomNotReady:
                    if not last_try:
                        raise
                    e: Exception = TierFull(f"{self.tiers[t].name} tier has no room without a write down")
                except (TierFull, BlockTooLarge) as err:
                    e = err
                if t + 1 < len(self.tiers) and not only_this_tier:
                    t += 1
                    continue
                self.counters["put_rejected_full"] += 1
                raise StoreFull(f"no tier can take a {nbytes}-byte block: {e}") from e
        except BaseException:   # no room taken: neither entry nor charge stays
            del entries[entry.key]
            self.quotas.release(tenant, nbytes)
            raise
        self.quotas.charges(namespace_id, tenant)
        record.parent_key = entry.parent_key   # one object for both
        entry.copies[t] = record
        return entry

    def reserve_run(self, ns, hashes: Sequence[bytes], parents: Sequence, start: int, t: int,
                    limit: int) -> list[Entry | None]:
        """``reserve`` for raw blocks ``start``.. (at most ``limit``) of ``ns`` in tier ``t`` under one
        lock acquisition: per block its invisible entry, or None where it is present (or being
        written). Stops before the first block that needs more than free room (eviction, a slower
        tier) or whose tenant's quota might refuse it: ``reserve`` takes that one. Charged alike."""
        tier, quotas, entries = self.tiers[t], self.quotas, self.index.entries
        nbytes, nsid, tenant = ns.block_bytes, ns.id, ns.tenant
        quota = quotas.limits.get(tenant)
        try:
            need = tier.footprint(nbytes)
        except BlockTooLarge:
            return []
        with self.lock:
            room = tier.free_bytes_for(nsid) // need   # blocks that fit without evicting
            if quota is not None:
                room = min(room, max(0, quota - quotas.charged[tenant]) // nbytes)
            plan: list[Entry | None] = []   # per block: its new entry, or None (present)
            new: list[Entry] = []   # indexed (invisible) as made, before their room: a slot tier keeps slots in them
            copy = self._plain(t, nbytes, 0)   # each new copy: raw, in tier ``t``, no record of its own
            before = None   # the block before this one, where it is new in this run
            allocated = 0
            try:
                for k in range(start, min(len(hashes), start + limit)):
                    key = nsid + hashes[k]
                    present = entries.get(key)
                    if present is not None:   # stored, or earlier in this run
                        if present.doomed:
                            break   # ``reserve`` waits for its last reader
                        plan.append(None)
                        before = None
                        continue
                    if len(new) == room:
                        break
                    parent_key = parents[k]
                    if before is not None and parent_key is hashes[k - 1]:   # a chain: the parent is that block
                        parent_key = before.key
                    elif parent_key is not None:   # the parent's own key object where it is held (shared_parent_key)
                        parent_key = nsid + parent_key
                        parent = entries.get(parent_key)
                        if parent is not None:
                            parent_key = parent.key
                    entry = before = entries[key] = Entry(key, parent_key, nbytes, CHARGED, copy)
                    new.append(entry)
                    plan.append(entry)
                allocated = tier.allocate_keys([entry.key for entry in new], nbytes)
            finally:
                for entry in new[allocated:]:   # the tier refused one: the run ends before it
                    del entries[entry.key]
            if allocated < len(new):
                plan = plan[:plan.index(new[allocated])]
            quotas.charge(tenant, allocated * nbytes)
            quotas.charges(nsid, tenant)
        return plan

    def wait_out_doomed(self, key: bytes) -> None:
        """A put of a block deleted while a reader still pins it must not be answered "exists":
        the doomed copy is freed on that reader's last unpin and the new block would be lost.
        Wait (lock released) until it is freed: a reader mid-get lets go within milliseconds, an
        abandoned load lease when it expires. The wait is bounded by ``lease_seconds`` + 1 s (the
        lease plus the daemon's expiry tick) and ``DOOMED_WAIT_MAX_S``; ``BlockBusy`` (counted,
        retryable) past it or when ``DOOMED_WAITERS`` puts already wait. Takes the lock itself."""
        with self.lock:
            entry = self.index.entries.get(key)
            if entry is None or not entry.doomed:
                return
        if not self._doomed_waiters.acquire(blocking=False):
            self.count("put_rejected_busy")
            raise BlockBusy(key)
        try:
            deadline = time.monotonic() + min(self.config.lease_seconds + 1.0, DOOMED_WAIT_MAX_S)
            while time.monotonic() < deadline:
                time.sleep(DOOMED_POLL_S)
                with self.lock:
                    entry = self.index.entries.get(key)
                    if entry is None or not entry.doomed:
                        self.counters["put_waited_for_delete"] += 1
                        return
            # reserve re-checks under its lock and refuses (counted) if the block is still doomed
        finally:
            self._doomed_waiters.release()

    def publish_run(self, entries: Sequence[Entry], payloads: Sequence) -> list[int]:
        """Make written entries visible, in order, each in its fastest tier, under one lock
        acquisition (``BlockIndex.show_run``, ``Listeners.added_run``), after writing those of one
        tier through to the durable tier together if configured (``write_through``:
        ``copy_out_many`` of ``payloads``, outside the lock, as nobody else touches an invisible
        entry; not synced, the caller's ``sync_durable`` commits the batch). Returns the positions
        of those with a durable copy, which the caller reports as "persisted" after
        ``sync_durable``. Takes the lock itself."""
        d = self.durable_index
        if d is None:
            durable = []
        else:
            todo = [k for k, e in enumerate(entries) if d not in e.copies] if self.config.write_through else []
            for src in sorted({entries[k].fastest for k in todo}):
                ks = [k for k in todo if entries[k].fastest == src]
                done = self.copy_out_many([entries[k] for k in ks], src, d, [(payloads[k], None) for k in ks])
                if done.count(COPIED) < len(ks):
                    self.count("write_through_failures", len(ks) - done.count(COPIED))
            durable = [k for k, e in enumerate(entries) if d in e.copies]
        with self.lock:   # the policies and chains learn of each in turn, then the listeners
            nbytes = self.index.show_run(entries)
            self.listeners.added_run(entries)
            self.counters["puts"] += len(entries)
            self.counters["bytes_in"] += nbytes
        return durable

    def sync_durable(self) -> bool:
        """Make a batch of durable writes durable: the payloads were written without an fsync
        each (group commit), so one flush of each file written covers them all;
        False (counted) if it failed, and the batch is then reported "stored", not "persisted"."""
        try:
            self.tiers[self.durable_index].sync()  # type: ignore[index]
            return True
        except TierIOError:
            self.counters["sync_failures"] += 1
            return False

    # -- making room -----------------------------------------------------------------------------

    def make_room(self, t: int, nbytes: int, namespace_id: bytes) -> None:
        """Evict from tier ``t`` until ``nbytes`` more of ``namespace_id`` fit (where the tier
        splits its room by tenant, evictions go on until one of the tenant's segments has room or
        a segment empties: the victims are demoted, not lost). No I/O: a victim whose demotion
        would be a disk or network write raises ``RoomNotReady`` (``clear_room`` writes it down
        without the lock). Caller holds the lock."""
        tier = self.tiers[t]
        need = tier.footprint(nbytes)
        while tier.free_bytes_for(namespace_id) < need:
            victim = self.index.policies[t].pick_victim(self.is_pinned)
            if victim is None:
                raise TierFull(f"{tier.name} tier is full and every block in it is pinned")
            self.evict_copy(t, victim)

    def evict_copy(self, t: int, key: bytes) -> None:
        entry = self.index.entries[key]
        lower = [i for i in entry.copies if i > t]
        if not lower and t + 1 < len(self.tiers):
            if self.transfers.writes_down_slowly(t):
                raise RoomNotReady(t, f"{self.tiers[t].name} tier: its victim must be written down first")
            try:   # a memory-to-memory copy (GPU into CPU): room first, as it may reuse the scratch buffer
                self.make_room(t + 1, entry.copies[t].stored_size, entry.namespace_id)
                self.store_copy(entry, t + 1, self.read_copy(entry, t), entry.copies[t], downward=True)
                self.counters["demotions"] += 1
            except RoomNotReady:
                raise
            except PLACEMENT_ERRORS:
                self.counters["demotion_failures"] += 1
        self.drop_copy(entry, t)
        if not len(entry.copies):
            self.counters["evictions"] += 1

    def evicts_whole(self, entry: Entry, t: int) -> bool:
        """Whether evicting ``entry`` from tier ``t`` drops the block: its one copy is there, the last tier."""
        return t + 1 == len(self.tiers) and len(entry.copies) == 1

    def evict_entries(self, entries: Sequence[Entry]) -> None:
        """``evict_copy`` of victims that ``evicts_whole``, together (``drop_entries``). Caller holds the lock."""
        self.drop_entries(entries)
        self.counters["evictions"] += len(entries)

    def promotion_target(self, t: int) -> int:
        """The tier a hit on tier ``t`` is copied up to: the CPU tier when it is faster, else the first."""
        return self.cpu_index if self.cpu_index is not None and self.cpu_index < t else 0

    def prepare_promotion(self, entry: Entry, t: int, payload, decoded) -> bool:
        """Before a hit on a slower tier ``t`` is delivered, outside the lock: room in the memory
        tier it is copied up to (``clear_room``), and True, leaving the copy to ``promote`` under
        the lock; or, where that tier is not memory (a store without one), the whole copy
        (``copy_out``) and False."""
        target = self.promotion_target(t)
        if self.tiers[target].in_memory:
            try:
                need = self.tiers[target].footprint(entry.raw_size)
            except BlockTooLarge:
                need = 0
            self.clear_room(target, need, entry.namespace_id)
            return True
        if target not in entry.copies:
            done = self.copy_out(entry, t, target, payload, decoded)
            self.count("promotions" if done == COPIED else "promotion_failures")
        return False

    def promote(self, entry: Entry, t: int, payload: np.ndarray, decoded: np.ndarray | None = None) -> None:
        """Copy a block just read from tier ``t`` into a faster memory tier (see
        ``prepare_promotion``). ``payload``: its copy's stored bytes; ``decoded``: its raw bytes
        when the reader decoded them already. Caller holds the lock."""
        target = self.promotion_target(t)
        if target in entry.copies:
            return
        try:
            self.store_copy(entry, target, payload, entry.copies[t], decoded=decoded)
            self.counters["promotions"] += 1
        except PLACEMENT_ERRORS:
            self.counters["promotion_failures"] += 1

    # -- copies ----------------------------------------------------------------------------------

    def read_copy(self, entry: Entry, t: int, scratch: Scratch | None = None) -> np.ndarray:
        """The bytes of one copy, zero-copy when the tier can give a single view. May return the
        thread's buffer of ``scratch`` (the cascade's own by default): make room in the destination
        *before* calling this, since making room can demote another block through the cascade's
        scratch buffer."""
        tier = self.tiers[t]
        record = entry.copies[t]
        if isinstance(tier, CpuTier):
            views = tier.view(entry.key)
            if len(views) == 1:
                return views[0]
        out = (scratch or self._scratch).get(record.stored_size)
        return out[:tier.read_into(entry.key, out)]

    def store_copy(self, entry: Entry, t: int, data, like: BlockRecord, downward: bool = False,
                   decoded=None) -> None:
        """Place a copy of ``data`` (a payload encoded as ``like`` says) in memory tier ``t``,
        evicting there first; ``downward``/``decoded`` as in ``Transcoder.place``. A memory copy
        under the lock: a copy into a disk or network tier goes through ``copy_out``. Caller holds
        the lock."""
        assert self.tiers[t].in_memory, "a disk or network write under the store lock"
        placed = self.transcoder.place(entry.namespace_id, entry.raw_size, t, like, data,
                                       downward=downward, decoded=decoded)
        record, data = placed.record, placed.payload
        self.make_room(t, record.stored_size, entry.namespace_id)
        self.tiers[t].allocate(record)
        try:
            self.tiers[t].write(record, data)
        except Exception:
            self.tiers[t].drop(record.key)
            raise
        self.add_copy(entry, t, placed)

    def add_copy(self, entry: Entry, t: int, placed) -> None:
        """Record the copy ``placed`` (``Transcoder.place``) just written into tier ``t``. Caller
        holds the lock."""
        entry.copies[t] = placed.record
        self.transcoder.count(t, placed, entry.raw_size)
        self.index.track_copy(entry, t)
        self.copies_changed(entry)

    def copies_changed(self, entry: Entry) -> None:
        self.index.copies_changed(entry)
        if entry.visible:
            self.listeners.moved(entry.namespace_id, entry.block_hash, entry.fastest)

    def encode_reserved(self, entry: Entry, t: int, data, like: BlockRecord | None = None) -> object:
        """Give a reserved, not yet visible block whose bytes ``data`` were written into tier ``t``
        in place (a same-host writer's slots) the form tier ``t`` stores: re-allocated smaller when
        encoded, the rest of its room freed. ``like``: what ``data`` is when the writer encoded it
        itself (codec, size; ``data`` then must not be a view of the slots); None: the raw block.
        Returns the payload it now holds. The encoding runs outside the lock: nobody else touches
        an invisible entry."""
        like = entry.copies[t] if like is None else like
        placed = self.transcoder.place(entry.namespace_id, entry.raw_size, t, like, data)
        rewrite = placed.record.codec != 0 or like.codec != 0   # the slots do not hold this form yet
        with self.lock:
            if placed.record.codec != 0:
                self.tiers[t].drop(entry.key)
                self.tiers[t].allocate(placed.record)   # fits: it is smaller than what was freed
                entry.copies[t] = placed.record
            self.transcoder.count(t, placed, entry.raw_size)
        if rewrite:
            try:
                self.tiers[t].write(entry.copies[t], placed.payload)
            except Exception:
                with self.lock:
                    self.drop_entry(entry)
                raise
        return placed.payload

    def drop_copy(self, entry: Entry, t: int) -> None:
        if len(entry.copies) == 1 and t in entry.copies:   # its last: the block leaves
            self.drop_entries((entry,))
            return
        self.tiers[t].drop(entry.key)
        self.index.policies[t].remove(entry.key)
        del entry.copies[t]
        self.copies_changed(entry)

    def discard_corrupt_copy(self, entry: Entry, t: int) -> None:
        """Forget a copy that failed its checksum or decode (a miss, counted)."""
        self.counters["corrupt_dropped"] += 1
        self.drop_copy(entry, t)   # a durable tier drops corrupt copies itself; codecs do not

    def drop_entry(self, entry: Entry) -> None:
        self.drop_entries((entry,))

    def drop_entries(self, entries: Sequence[Entry]) -> None:
        """Drop each of ``entries`` (indexed, each once) with every copy, together: each tier's
        copies and each policy's keys at once, the index told once (``BlockIndex.forget_many``),
        the listeners once per namespace, the quotas released. Caller holds the lock."""
        by_tier: dict[int, list[bytes]] = {}
        for entry in entries:
            for t in entry.copies:
                by_tier.setdefault(t, []).append(entry.key)
        for t, keys in by_tier.items():
            self.tiers[t].drop_many(keys)
            self.index.policies[t].remove_many(keys)
        for entry in entries:
            entry.copies.clear()
            if entry.slot is not None:   # CPU room taken for a copy still being written: kept by key
                self.tiers[self.cpu_index].let_go(entry.key, entry)
        self.listeners.removed(self.index.forget_many(entries))
        for entry in entries:
            self._uncharge(entry)

    def delete(self, entries: Sequence[Entry]) -> None:
        """Delete blocks (visible, each once): each dropped now, or, while a reader pins it,
        *doomed*: invisible, uncounted and announced as removed now, freed on its last unpin."""
        self.drop_entries([entry for entry in entries if not entry.pins])
        doomed = [entry for entry in entries if entry.pins]
        self.listeners.removed(doomed)
        for entry in doomed:
            entry.doomed = True
            entry.ready = False
            self.index.namespace_bytes[entry.namespace_id] -= entry.raw_size
            self._uncharge(entry)

    def _uncharge(self, entry: Entry) -> None:
        if entry.charged:
            self.quotas.release_block(entry.namespace_id, entry.raw_size)
            entry.charged = False

