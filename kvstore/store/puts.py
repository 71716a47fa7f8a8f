"""Writing a chain of new blocks by value (a client's put, a peer fetch), each in the form the tier
it lands in keeps: encoded where that tier has a codec (``transcoding``), so the tier's used bytes
shrink by the codec's ratio. The encoding for the first tier tried runs before the store lock is
taken; a block already present is never encoded at all.
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future

from kvstore.buffers import as_bytes
from kvstore.errors import CodecError, InvalidArgument, WrongBlockSize
from kvstore.keys import Namespace
from kvstore.store.cascade import Cascade
from kvstore.store.transcoding import RAW, StagedBlock
from kvstore.threads import BUDGET, LazyPool
from kvstore.tiers.base import BlockRecord


def payload_codecs(ns: Namespace, codec: int, sizes: Sequence[int], count: int) -> list[int] | None:
    """Per block, the codec of a put that carries client-encoded payloads (``codec``, each
    ``sizes[i]`` bytes: shorter than a block = encoded, exactly a block = raw), or None for an
    all-raw put (``codec`` 0, no sizes). Raises ``InvalidArgument`` naming ``codec`` or ``sizes``:
    an unknown codec, one that cannot read this namespace's layout (it could not have encoded its
    blocks), a size count that is not one per block, a size of 0 or above a block."""
    if not codec:
        if sizes:
            raise InvalidArgument("sizes", "payload sizes come only with a codec (codec 0: every block raw)")
        return None
    from kvstore import codecs as kvcodecs   # torch: only for puts that carry encoded payloads
    try:
        name = kvcodecs.codec_for_id(codec).name
        kvcodecs.check_layout(codec, ns.layout)
    except kvcodecs.Refused as e:
        if e.reason != "no_gain":   # no_gain: every payload would be a block long, i.e. raw
            raise InvalidArgument("codec", f"codec {codec} ({name}) cannot encode this namespace's "
                                           f"{ns.layout.layout!r} blocks: {e}") from None
    except CodecError as e:
        raise InvalidArgument("codec", str(e)) from None
    if len(sizes) != count:
        raise InvalidArgument("sizes", f"{len(sizes)} payload sizes for {count} blocks")
    for i, size in enumerate(sizes):
        if not 0 < size <= ns.block_bytes:
            raise InvalidArgument(f"sizes[{i}]", f"a payload of {size} bytes; it must be 1..{ns.block_bytes} "
                                                 f"(a block's {ns.block_bytes} bytes: raw)")
    return [codec if size < ns.block_bytes else 0 for size in sizes]


def check_encoded(ns: Namespace, codec: int, payload, index: int) -> None:
    """Refuse (``InvalidArgument`` naming ``blocks[index]``) an encoded payload from outside the
    store that is not an intact block of this namespace in ``codec``: its self-describing header
    (magic, CRC32, codec, parameter, shape and dtype against the layout) and its body's xxh3-64
    are checked, as ``decode_block`` does before decoding, without decoding. Raw (0): nothing."""
    if not codec:
        return
    from kvstore import codecs as kvcodecs
    try:
        kvcodecs.check_payload(codec, payload, ns.layout)
    except CodecError as e:
        raise InvalidArgument(f"blocks[{index}]", f"encoded payload refused, nothing stored for it: {e}") from None


def checked_payloads(ns: Namespace, payloads: Sequence, codecs: Sequence[int] | None) -> list:
    """Byte views of ``payloads``: raw ones exactly a block, encoded ones (``codecs[i]`` != 0)
    shorter than a block (their header and checksum are checked when they are first decoded)."""
    if codecs is not None and len(codecs) != len(payloads):
        raise InvalidArgument("codecs", f"{len(codecs)} codec ids for {len(payloads)} payloads")
    arrays = [as_bytes(p) for p in payloads]
    if codecs is None and arrays and min(map(len, arrays)) == max(map(len, arrays)) == ns.block_bytes:
        return arrays   # all raw, each a block long (flat byte arrays: a length is its bytes)
    for i, a in enumerate(arrays):
        encoded = codecs is not None and codecs[i] != 0
        if not encoded and a.nbytes != ns.block_bytes:
            raise WrongBlockSize(ns.block_bytes, a.nbytes, i)
        if encoded and not 0 < a.nbytes < ns.block_bytes:
            raise InvalidArgument("blocks", f"encoded payload {i} is {a.nbytes} bytes; it must be shorter "
                                            f"than a {ns.block_bytes}-byte block")
    return arrays


#: at most this many blocks, and this many bytes, per run of ``Cascade.reserve_run``: bounds how long
#: it holds the lock, and how long a put's first block of a run stays invisible while the rest is copied
RUN_BLOCKS = 512
RUN_BYTES = 32 << 20


def run_limit(block_bytes: int) -> int:
    return max(1, min(RUN_BLOCKS, RUN_BYTES // max(block_bytes, 1)))


def put_chain(cascade: Cascade, ns: Namespace, hashes: Sequence[bytes], arrays: Sequence,
              parent: bytes | None, codecs: Sequence[int] | None = None) -> list[str]:
    """Store ``arrays[i]`` (encoded with ``codecs[i]``; None: all raw) under ``hashes[i]``, whose
    parent is ``hashes[i-1]`` (the first's is ``parent``). Per block "stored", "exists" or
    "persisted". Raises ``StoreFull`` if a block fits nowhere; blocks before it stay.

    Raw blocks for a first tier that is memory (GPU or CPU: a copy takes microseconds, so a run is
    invisible only briefly) are taken a run at a time (``reserve_next``: one lock acquisition to
    reserve the run, the copies outside it, one to publish it, in order); any other block (a
    victim the policy cannot name ahead, a codec, a quota near its limit, another tier, a disk or
    network first tier) goes through ``_put_one``, one at a time."""
    out = PutResults(cascade)
    parents = [parent] + list(hashes[:-1])
    runs = (cascade.cpu_index is not None and cascade.transcoder.configured(0) == RAW
            and (codecs is None or not any(codecs)))   # tier 0 is then the CPU tier or a GPU tier before it
    limit = run_limit(ns.block_bytes)
    disk = DiskWrites(cascade, out)
    i = 0
    try:
        while i < len(hashes):
            run = reserve_next(cascade, ns, hashes, parents, i, 0, limit) if runs else []
            if run:
                disk.finish()   # published in the put's order
                _write_run(cascade, run, arrays, i, out)
                i += len(run)
                continue
            _put_one(cascade, ns, hashes[i], parents[i], arrays[i], 0 if codecs is None else int(codecs[i]),
                     disk)
            i += 1
        disk.finish()
    finally:
        disk.settle()   # after a failure, the blocks written before it stay
        results = out.synced()
    return results


def reserve_next(cascade: Cascade, ns: Namespace, hashes: Sequence[bytes], parents: Sequence, start: int,
                 t: int, limit: int) -> list:
    """The next run of raw blocks from ``start`` reserved in tier ``t`` (``Cascade.reserve_run``);
    where tier ``t`` is full and its policy names the same victims ahead of time as one by one
    (``Cascade.victims_ahead``), room for the run's absent blocks is made first, its victims
    written down together (``Cascade.clear_room``). Empty: the block at ``start`` goes one by one
    (``Cascade.reserve``)."""
    run = cascade.reserve_run(ns, hashes, parents, start, t, limit)
    if not run:
        keys, parent_keys = _absent(cascade, ns, hashes, parents, start, limit)
        if (keep := cascade.victims_ahead(t, keys, parent_keys)) is not None:
            cascade.clear_room(t, ns.block_bytes, ns.id, blocks=len(keys), keep=keep)
            run = cascade.reserve_run(ns, hashes, parents, start, t, limit)
    return run


def _absent(cascade: Cascade, ns: Namespace, hashes: Sequence[bytes], parents: Sequence, start: int,
            limit: int) -> tuple[list[bytes], list[bytes | None]]:
    """The keys of the next ``limit`` blocks from ``start`` the store does not hold, each once, in
    order, and each one's parent's key (None: none): a hint, read without the lock."""
    entries, keys, parent_keys, seen = cascade.index.entries, [], [], set()
    for k in range(start, min(len(hashes), start + limit)):
        key = ns.id + hashes[k]
        if key in entries or key in seen:
            continue
        seen.add(key)
        keys.append(key)
        parent_keys.append(None if parents[k] is None else ns.id + parents[k])
    return keys, parent_keys


class PutResults:
    """What a put answers, per block in its order: "exists", "stored", or "persisted" for a
    stored block with a durable copy, once one ``sync_durable`` at the end (group commit: one
    flush of each file written) has committed them all."""

    def __init__(self, cascade: Cascade) -> None:
        self.cascade = cascade
        self.results: list[str] = []
        self._durable: list[int] = []   # positions of blocks with a durable copy, not yet synced

    def add(self, result: str) -> int:
        self.results.append(result)
        return len(self.results) - 1

    def publish(self, entries: Sequence, payloads: Sequence, at: Sequence[int]) -> None:
        """Make written entries visible, in order (``Cascade.publish_run``); ``at``: their positions."""
        self._durable.extend(at[k] for k in self.cascade.publish_run(entries, payloads))

    def synced(self) -> list[str]:
        if self._durable and self.cascade.sync_durable():
            for k in self._durable:
                self.results[k] = "persisted"
        return self.results


WRITES_IN_FLIGHT = BUDGET.disk_writes   # disk-tier writes of one put at once (queue depth, as reads.READS_IN_FLIGHT)
WRITE_GROUP_BYTES = 4 << 20   # a put's blocks handed to one of those writes together
_writers = LazyPool(WRITES_IN_FLIGHT, "kvstore-disk-write")


class DiskWrites:
    """A put's blocks whose copy goes to a disk tier, handed to the tier in groups of up to
    ``WRITE_GROUP_BYTES`` (``Tier.write_many_unsynced``: a chain's neighbouring slots take one
    write and one record write per group, not one each per block), up to ``WRITES_IN_FLIGHT``
    groups at once (each waits on the disk with the GIL released, so their waits overlap), and
    published in the put's order. Blocks for memory tiers are written inline, after the disk
    writes queued before them are published."""

    def __init__(self, cascade: Cascade, out: PutResults) -> None:
        self.cascade, self.out = cascade, out
        self._group: list[tuple[int, object, object]] = []   # (result index, entry, placement), not yet handed over
        self._group_bytes = 0
        self._pending: list[tuple[list, Future]] = []   # groups handed to the writers, oldest first
        self._failed = False   # a write failed: the blocks queued after it are not published

    def add(self, entry, placed) -> None:
        if self._group and self._group[0][1].fastest != entry.fastest:
            self._hand_over()
        self._group.append((self.out.add("stored"), entry, placed))
        self._group_bytes += placed.payload.nbytes
        if self._group_bytes >= WRITE_GROUP_BYTES:
            self._hand_over()

    def _hand_over(self) -> None:
        self._submit()
        if len(self._pending) >= WRITES_IN_FLIGHT:
            self._publish_first()

    def _submit(self) -> None:
        group, self._group, self._group_bytes = self._group, [], 0
        tier = self.cascade.tiers[group[0][1].fastest]
        records = [entry.copies[entry.fastest] for _, entry, _ in group]
        write = _writers.get().submit(tier.write_many_unsynced, records, [p.payload for _, _, p in group], False)
        self._pending.append((group, write))

    def finish(self) -> None:
        if self._group:
            self._hand_over()
        while self._pending:
            self._publish_first()

    def _publish_first(self) -> None:
        group, write = self._pending.pop(0)
        error = self._settle(group, write)
        if error is not None:
            raise error

    def _settle(self, group: list, write: Future) -> BaseException | None:
        """Wait for one group's write; publish its blocks in order up to the first that failed
        (none after a failure elsewhere), drop that one and the rest. The first failure, if any."""
        try:
            errors = write.result()
        except BaseException as e:  # noqa: BLE001 - the whole group failed; raised by the caller
            errors = [e] * len(group)
        first = next((k for k, e in enumerate(errors) if e is not None), len(group))
        keep = 0 if self._failed else first
        self._failed = self._failed or first < len(group)
        if keep:
            _publish_written(self.cascade, group[:keep], self.out)
        if keep < len(group):
            with self.cascade.lock:
                for _, entry, _ in group[keep:]:
                    self.cascade.drop_entry(entry)
        return errors[first] if first < len(group) else None

    def settle(self) -> None:
        """After the put failed elsewhere: the blocks before the failure stay, as if written one by
        one — queued writes are waited for and published in order up to the first that failed;
        that one and the rest are dropped (each once its write is over: nothing may still be
        writing a dropped block's file)."""
        if self._group:
            self._submit()
        pending, self._pending = self._pending, []
        for group, write in pending:
            self._settle(group, write)


def _write_run(cascade: Cascade, run: list, arrays: Sequence, start: int, out: PutResults) -> None:
    """Copy a reserved run's payloads into the first tier outside the lock (``Tier.write_keys``),
    then publish them in order under one acquisition. A failed copy publishes the blocks before
    it, drops the rest."""
    upto, error = 0, None   # the run's positions before ``upto`` are written (or present)
    if None not in run:   # every block new (the usual run)
        new: Sequence[int] = range(len(run))
        keys, datas = [entry.key for entry in run], arrays[start:start + len(run)]
    else:   # the run's blocks to write (None: present)
        new = [k for k, entry in enumerate(run) if entry is not None]
        keys, datas = [run[k].key for k in new], [arrays[start + k] for k in new]
    try:
        written, error = cascade.tiers[0].write_keys(keys, datas)
        upto = len(run) if error is None else new[written]
    finally:
        results = out.results
        if upto == len(run) and len(new) == len(run):   # every block new and written (the usual run)
            at = list(range(len(results), len(results) + len(run)))
            results.extend(["stored"] * len(run))
            done, payloads = run, arrays[start:start + len(run)]
        else:
            done, payloads, at = [], [], []   # the entries to publish, their payloads, their result indices
            with cascade.lock:
                for k, entry in enumerate(run):
                    if entry is None:
                        if k < upto:
                            results.append("exists")
                    elif k >= upto:
                        cascade.drop_entry(entry)
                    else:
                        at.append(len(results))
                        results.append("stored")
                        done.append(entry)
                        payloads.append(arrays[start + k])
        out.publish(done, payloads, at)
    if error is not None:
        raise error


def _put_one(cascade: Cascade, ns: Namespace, h: bytes, p: bytes | None, data, codec: int,
             disk: DiskWrites) -> None:
    """One block through ``Cascade.reserve`` (eviction, codecs, fall-through to slower tiers); its
    result is added to ``disk.out`` (a disk tier's write may still be in flight). Writes
    to a durable tier skip their fsync: the batch's ``sync_durable`` commits them (group commit)."""
    found = cascade.index.find(ns.id, h)   # checked again under the lock by reserve
    if found is not None and not found.doomed:   # a doomed one: reserve waits for its last reader
        disk.finish()   # the blocks queued before it are published first, as when written one by one
        disk.out.add("exists")
        return
    staged = StagedBlock(cascade.transcoder, BlockRecord(ns.id, h, p, data.nbytes, ns.block_bytes, codec), data)
    staged.placement(0)  # encode for the first tier tried before the lock is taken
    entry = cascade.reserve(ns.id, h, p, ns.block_bytes, 0, staged=staged)
    if entry is None:
        disk.finish()
        disk.out.add("exists")
        return
    t = entry.fastest
    placed = staged.placement(t)
    if cascade.tiers[t].durable:
        disk.add(entry, placed)
        return
    disk.finish()
    try:
        cascade.tiers[t].write_unsynced(entry.copies[t], placed.payload, durable=False)
    except Exception:
        with cascade.lock:
            cascade.drop_entry(entry)
        raise
    _publish_written(cascade, [(disk.out.add("stored"), entry, placed)], disk.out)


def _publish_written(cascade: Cascade, written: Sequence[tuple[int, object, object]], out: PutResults) -> None:
    """Count written blocks' placements and make them visible, in order; ``written``: each one's
    (result index, entry, placement)."""
    with cascade.lock:
        for _, entry, placed in written:
            cascade.transcoder.count(entry.fastest, placed, entry.raw_size)
    out.publish([entry for _, entry, _ in written], [placed.payload for _, _, placed in written],
                [at for at, _, _ in written])
