"""The store engine: the tier cascade behind put / get / lookup / delete, with pins and leases.

Tiers are ordered fastest first (GPU, CPU, NVMe). A block may have a copy in several tiers (the
NVMe copy stays when a block is promoted, so demoting it again is free); reads come from the
fastest copy. When a tier is full its policy names a victim, which is *demoted* to the next tier
(write-back) or dropped if it has no lower tier. With ``write_through`` a put also lands on the
durable tier before it is acknowledged as persisted.

Two-phase operations (same-host zero-copy, and every read):

* ``prepare_store`` reserves slots in the CPU arena and returns where to write; the block is
  invisible until ``complete_store`` makes it visible (or ``abort_store`` / lease expiry frees it).
* ``prepare_load`` makes sure the blocks have a CPU copy and pins them under a lease; the client
  copies out of the arena and calls ``complete_load``. A lease that is never completed expires,
  so a crashed client cannot leak pins or slots.
* ``lookup`` pins what it reports for ``lease_seconds``, so the get that follows never races an
  eviction.

Locking: one lock guards the index, policies and accounting. Payload copies to and from RAM run
outside it, under a pin. Demotion to NVMe currently runs under the lock (simple and safe; it
stalls other requests for the duration of one disk write).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import mmap
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.errors import (BlockCorrupt, CodecError, BlockTooLarge, InvalidArgument, LeaseExpired, StoreFull,
                            TierFull, TierIOError, UnknownNamespace, WrongBlockSize)
from kvstore.keys import Namespace, block_key, check_block_hash
from kvstore.wire import MAX_BATCH, Lookup
from kvstore.store.policy import EvictionPolicy, make_policy
from kvstore.tiers.base import BlockRecord, Tier
from kvstore.buffers import as_bytes
from kvstore.tiers.cpu import CpuTier



@dataclasses.dataclass
class Entry:
    """The index's view of one block: where its copies are and who holds it."""

    namespace_id: bytes
    block_hash: bytes
    parent_hash: bytes | None
    raw_size: int
    copies: dict[int, BlockRecord] = dataclasses.field(default_factory=dict)  # tier index -> record
    ready: bool = False          # visible to lookups and gets
    pins: int = 0                # explicit pins (in-flight reads, leases)
    pinned_until: float = 0.0    # lookup lease
    doomed: bool = False         # deleted while pinned: freed on last unpin
    children: set[bytes] = dataclasses.field(default_factory=set)  # keys of visible children
    linked: bool = False         # listed in its parent's ``children``

    @property
    def key(self) -> bytes:
        return block_key(self.namespace_id, self.block_hash)

    @property
    def fastest(self) -> int:
        return min(self.copies)


@dataclasses.dataclass
class Lease:
    """A two-phase operation in flight: pinned (load) or reserved (store) blocks."""

    id: int
    kind: str                     # "load" | "store"
    keys: list[bytes]
    expires: float
    extents: list[list[tuple[int, int]] | None]


class StoreListener:
    """Told when blocks appear in or leave the store (the fleet directory publishes from this).
    Called with the store lock held: implementations must only enqueue, never block."""

    def blocks_added(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        pass

    def blocks_removed(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        pass


@dataclasses.dataclass
class StoreConfig:
    eviction_policy: str = "prefix"
    write_through: bool = False
    promote_on_hit: bool = True
    lease_seconds: float = 5.0
    #: tier name -> codec name (kvstore.codecs); absent = raw. Blocks are transcoded when they
    #: move into a tier (demotion, write-through, flush, promotion) and decoded on every read.
    tier_codecs: dict[str, str] = dataclasses.field(default_factory=dict)


class Store:
    def __init__(self, tiers: Sequence[Tier], config: StoreConfig | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``clock`` measures leases; the sizing planner passes trace time."""
        if not tiers:
            raise ValueError("a store needs at least one tier")
        self.tiers = list(tiers)
        self.config = config or StoreConfig()
        self.policies: list[EvictionPolicy] = [make_policy(self.config.eviction_policy) for _ in self.tiers]
        self._lock = threading.RLock()
        self._index: dict[bytes, Entry] = {}
        self._namespaces: dict[bytes, Namespace] = {}
        self._ns_bytes: dict[bytes, int] = defaultdict(int)
        self._leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self.counters: dict[str, int] = defaultdict(int)
        self.listeners: list[StoreListener] = []
        self.durable_index = next((i for i, t in enumerate(self.tiers) if t.durable), None)
        self.cpu_index = next((i for i, t in enumerate(self.tiers) if isinstance(t, CpuTier)), None)
        self._scratch = threading.local()
        self._clock = clock
        self._codec_choice: dict[tuple[int, bytes], str] = {}
        self._load_namespaces()
        self._recover()

    # -- namespaces ------------------------------------------------------------------------------

    def _namespace_file(self) -> str | None:
        if self.durable_index is None:
            return None
        return os.path.join(getattr(self.tiers[self.durable_index], "path"), "namespaces.json")

    def _load_namespaces(self) -> None:
        path = self._namespace_file()
        if path and os.path.exists(path):
            with open(path) as f:
                for d in json.load(f):
                    ns = Namespace.from_dict(d)
                    self._namespaces[ns.id] = ns

    def _save_namespaces(self) -> None:
        path = self._namespace_file()
        if not path:
            return
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump([ns.to_dict() for ns in self._namespaces.values()], f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, path)
        dfd = os.open(os.path.dirname(path), os.O_RDONLY)  # the rename itself must survive a crash
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def register_namespace(self, ns: Namespace) -> bytes:
        """Idempotent: the id is a digest of the namespace, so equal layouts get equal ids."""
        biggest = max(t.capacity_bytes for t in self.tiers)
        if ns.block_bytes > biggest:
            raise BlockTooLarge(f"layout.block_bytes: {ns.block_bytes}-byte blocks exceed every tier "
                                f"(largest {biggest} bytes)")
        with self._lock:
            if ns.id not in self._namespaces:
                self._namespaces[ns.id] = ns
                try:
                    self._save_namespaces()
                except OSError as e:
                    self.counters["namespace_persist_errors"] += 1
                    del self._namespaces[ns.id]
                    raise TierIOError(f"cannot persist namespace registry: {e.strerror}") from e
        return ns.id

    def namespace(self, namespace_id: bytes) -> Namespace:
        try:
            return self._namespaces[namespace_id]
        except KeyError:
            raise UnknownNamespace(namespace_id) from None

    def namespaces(self) -> list[Namespace]:
        return list(self._namespaces.values())

    def namespace_bytes(self, namespace_id: bytes) -> int:
        return self._ns_bytes.get(namespace_id, 0)

    # -- recovery --------------------------------------------------------------------------------

    def _recover(self) -> None:
        """Rebuild the index from durable tiers, then the chain links, then the policies."""
        for t, tier in enumerate(self.tiers):
            for record in tier.recover():
                entry = self._index.get(record.key)
                if entry is None:
                    entry = Entry(record.namespace_id, record.block_hash, record.parent_hash,
                                  record.raw_size, ready=True)
                    self._index[record.key] = entry
                    self._ns_bytes[record.namespace_id] += record.raw_size
                entry.copies[t] = record
                self.counters["recovered_blocks"] += 1
        for entry in self._index.values():
            self._link(entry)
        for entry in self._index.values():
            for t in entry.copies:
                self.policies[t].insert(entry.key, *self._chain_state(entry, t))

    # -- helpers ---------------------------------------------------------------------------------

    def _parent(self, entry: Entry) -> Entry | None:
        if entry.parent_hash is None:
            return None
        return self._index.get(block_key(entry.namespace_id, entry.parent_hash))

    def _link(self, entry: Entry) -> None:
        """List a newly visible block in its parent (a parent with children is not a leaf)."""
        parent = self._parent(entry)
        if parent is not None and not entry.linked:
            entry.linked = True
            parent.children.add(entry.key)
            self._refresh_policies(parent)

    def _unlink(self, entry: Entry) -> None:
        parent = self._parent(entry)
        if entry.linked and parent is not None:
            parent.children.discard(entry.key)
            self._refresh_policies(parent)
        entry.linked = False

    def _chain_state(self, entry: Entry, t: int) -> tuple[int, bool]:
        """What the prefix-aware policy of tier ``t`` needs: how many children have a copy in tier
        ``t`` or faster, and whether the parent has none there (the prefix is broken in ``t``)."""
        kids = 0
        for child_key in entry.children:
            child = self._index.get(child_key)
            if child is not None and child.copies and child.fastest <= t:
                kids += 1
        if entry.parent_hash is None:
            return kids, False
        parent = self._parent(entry)
        return kids, parent is None or not parent.copies or parent.fastest > t

    def _refresh_policies(self, entry: Entry) -> None:
        for t in entry.copies:
            self.policies[t].update(entry.key, *self._chain_state(entry, t))

    def _copies_changed(self, entry: Entry) -> None:
        """``entry`` gained or lost a copy: its parent's children and its children's prefix, as
        each tier sees them, may have changed."""
        parent = self._parent(entry)
        if parent is not None and entry.linked:
            self._refresh_policies(parent)
        for child_key in entry.children:
            child = self._index.get(child_key)
            if child is not None:
                self._refresh_policies(child)

    def _is_pinned(self, key: bytes) -> bool:
        e = self._index.get(key)
        return e is not None and (e.pins > 0 or not e.ready or e.pinned_until > self._clock())

    def _check_batch(self, namespace_id: bytes, hashes: Sequence[bytes]) -> Namespace:
        ns = self.namespace(namespace_id)
        if len(hashes) > MAX_BATCH:
            raise InvalidArgument("hashes", f"{len(hashes)} blocks in one call; at most {MAX_BATCH}")
        for h in hashes:
            check_block_hash(h)
        return ns

    def _scratch_buffer(self, nbytes: int) -> np.ndarray:
        buf = getattr(self._scratch, "buf", None)
        if buf is None or buf.nbytes < nbytes:
            # page-aligned and touched once, so the NVMe tier can read into it with O_DIRECT
            buf = np.frombuffer(mmap.mmap(-1, -(-max(nbytes, 1 << 20) // mmap.PAGESIZE) * mmap.PAGESIZE),
                                dtype=np.uint8)
            buf[::mmap.PAGESIZE] = 0
            self._scratch.buf = buf
        return buf[:nbytes]

    # -- making room -----------------------------------------------------------------------------

    def _make_room(self, t: int, nbytes: int) -> None:
        """Evict from tier ``t`` until ``nbytes`` more fit. Caller holds the lock."""
        tier = self.tiers[t]
        need = tier.footprint(nbytes)
        while tier.free_bytes < need:
            victim = self.policies[t].pick_victim(self._is_pinned)
            if victim is None:
                raise TierFull(f"{tier.name} tier is full and every block in it is pinned")
            self._evict_copy(t, victim)

    def _evict_copy(self, t: int, key: bytes) -> None:
        entry = self._index[key]
        lower = [i for i in entry.copies if i > t]
        if not lower and t + 1 < len(self.tiers):
            try:
                self._demote(entry, t, t + 1)
                self.counters["demotions"] += 1
            except (TierFull, TierIOError, BlockTooLarge):
                self.counters["demotion_failures"] += 1
        self._drop_copy(entry, t)
        if not entry.copies:
            self.counters["evictions"] += 1

    def _demote(self, entry: Entry, src: int, dst: int) -> None:
        record = entry.copies[src]
        self._make_room(dst, record.stored_size)  # first: making room may reuse the scratch buffer
        data = self._read_copy(entry, src)
        # a demoted block was never acknowledged as persisted: its directory entry may wait for
        # the next sync (a crash before then loses it, a miss; it is never torn)
        self._store_copy(entry, dst, data, record, sync=False)

    def _read_copy(self, entry: Entry, t: int) -> np.ndarray:
        """The bytes of one copy, zero-copy when the tier can give a single view. May return the
        thread's scratch buffer: make room in the destination *before* calling this, since making
        room can demote another block through the same scratch buffer."""
        tier = self.tiers[t]
        record = entry.copies[t]
        if isinstance(tier, CpuTier):
            views = tier.view(entry.key)
            if len(views) == 1:
                return views[0]
        out = self._scratch_buffer(record.stored_size)
        tier.read_into(entry.key, out)
        return out

    def _store_copy(self, entry: Entry, t: int, data, like: BlockRecord, sync: bool = True) -> None:
        """Place a copy of ``data`` in tier ``t``, evicting there first. Caller holds the lock.
        ``sync=False`` leaves a durable tier's directory entry to the caller's ``sync()``."""
        record, data = self._transcode(entry, t, like, data)
        self._make_room(t, record.stored_size)
        self.tiers[t].allocate(record)
        try:
            if sync:
                self.tiers[t].write(record, data)
            else:
                self.tiers[t].write_unsynced(record, data)
        except Exception:
            self.tiers[t].drop(record.key)
            raise
        entry.copies[t] = record
        self.policies[t].insert(entry.key, *self._chain_state(entry, t))
        self._copies_changed(entry)

    # -- codecs ----------------------------------------------------------------------------------

    def _codec_for(self, t: int, namespace_id: bytes) -> str:
        """The codec tier ``t`` stores this namespace's blocks with: its configured codec if the
        codec can interpret the namespace's layout, else raw (decided once per namespace)."""
        name = self.config.tier_codecs.get(self.tiers[t].name, "raw")
        if name == "raw":
            return name
        key = (t, namespace_id)
        if key not in self._codec_choice:
            from kvstore import codecs
            ns = self._namespaces.get(namespace_id)
            try:
                if ns is None:
                    raise KeyError(namespace_id)
                codecs.check_layout(name, ns.layout)
                self._codec_choice[key] = name
            except (KeyError, CodecError):
                self._codec_choice[key] = "raw"
                self.counters["codec_layout_refusals"] += 1
        return self._codec_choice[key]

    def _decode(self, entry: Entry, record: BlockRecord, payload, out=None) -> np.ndarray:
        """Raw block bytes of an encoded copy (into ``out`` when given)."""
        from kvstore import codecs
        layout = self.namespace(entry.namespace_id).layout
        dst = np.empty(entry.raw_size, dtype=np.uint8) if out is None else out[:entry.raw_size]
        codecs.decode_block(record.codec, payload, layout, out=dst)
        return dst

    def _transcode(self, entry: Entry, t: int, like: BlockRecord, data) -> tuple[BlockRecord, object]:
        """The record and payload a copy of ``data`` (encoded as ``like`` says) gets in tier ``t``."""
        want = self._codec_for(t, entry.namespace_id)
        from_codec = like.codec
        if want == "raw" and from_codec == 0:
            return dataclasses.replace(like), data
        from kvstore import codecs
        if from_codec != 0:
            if codecs.CODEC_IDS.get(want) == from_codec:
                return dataclasses.replace(like), data
            data = self._decode(entry, like, as_bytes(data)[:like.stored_size])
        raw = dataclasses.replace(like, codec=0, stored_size=entry.raw_size, checksum=0)
        if want == "raw":
            return raw, data
        try:
            codec_id, payload = codecs.encode_block(want, data, self.namespace(entry.namespace_id).layout)
        except CodecError:
            self.counters["codec_fallbacks_raw"] += 1  # NaN/Inf or similar: keep the exact bytes
            return raw, data
        if payload.nbytes >= entry.raw_size:
            return raw, data
        self.counters[f"encoded_{want}"] += 1
        return dataclasses.replace(raw, codec=codec_id, stored_size=payload.nbytes), payload

    def _drop_copy(self, entry: Entry, t: int) -> None:
        self.tiers[t].drop(entry.key)
        self.policies[t].remove(entry.key)
        del entry.copies[t]
        if entry.copies:
            self._copies_changed(entry)
        else:
            self._forget(entry)

    def _forget(self, entry: Entry) -> None:
        if self._index.get(entry.key) is entry:
            self._unlink(entry)
            del self._index[entry.key]
            if entry.ready or entry.doomed:  # only blocks that were announced as added
                for listener in self.listeners:
                    listener.blocks_removed(entry.namespace_id, [entry.block_hash])
            if entry.ready:
                self._ns_bytes[entry.namespace_id] -= entry.raw_size
            self._copies_changed(entry)  # its children just lost their prefix

    def _drop_entry(self, entry: Entry) -> None:
        for t in list(entry.copies):
            self._drop_copy(entry, t)
        self._forget(entry)

    # -- put -------------------------------------------------------------------------------------

    def put(self, namespace_id: bytes, hashes: Sequence[bytes], payloads: Sequence,
            parent: bytes | None = None) -> list[str]:
        """Store a chain of blocks (``payloads[i]``'s parent is ``hashes[i-1]``, the first's is
        ``parent``). Returns per block ``"stored"``, ``"exists"`` or ``"persisted"`` (stored and on
        the durable tier). Raises ``StoreFull`` if a block fits nowhere; blocks before it stay."""
        ns = self._check_batch(namespace_id, hashes)
        if len(payloads) != len(hashes):
            raise InvalidArgument("blocks", f"{len(payloads)} payloads for {len(hashes)} hashes")
        arrays = [as_bytes(p) for p in payloads]
        for i, a in enumerate(arrays):
            if a.nbytes != ns.block_bytes:
                raise WrongBlockSize(ns.block_bytes, a.nbytes, i)
        results: list[str] = []
        on_durable: list[int] = []  # indices of blocks written to the durable tier, not yet synced
        parents = [parent] + list(hashes[:-1])
        try:
            for h, p, data in zip(hashes, parents, arrays):
                entry = self._reserve(namespace_id, h, p, ns.block_bytes, 0)
                if entry is None:
                    results.append("exists")
                    continue
                t = entry.fastest
                try:
                    self.tiers[t].write_unsynced(entry.copies[t], data)
                except Exception:
                    with self._lock:
                        self._drop_entry(entry)
                    raise
                results.append("stored")
                if self._publish(entry, data):
                    on_durable.append(len(results) - 1)
        finally:
            # blocks written before a failure stay; one directory sync covers the whole batch
            if on_durable and self._sync_durable():
                for i in on_durable:
                    results[i] = "persisted"
        return results

    def _reserve(self, namespace_id: bytes, h: bytes, parent: bytes | None, nbytes: int,
                 t: int, only_this_tier: bool = False) -> Entry | None:
        """Allocate an invisible entry with room in tier ``t`` or, when it cannot make room, the
        next tier down (None if the block exists or is being written)."""
        key = block_key(namespace_id, h)
        with self._lock:
            if key in self._index:  # present, or being written by someone else
                return None
            record = BlockRecord(namespace_id, h, parent, nbytes, nbytes)
            entry = Entry(namespace_id, h, parent, nbytes)
            while True:
                try:
                    self._make_room(t, nbytes)
                    self.tiers[t].allocate(record)
                    break
                except (TierFull, BlockTooLarge) as e:
                    if t + 1 < len(self.tiers) and not only_this_tier:
                        t += 1
                        continue
                    self.counters["put_rejected_full"] += 1
                    raise StoreFull(f"no tier can take a {nbytes}-byte block: {e}") from e
            entry.copies[t] = record
            self._index[key] = entry
            return entry

    def _publish(self, entry: Entry, data) -> bool:
        """Make a written entry visible; write through to the durable tier if configured. Returns
        whether it has a durable copy, which the caller reports as "persisted" after ``_sync_durable``."""
        with self._lock:
            t = entry.fastest
            self.policies[t].insert(entry.key, *self._chain_state(entry, t))
            entry.ready = True
            self._link(entry)
            for listener in self.listeners:
                listener.blocks_added(entry.namespace_id, [entry.block_hash])
            self._ns_bytes[entry.namespace_id] += entry.raw_size
            self.counters["puts"] += 1
            self.counters["bytes_in"] += entry.raw_size
            d = self.durable_index
            if d is not None and d in entry.copies:
                return True
            if d is not None and self.config.write_through:
                try:
                    self._store_copy(entry, d, data, entry.copies[t], sync=False)
                    return True
                except (TierFull, TierIOError, BlockTooLarge):
                    self.counters["write_through_failures"] += 1
        return False

    def _sync_durable(self) -> bool:
        """One directory sync for a batch of durable writes; False (counted) if it failed."""
        try:
            self.tiers[self.durable_index].sync()  # type: ignore[index]
            return True
        except TierIOError:
            self.counters["sync_failures"] += 1
            return False

    # -- two-phase store (zero-copy writers) -----------------------------------------------------

    def prepare_store(self, namespace_id: bytes, hashes: Sequence[bytes],
                      parent: bytes | None = None) -> Lease:
        """Reserve CPU-arena slots for the blocks not yet stored; ``extents[i]`` is None for those
        already present. The writer fills the slots, then calls ``complete_store``."""
        ns = self._check_batch(namespace_id, hashes)
        if self.cpu_index is None:
            raise InvalidArgument("transport", "this daemon has no CPU tier to share")
        cpu: CpuTier = self.tiers[self.cpu_index]  # type: ignore[assignment]
        keys, extents = [], []
        parents = [parent] + list(hashes[:-1])
        try:
            for h, p in zip(hashes, parents):
                entry = self._reserve(namespace_id, h, p, ns.block_bytes, self.cpu_index,
                                      only_this_tier=True)
                if entry is None:
                    keys.append(block_key(namespace_id, h))
                    extents.append(None)
                    continue
                keys.append(entry.key)
                extents.append(cpu.extents(entry.key))
        except Exception:
            self._release_reservations([k for k, x in zip(keys, extents) if x is not None])
            raise
        return self._new_lease("store", keys, extents)

    def complete_store(self, lease_id: int) -> list[str]:
        lease = self._take_lease(lease_id, "store")
        results = []
        on_durable = []
        for key, ext in zip(lease.keys, lease.extents):
            entry = self._index.get(key) if ext is not None else None
            if entry is None or entry.ready:
                results.append("exists")
                continue
            data = self.tiers[self.cpu_index].view(key)  # type: ignore[attr-defined]
            payload = data[0] if len(data) == 1 else np.concatenate(data)
            results.append("stored")
            if self._publish(entry, payload):
                on_durable.append(len(results) - 1)
        if on_durable and self._sync_durable():
            for i in on_durable:
                results[i] = "persisted"
        return results

    def abort_store(self, lease_id: int) -> None:
        lease = self._take_lease(lease_id, "store")
        self._release_reservations([k for k, x in zip(lease.keys, lease.extents) if x is not None])

    def _release_reservations(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                entry = self._index.get(key)
                if entry is not None and not entry.ready:
                    self._drop_entry(entry)

    # -- reads -----------------------------------------------------------------------------------

    def lookup(self, namespace_id: bytes, hashes: Sequence[bytes], lease: bool = True) -> Lookup:
        """How many leading blocks of the chain are present, and in which tier; pins them."""
        self._check_batch(namespace_id, hashes)
        tiers = []
        until = self._clock() + self.config.lease_seconds
        with self._lock:
            for h in hashes:
                entry = self._index.get(block_key(namespace_id, h))
                if entry is None or not entry.ready or entry.doomed:
                    break
                if lease:
                    entry.pinned_until = max(entry.pinned_until, until)
                tiers.append(self.tiers[entry.fastest].name)
            self.counters["lookups"] += 1
        return Lookup(len(tiers), tiers)

    def contains(self, namespace_id: bytes, hashes: Sequence[bytes]) -> list[bool]:
        self._check_batch(namespace_id, hashes)
        with self._lock:
            return [(e := self._index.get(block_key(namespace_id, h))) is not None and e.ready
                    and not e.doomed for h in hashes]

    def _pin(self, namespace_id: bytes, h: bytes) -> Entry | None:
        entry = self._index.get(block_key(namespace_id, h))
        if entry is None or not entry.ready or entry.doomed:
            return None
        entry.pins += 1
        return entry

    def _unpin(self, entry: Entry) -> None:
        entry.pins -= 1
        if entry.pins == 0 and entry.doomed:
            self._drop_entry(entry)

    def get_into(self, namespace_id: bytes, hashes: Sequence[bytes], outs: Sequence) -> list[int | None]:
        """Copy each block into ``outs[i]``; returns its size, or None for a miss (absent or
        corrupt: a corrupt copy is dropped, counted, and another copy tried)."""
        ns = self._check_batch(namespace_id, hashes)
        if len(outs) != len(hashes):
            raise InvalidArgument("outs", f"{len(outs)} buffers for {len(hashes)} hashes")
        sizes: list[int | None] = []
        for h, out in zip(hashes, outs):
            dst = as_bytes(out)
            if dst.nbytes < ns.block_bytes:
                raise InvalidArgument("outs", f"buffer of {dst.nbytes} bytes; blocks are {ns.block_bytes}")
            sizes.append(self._get_one(namespace_id, h, dst))
        return sizes

    def _get_one(self, namespace_id: bytes, h: bytes, dst: np.ndarray) -> int | None:
        while True:
            with self._lock:
                entry = self._pin(namespace_id, h)
                if entry is None:
                    self.counters["misses"] += 1
                    return None
                t = entry.fastest
            record = entry.copies[t]
            try:
                n = self.tiers[t].read_into(entry.key, dst)
                if record.codec != 0:
                    n = self._decode(entry, record, dst[:n].copy(), out=dst).nbytes
            except (BlockCorrupt, CodecError):
                with self._lock:
                    self._discard_corrupt_copy(entry, t)
                    self._unpin(entry)
                continue  # try the next copy, or report a miss
            with self._lock:
                self.counters[f"hits_{self.tiers[t].name}"] += 1
                self.counters["bytes_out"] += n
                self.policies[t].touch(entry.key)
                if t > 0 and self.config.promote_on_hit and not entry.doomed:
                    self._promote(entry, t, dst[:n])
                self._unpin(entry)
            return n

    def _promote(self, entry: Entry, t: int, data: np.ndarray) -> None:
        """Copy a block just read from tier ``t`` (``data``: its raw bytes) into a faster tier."""
        target = self.cpu_index if self.cpu_index is not None and self.cpu_index < t else 0
        if target in entry.copies:
            return
        raw = dataclasses.replace(entry.copies[t], codec=0, stored_size=entry.raw_size, checksum=0)
        try:
            self._store_copy(entry, target, data, raw)
            self.counters["promotions"] += 1
        except (TierFull, TierIOError, BlockTooLarge):
            self.counters["promotion_failures"] += 1

    def get(self, namespace_id: bytes, hashes: Sequence[bytes]) -> list[bytes | None]:
        ns = self.namespace(namespace_id)
        outs = [np.empty(ns.block_bytes, dtype=np.uint8) for _ in hashes]
        sizes = self.get_into(namespace_id, hashes, outs)
        return [None if n is None else o[:n].tobytes() for o, n in zip(outs, sizes)]

    # -- two-phase load (zero-copy readers) ------------------------------------------------------

    def prepare_load(self, namespace_id: bytes, hashes: Sequence[bytes]) -> Lease:
        """Pin the leading present blocks with a raw CPU copy each (promoting from NVMe if needed)
        and return their arena extents; stops at the first block it cannot stage that way (absent,
        no room, or encoded by a CPU-tier codec)."""
        self._check_batch(namespace_id, hashes)
        if self.cpu_index is None:
            raise InvalidArgument("transport", "this daemon has no CPU tier to share")
        c = self.cpu_index
        keys, extents = [], []
        for h in hashes:
            with self._lock:
                entry = self._pin(namespace_id, h)
                if entry is None:
                    self.counters["misses"] += 1  # a zero-copy reader's miss counts like get's
                    break
                if c not in entry.copies:
                    try:
                        src = entry.fastest
                        self._make_room(c, entry.copies[src].stored_size)  # before filling scratch
                        data = self._read_copy(entry, src)
                        self._store_copy(entry, c, data, entry.copies[src])
                    except BlockCorrupt:
                        self._discard_corrupt_copy(entry, src)
                        self._unpin(entry)
                        break
                    except (TierFull, TierIOError, BlockTooLarge):
                        self._unpin(entry)
                        break
                if entry.copies[c].codec != 0:
                    # an encoded arena copy (a CPU codec) is not the block's bytes: readers of the
                    # arena must not see it; the server reads such blocks through get_into instead
                    self._unpin(entry)
                    break
                self.policies[c].touch(entry.key)
                self.counters["hits_cpu"] += 1
                keys.append(entry.key)
                extents.append(self.tiers[c].extents(entry.key))
        return self._new_lease("load", keys, extents)

    def _discard_corrupt_copy(self, entry: Entry, t: int) -> None:
        """Forget a copy that failed its checksum or decode (a miss, counted). Caller holds the lock."""
        self.tiers[t].drop(entry.key)  # a durable tier drops corrupt copies itself; codecs do not
        self.counters["corrupt_dropped"] += 1
        self.policies[t].remove(entry.key)
        entry.copies.pop(t, None)
        if entry.copies:
            self._copies_changed(entry)
        else:
            self._forget(entry)

    def complete_load(self, lease_id: int) -> None:
        lease = self._take_lease(lease_id, "load")
        self._unpin_keys(lease.keys)

    def _unpin_keys(self, keys: Sequence[bytes]) -> None:
        with self._lock:
            for key in keys:
                entry = self._index.get(key)
                if entry is not None and entry.pins > 0:
                    self._unpin(entry)

    # -- leases ----------------------------------------------------------------------------------

    def _new_lease(self, kind: str, keys: list[bytes], extents) -> Lease:
        with self._lock:
            lease = Lease(next(self._lease_ids), kind, keys, self._clock() + self.config.lease_seconds,
                          extents)
            self._leases[lease.id] = lease
        return lease

    def _take_lease(self, lease_id: int, kind: str) -> Lease:
        with self._lock:
            lease = self._leases.pop(lease_id, None)
        if lease is None or lease.kind != kind:
            raise LeaseExpired(f"lease_id: {kind} lease {lease_id} is unknown or expired")
        return lease

    def expire_leases(self, now: float | None = None) -> int:
        """Release leases whose holder never came back (a crashed client). Returns how many."""
        now = self._clock() if now is None else now
        with self._lock:
            dead = [lease for lease in self._leases.values() if lease.expires <= now]
            for lease in dead:
                del self._leases[lease.id]
        for lease in dead:
            if lease.kind == "load":
                self._unpin_keys(lease.keys)
            else:
                self._release_reservations([k for k, x in zip(lease.keys, lease.extents) if x is not None])
        self.counters["leases_expired"] += len(dead)
        return len(dead)

    # -- delete, flush, stats --------------------------------------------------------------------

    def delete(self, namespace_id: bytes, hashes: Sequence[bytes]) -> int:
        self._check_batch(namespace_id, hashes)
        n = 0
        with self._lock:
            for h in hashes:
                entry = self._index.get(block_key(namespace_id, h))
                if entry is None or not entry.ready or entry.doomed:
                    continue
                n += 1
                if entry.pins:
                    entry.doomed = True
                    self._ns_bytes[entry.namespace_id] -= entry.raw_size
                    entry.ready = False
                else:
                    self._drop_entry(entry)
        return n

    def flush(self) -> int:
        """Write every block that has no durable copy to the durable tier (write-back drain)."""
        d = self.durable_index
        if d is None:
            return 0
        written = 0
        with self._lock:
            for entry in list(self._index.values()):
                if not entry.ready or d in entry.copies:
                    continue
                src = entry.fastest
                try:
                    self._make_room(d, entry.copies[src].stored_size)  # before filling scratch
                    self._store_copy(entry, d, self._read_copy(entry, src), entry.copies[src], sync=False)
                    written += 1
                except (TierFull, TierIOError, BlockTooLarge):
                    self.counters["flush_failures"] += 1
        self.tiers[d].sync()  # also covers blocks demoted earlier without a sync
        return written

    def stats(self) -> dict:
        with self._lock:
            return {
                "blocks": sum(1 for e in self._index.values() if e.ready),
                "leases": len(self._leases),
                "namespaces": len(self._namespaces),
                "tiers": {t.name: {**t.stats(), "policy_blocks": len(p)}
                          for t, p in zip(self.tiers, self.policies)},
                "counters": dict(self.counters),
            }

    def close(self) -> None:
        for tier in self.tiers:
            tier.close()
