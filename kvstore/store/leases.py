"""Leases: the two-phase operations through which same-host clients read and write the CPU arena.

* ``prepare_store`` reserves slots in the CPU arena and returns where to write the raw block; it
  is invisible until ``complete_store`` makes it visible (or ``abort_store`` / lease expiry frees
  it). With a CPU-tier codec, ``complete_store`` encodes the block into fewer slots first. A
  writer may instead write a payload it encoded itself at the start of the slots and name its
  codec and size at ``complete_store``: checked, then kept as it is where the CPU tier stores that
  codec (re-allocated into fewer slots), decoded (and re-encoded) where it does not.
* ``prepare_load`` makes sure the blocks have a CPU copy and pins them under a lease; the client
  copies out of the arena and calls ``complete_load``. A copy encoded with a codec the reader
  decodes (``accept``) is leased as stored (``Lease.codecs`` / ``sizes`` say what each holds);
  one it does not decode stops the lease (the server then decodes it for that reader).

A lease that is never completed expires (``expire``), so a crashed client cannot leak pins or
slots. Lease ids are never reused within one store.

Load leases have a budget: one tenant's open load leases hold at most ``limit_bytes`` of the CPU
tier (the daemon's ``max_leased_bytes_per_tenant``; None: ``LEASED_SHARE`` of it), each leased
block counted at its slot footprint, as often as it is leased. Why: a lease pins what it names,
and a client may open leases as fast as it can call, each lasting ``lease_seconds``; without a
bound one tenant could keep the whole tier pinned (no other tenant's put or promotion could enter
it) and grow the lease table without end. A lease stops at the first block beyond the budget
(counted as ``load_leases_capped``); the reader gets that block by value, as it gets any block a
lease stops at.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Collection, Sequence

import numpy as np

from kvstore.buffers import SCRATCH_KEEP_BYTES, Extent
from kvstore.errors import InvalidArgument, LeaseExpired
from kvstore.keys import block_key
from kvstore.store.cascade import Cascade
from kvstore.store.puts import RUN_BLOCKS, PutResults, check_encoded, payload_codecs, reserve_next, run_limit
from kvstore.store.transcoding import RAW
from kvstore.store.transfers import COPIED
from kvstore.tiers.cpu import CpuTier


#: blocks of a load lease staged from a slower tier per round, and their bytes (a larger block is a
#: round alone): read together (several in flight) into a kept buffer of the reading thread, then
#: copied into the arena under one lock acquisition
STAGE_RUN = 16
STAGE_BYTES = SCRATCH_KEEP_BYTES
#: the most of the CPU tier one tenant's open load leases may pin unless ``Leases.limit_bytes`` says
#: (a reader needs a window or two at a time; the rest stays open to other tenants' puts and promotions)
LEASED_SHARE = 0.5


@dataclasses.dataclass
class Lease:
    """A two-phase operation in flight: pinned (load) or reserved (store) blocks."""

    id: int
    kind: str                     # "load" | "store"
    keys: list[bytes]
    expires: float
    extents: list[list[Extent] | None]
    codecs: list[int] = dataclasses.field(default_factory=list)   # load: each block's codec id
    sizes: list[int] = dataclasses.field(default_factory=list)    # load: each block's stored bytes
    tenant: str = ""              # load: whose budget it is charged to
    charged: int = 0              # load: the CPU-tier footprints it holds of that budget
    capped: bool = False          # load: it stopped at that budget


class Leases:
    """The open leases of one store and the two-phase operations that open and close them."""

    def __init__(self, cascade: Cascade) -> None:
        self._cascade = cascade
        self._open: dict[int, Lease] = {}
        self._ids = itertools.count(1)
        self._leased: dict[str, int] = {}   # tenant -> footprints its open load leases hold
        self.limit_bytes: int | None = None   # per tenant (module docstring); set by ``StoreAdmin.set_limits``

    def leased_bytes(self, tenant: str) -> int:
        """What ``tenant``'s open load leases hold of the CPU tier."""
        with self._cascade.lock:
            return self._leased.get(tenant, 0)

    def _room(self, tenant: str, cpu: CpuTier) -> int:
        """The bytes ``tenant`` may still lease (see the module docstring). Caller holds the lock."""
        limit = int(cpu.capacity_bytes * LEASED_SHARE) if self.limit_bytes is None else self.limit_bytes
        return max(0, limit - self._leased.get(tenant, 0))

    def _charge(self, lease: Lease, nbytes: int) -> None:
        """Add ``nbytes`` (negative: give back) to what ``lease`` holds of its tenant's budget.
        Caller holds the lock."""
        if not nbytes:
            return
        lease.charged += nbytes
        held = self._leased.get(lease.tenant, 0) + nbytes
        assert held >= 0 and lease.charged >= 0, "a load lease gave back more than it held"
        if held:
            self._leased[lease.tenant] = held
        else:
            del self._leased[lease.tenant]

    def __len__(self) -> int:
        return len(self._open)

    def _cpu_tier(self) -> tuple[int, CpuTier]:
        c = self._cascade.cpu_index
        if c is None:
            raise InvalidArgument("transport", "this daemon has no CPU tier to share")
        return c, self._cascade.tiers[c]  # type: ignore[return-value]

    # -- two-phase store (zero-copy writers) -----------------------------------------------------

    def prepare_store(self, namespace_id: bytes, hashes: Sequence[bytes],
                      parent: bytes | None = None) -> Lease:
        """Reserve CPU-arena slots for the blocks not yet stored; ``extents[i]`` is None for those
        already present. The writer fills the slots, then calls ``complete_store``."""
        return self._register(self.reserve_store(namespace_id, hashes, parent))

    def reserve_store(self, namespace_id: bytes, hashes: Sequence[bytes], parent: bytes | None = None) -> Lease:
        """``prepare_store`` for a writer inside this process (the side channel receiving into the
        arena): the same reservation, kept out of the lease table, so it never expires under the
        writer; the writer ends it with ``finish_store`` or, on any failure, ``cancel_store``.
        Reserved blocks are invisible, so nothing else frees their slots meanwhile."""
        ns = self._cascade.namespaces.check_batch(namespace_id, hashes)
        c, cpu = self._cpu_tier()
        lease = Lease(0, "store", [], float("inf"), [])
        parents = [parent] + list(hashes[:-1])
        try:
            i = 0
            while i < len(hashes):
                # a run per lock acquisition (room made for it first where it can be); else one by one
                run = reserve_next(self._cascade, ns, hashes, parents, i, c, run_limit(ns.block_bytes))
                if not run:
                    run = [self._cascade.reserve(namespace_id, hashes[i], parents[i], ns.block_bytes, c,
                                                 only_this_tier=True)]
                lease.keys += [block_key(namespace_id, h) for h in hashes[i:i + len(run)]]
                extents = iter(cpu.extents_many([entry.key for entry in run if entry is not None]))
                lease.extents += [None if entry is None else next(extents) for entry in run]
                i += len(run)
        except Exception:
            self.cancel_store(lease)
            raise
        return lease

    def complete_store(self, lease_id: int, codec: int = 0, sizes: Sequence[int] = ()) -> list[str]:
        """Make the lease's blocks visible. ``codec``/``sizes``: the writer put payloads it encoded
        itself at the start of each block's slots (``puts.payload_codecs``); every one is checked
        (``puts.check_encoded``) before any block is made visible, and a bad one aborts the whole
        lease (``InvalidArgument`` naming it): nothing is stored, the slots are freed."""
        return self.finish_store(self._take(lease_id, "store"), codec, sizes)

    def finish_store(self, lease: Lease, codec: int = 0, sizes: Sequence[int] = ()) -> list[str]:
        """``complete_store`` of a store lease already taken out of the table (or never in it:
        ``reserve_store``)."""
        cascade = self._cascade
        try:
            encoded = self._client_payloads(lease, codec, sizes)
        except Exception:
            self.cancel_store(lease)
            raise
        out = PutResults(cascade)
        results = out.results
        at: list[int] = []   # the result positions, entries and payloads of blocks not yet published
        ready: list = []
        payloads: list = []

        def publish_ready() -> None:   # in order, up to RUN_BLOCKS per lock acquisition
            out.publish(ready, payloads, at)
            at.clear()
            ready.clear()
            payloads.clear()

        c = cascade.cpu_index
        raw_tier = cascade.transcoder.configured(c) == RAW  # type: ignore[arg-type]
        needs = None   # whether completing reads the blocks' bytes (one namespace per lease: decided once)
        entries = cascade.index.entries
        try:
            for i, (key, ext) in enumerate(zip(lease.keys, lease.extents)):
                entry = entries.get(key) if ext is not None else None
                if entry is None or entry.ready:
                    results.append("exists")
                    continue
                if i in encoded:
                    like, payload = encoded[i]
                    payload = cascade.encode_reserved(entry, c, payload, like)  # type: ignore[arg-type]
                else:
                    if needs is None:   # to encode them for a CPU-tier codec, or to write them through
                        needs = (cascade.transcoder.codec_for(c, entry.namespace_id) != RAW  # type: ignore[arg-type]
                                 or (cascade.config.write_through and cascade.durable_index is not None))
                    payload = None   # a raw CPU tier keeps the slots as written: nothing reads them unless needed
                    if needs:
                        views = cascade.tiers[c].view(key)  # type: ignore[attr-defined,index]
                        payload = views[0] if len(views) == 1 else np.concatenate(views)
                    if not raw_tier:   # encode for the CPU tier's codec (and tally it)
                        payload = cascade.encode_reserved(entry, c, payload)  # type: ignore[arg-type]
                at.append(len(results))
                results.append("stored")
                ready.append(entry)
                payloads.append(payload)
                if len(ready) >= RUN_BLOCKS:
                    publish_ready()
        finally:   # a block that failed to encode was dropped; those before it are published
            publish_ready()
        return out.synced()

    def _client_payloads(self, lease: Lease, codec: int, sizes: Sequence[int]) -> dict[int, tuple]:
        """Block index -> (record, payload) of each reserved block the writer encoded itself, its
        payload copied out of the slots (they are re-allocated under it) and checked."""
        if not codec and not sizes:
            return {}
        cascade = self._cascade
        entries = [cascade.index.entries.get(k) if x is not None else None for k, x in zip(lease.keys, lease.extents)]
        live = [e for e in entries if e is not None and not e.ready]
        if not live:
            return {}
        ns = cascade.namespaces.get(live[0].namespace_id)
        codecs = payload_codecs(ns, codec, sizes, len(lease.keys)) or []
        cpu = cascade.tiers[cascade.cpu_index]  # type: ignore[index]
        out = {}
        for i, (entry, block_codec) in enumerate(zip(entries, codecs)):
            if entry is None or entry.ready or not block_codec:
                continue
            views = cpu.view(entry.key)  # type: ignore[attr-defined]
            payload = (views[0] if len(views) == 1 else np.concatenate(views))[:sizes[i]].copy()
            check_encoded(ns, block_codec, payload, i)
            out[i] = (entry.copies[cascade.cpu_index].replace(codec=block_codec,  # type: ignore[index]
                                                              stored_size=int(sizes[i]), checksum=0), payload)
        return out

    def abort_store(self, lease_id: int) -> None:
        self.cancel_store(self._take(lease_id, "store"))

    def cancel_store(self, lease: Lease) -> None:
        """Free a store lease's reserved slots (a ``reserve_store`` one's on any failure): its blocks
        not yet visible are dropped."""
        with self._cascade.lock:
            for key, extents in zip(lease.keys, lease.extents):
                entry = self._cascade.index.entries.get(key) if extents is not None else None
                if entry is not None and not entry.ready:
                    self._cascade.drop_entry(entry)

    # -- two-phase load (zero-copy readers) ------------------------------------------------------

    def prepare_load(self, namespace_id: bytes, hashes: Sequence[bytes], accept: Collection[int] = ()) -> Lease:
        """Pin the leading present blocks with a CPU copy each (staging it from a slower tier if
        needed) and return their arena extents; stops at the first block it cannot stage that way
        (absent, no room, or encoded with a codec not in ``accept``). Blocks already in the arena
        are taken a run at a time under one lock acquisition. Blocks to stage are taken a run of
        up to ``STAGE_RUN`` blocks (and ``STAGE_BYTES``) of one source tier at a time: pinned under
        the lock, then copied into the arena as any copy between tiers is (``Cascade.copy_out_many``:
        read several at once, no other caller waiting on this one's disk), then leased in order.
        Also stops at the first block beyond the tenant's lease budget (module docstring)."""
        cascade = self._cascade
        ns = cascade.namespaces.check_batch(namespace_id, hashes)
        c, cpu = self._cpu_tier()
        lease = Lease(0, "load", [], float("inf"), [], tenant=ns.tenant)
        entries = cascade.index.entries
        i, stopped = 0, False
        try:
            while i < len(hashes) and not stopped:
                staging: list = []   # pinned entries whose copies are read from tier ``src``
                staged_bytes = src = staged_charge = 0   # staged_charge: the footprints charged for them
                with cascade.lock:
                    leased: list = []   # blocks with a CPU copy, leased below at once (pins, touches, counts)
                    held: list[tuple[int, int]] = []   # (stored size, codec) of each one's CPU copy
                    room, charged, footprint = self._room(ns.tenant, cpu), 0, {}   # footprint: by stored size
                    while i < len(hashes):
                        entry = entries.get(namespace_id + hashes[i])   # cascade.pin, inlined: hot
                        if entry is None or not entry.visible:
                            if not staging:   # (after a run to stage, it is met again once that is leased)
                                cascade.count("misses")  # a zero-copy reader's miss counts like get's
                                stopped = True
                            break
                        stored = entry.copies.stored(c)   # (size, codec) of its CPU copy; no record made
                        if stored is None:
                            t, record = entry.copies.first_item()
                            size = record.stored_size
                            if staging and (len(staging) == STAGE_RUN or staged_bytes + size > STAGE_BYTES
                                            or t != src):
                                break
                        else:
                            if staging:
                                break   # the run to stage ends here; this block is leased after it
                            if stored[1] != 0 and stored[1] not in accept:
                                # an encoded arena copy is not the block's bytes to a reader that cannot
                                # decode it; the server reads such blocks for it through get_into instead
                                stopped = True
                                break
                            size = stored[0]
                        charge = footprint.get(size) or footprint.setdefault(size, cpu.footprint(size))
                        if charge > room:
                            stopped = self._capped(lease, not staging)
                            break
                        room, charged = room - charge, charged + charge
                        i += 1
                        if stored is None:
                            src = t
                            staging.append(cascade.pin_entry(entry))
                            staged_bytes += size
                            staged_charge += charge
                        else:
                            leased.append(entry)
                            held.append(stored)
                    cascade.pin_all(leased)
                    self._lease_held(lease, leased, held, c, c)
                    self._charge(lease, charged)
                if staging:
                    stopped = not self._stage_run(staging, staged_charge, src, c, accept, lease)
        except BaseException:
            self._end_load(lease)
            raise
        return self._register(lease)

    def _capped(self, lease: Lease, now: bool) -> bool:
        """``lease`` reached its tenant's budget; ``now``: it stops here, counted (else after the
        run being staged, whose next block meets the budget again). Caller holds the lock."""
        if now:
            lease.capped = True
            self._cascade.counters["load_leases_capped"] += 1
        return now

    def _stage_run(self, staging: list, charged: int, src: int, c: int, accept: Collection[int],
                   lease: Lease) -> bool:
        """Give each pinned entry of ``staging`` a copy in the CPU tier ``c`` from its copy in tier
        ``src`` (``Cascade.copy_out_many``) and lease it, in order; False at the first that cannot
        be (a damaged copy: dropped, counted; a failed read; no room; gone meanwhile; encoded with
        a codec the reader does not take): it and the rest are unpinned (on any exit, so no pin
        outlives a failure), and the reader is told it was not staged (it fetches it over a stream).
        ``charged``: their footprints charged to the lease ahead, from their source copies' sizes;
        the lease is then charged what the staged copies hold instead."""
        cascade = self._cascade
        held: list[tuple[int, int]] = []
        try:
            outcomes = cascade.copy_out_many(staging, src, c)
            with cascade.lock:
                for entry, outcome in zip(staging, outcomes):
                    stored = entry.copies.stored(c)
                    if outcome != COPIED or stored is None or not entry.visible or stored[1] not in (0, *accept):
                        break
                    held.append(stored)
                self._lease_held(lease, staging[:len(held)], held, c, src)
                self._charge(lease, _footprints(cascade.tiers[c], held) - charged)
        finally:
            if len(held) < len(staging):
                with cascade.lock:
                    cascade.unpin_all(staging[len(held):])
        return len(held) == len(staging)

    def _lease_held(self, lease: Lease, entries: list, held: list[tuple[int, int]], c: int, src: int) -> None:
        """Add pinned ``entries``, whose CPU copies hold ``held`` (stored size, codec) each, to a
        load lease, in order (their keys, arena extents, sizes and codecs): touched in the CPU
        tier's policy, and counted as hits on tier ``src``, where their bytes came from. Caller
        holds the lock."""
        if not entries:
            return
        keys = [e.key for e in entries]
        self._cascade.index.policies[c].touch_many(keys)
        self._cascade.served(src, len(entries), sum(size for size, _ in held))
        lease.keys += keys
        lease.extents += self._cascade.tiers[c].extents_many(keys)  # type: ignore[attr-defined]
        lease.sizes += [size for size, _ in held]
        lease.codecs += [codec for _, codec in held]

    def complete_load(self, lease_id: int) -> None:
        self._end_load(self._take(lease_id, "load"))

    def _end_load(self, lease: Lease) -> None:
        """Release a load lease's pins and give back what it held of its tenant's budget."""
        with self._cascade.lock:
            self._cascade.unpin_keys(lease.keys)
            self._charge(lease, -lease.charged)

    # -- the lease table -------------------------------------------------------------------------

    def _register(self, lease: Lease) -> Lease:
        """Give ``lease`` an id and an expiry and put it in the table."""
        with self._cascade.lock:
            lease.id = next(self._ids)
            lease.expires = self._cascade.clock() + self._cascade.config.lease_seconds
            self._open[lease.id] = lease
        return lease

    def _take(self, lease_id: int, kind: str) -> Lease:
        with self._cascade.lock:
            lease = self._open.pop(lease_id, None)
        if lease is None or lease.kind != kind:
            raise LeaseExpired(f"lease_id: {kind} lease {lease_id} is unknown or expired")
        return lease

    def expire(self, now: float | None = None) -> int:
        """Release leases whose holder never came back (a crashed client). Returns how many."""
        cascade = self._cascade
        now = cascade.clock() if now is None else now
        with cascade.lock:
            dead = [lease for lease in self._open.values() if lease.expires <= now]
            for lease in dead:
                del self._open[lease.id]
        for lease in dead:
            if lease.kind == "load":
                self._end_load(lease)
            else:
                self.cancel_store(lease)
        cascade.count("leases_expired", len(dead))
        return len(dead)


def _footprints(cpu: CpuTier, held: list[tuple[int, int]]) -> int:
    """What copies of these (stored size, codec) hold of the CPU tier: their slot footprints."""
    return sum(cpu.footprint(size) for size, _ in held)
