"""The contract every tier honours (GPU pool, shared CPU arena, NVMe directory, Redis).

A tier is a dumb medium: it stores opaque payloads under keys and never chooses what to evict.
The Store owns policy, pins and the index; a tier owns bytes and their accounting.

Primitive by primitive:

* ``footprint(nbytes)`` — bytes the tier would account for a payload of ``nbytes`` (slot or
  page rounding included). Raises ``BlockTooLarge`` if no amount of eviction could fit it.
* ``allocate(record)`` — reserve room for ``record.stored_size`` bytes under ``record.key``.
  Raises ``TierFull`` when ``free_bytes`` is short; nothing changes then. Called under the Store
  lock, so it must be quick (no I/O).
* ``write(record, data)`` — fill a reservation. Once it returns, ``read_into`` returns exactly
  ``data``; for a durable tier the bytes have also reached stable storage (fsync) and survive
  a crash. On failure (``TierIOError``) the reservation is released. May run outside the Store
  lock, concurrently with writes and reads of *other* keys.
* ``write_unsynced(record, data, durable=True)`` / ``sync()`` — the batched form of ``write``: the
  payload is complete and fsynced, but a durable tier may leave the *directory entry* unsynced
  until the next ``sync()``, so a batch pays one directory fsync. A crash before ``sync()`` may
  lose such a block (a miss), never tear it. ``durable=False`` (demotions: never acknowledged as
  persisted) skips the payload's fsync too: a crash (power loss) may then tear the file, which its
  checksum turns into a counted miss; the next ``sync()`` makes it durable with the rest (one
  filesystem flush for every such write since the last). Volatile tiers inherit the defaults
  (``write``; no-op).
* ``allocate_keys(keys, nbytes)`` / ``write_key(key, data)`` — a memory tier's run of new raw
  blocks, allocated and written by key (the store makes no record of their copies).
* ``write_many_unsynced(records, datas, durable=True)`` — ``write_unsynced`` for several reserved
  blocks; per block None or its ``TierIOError``. NVMe writes neighbouring slots with one call.
* ``read_into(key, out)`` — copy the payload into the writable buffer ``out`` (at least the
  stored size) and return its length. A durable tier verifies the checksum and, on mismatch,
  deletes the block and raises ``BlockCorrupt``. ``KeyError`` if the key is not there.
* ``read_many_into(keys, outs)`` — ``read_into`` for each key, in its place the payload's length
  or the exception that read raised (``BlockCorrupt``, ``KeyError``). A tier whose neighbouring
  blocks sit side by side on one medium (``reads_in_runs``: NVMe slabs) reads them with one call;
  the rest read one by one.
* ``free_bytes_for(namespace_id)`` — room a block of that namespace could take now: ``free_bytes``,
  except where space is split by owner (the CPU tier's tenant segments). ``assign_owners(fn)``
  tells such a tier whose each namespace is.
* ``extents(key)`` — for tiers a same-host client can map: the (offset, length) pieces of the
  payload inside the shared segment, else None.
* ``drop(key)`` — release the space; idempotent. Called under the Store lock, so bookkeeping
  only: I/O a drop needs (erasing a slot on disk) waits for ``finish_drops()``.
* ``finish_drops()`` — the I/O of the drops so far (erasing their slots), then their space is
  reusable. The Store calls it with its lock released; volatile tiers have none (no-op).
* ``recover_blocks()`` — for durable tiers: yield the intact blocks found at start-up as
  ``RecoveredBlocks`` batches, columns of what the index needs of each block (torn or corrupt
  ones are deleted and counted, never yielded). The tier keeps each block's record itself from
  then on (``record(key)``): an index of millions holds no record object per recovered block.
  ``recover()`` yields the same blocks' records one by one (inspection, tests).
* ``record(key)`` — the ``BlockRecord`` of a block the tier holds (``KeyError`` if none); a
  recovered block's is made when asked, its ``checksum`` 0 (``checksum(key)`` has it).
* ``close()`` — flush and release resources.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from kvstore.errors import BlockCorrupt, BlockTooLarge, TierFull, TierIOError
from kvstore.keys import NAMESPACE_ID_BYTES, NamedByKey, block_key


class BlockRecord(NamedByKey):
    """What a tier keeps beside a payload: enough to rebuild the index after a restart. Slotted,
    and its names held as two keys (``block_key``: namespace id, then hash): its own ``key`` and
    its parent's ``parent_key``; ``namespace_id``, ``block_hash`` and ``parent_hash`` are cut from
    them when asked. One is made per block stored and the index holds one per copy: a child's
    ``parent_key`` can then be its parent's ``key`` itself (one object, see ``share_keys``), and
    no hash is held apart from its key."""

    __slots__ = ("key", "parent_key", "stored_size", "raw_size", "codec", "checksum", "slot", "tier")

    def __init__(self, namespace_id: bytes, block_hash: bytes, parent_hash: bytes | None, stored_size: int,
                 raw_size: int, codec: int = 0, checksum: int = 0, slot: int = -1) -> None:
        assert len(namespace_id) == NAMESPACE_ID_BYTES, "a namespace id is 16 bytes (Namespace.id)"
        self.key = block_key(namespace_id, block_hash)
        self.parent_key = None if parent_hash is None else block_key(namespace_id, parent_hash)
        self.stored_size = stored_size
        self.raw_size = raw_size
        self.codec = codec
        self.checksum = checksum   # xxh3_64 of the stored payload; 0: not computed yet, or kept by its tier (Tier.checksum)
        #: where the tier holding this copy keeps it (the NVMe tier: its slot), set by that tier
        self.slot = slot
        #: the tier whose copy this is, once the index holds it (``store.index.Copies``); not copied by ``replace``
        self.tier = -1

    @classmethod
    def of_keys(cls, key: bytes, parent_key: bytes | None, stored_size: int, raw_size: int, codec: int = 0,
                checksum: int = 0, slot: int = -1) -> BlockRecord:
        """A record holding ``key`` and ``parent_key`` themselves (objects a caller shares)."""
        record = cls.__new__(cls)
        record.key, record.parent_key = key, parent_key
        record.stored_size, record.raw_size, record.codec, record.checksum = stored_size, raw_size, codec, checksum
        record.slot, record.tier = slot, -1
        return record

    @property
    def parent_hash(self) -> bytes | None:
        return None if self.parent_key is None else self.parent_key[NAMESPACE_ID_BYTES:]

    def replace(self, **changes) -> BlockRecord:
        """A copy with ``changes`` (any of ``stored_size``, ``raw_size``, ``codec``, ``checksum``,
        ``slot``), its keys the same objects, its ``tier`` not yet set."""
        fields = {"stored_size": self.stored_size, "raw_size": self.raw_size, "codec": self.codec,
                  "checksum": self.checksum, "slot": self.slot}
        assert changes.keys() <= fields.keys(), f"not a record field: {sorted(changes.keys() - fields.keys())}"
        return BlockRecord.of_keys(self.key, self.parent_key, **(fields | changes))

    def _compared(self) -> tuple:
        return self.key, self.parent_key, self.stored_size, self.raw_size, self.codec, self.checksum

    def __eq__(self, other: object) -> bool:
        if type(other) is not BlockRecord:
            return NotImplemented
        return self._compared() == other._compared()

    __hash__ = None   # type: ignore[assignment]   (mutable: its slot and checksum are set later)

    def __repr__(self) -> str:
        return (f"BlockRecord(namespace_id={self.namespace_id!r}, block_hash={self.block_hash!r}, "
                f"parent_hash={self.parent_hash!r}, stored_size={self.stored_size}, raw_size={self.raw_size}, "
                f"codec={self.codec}, checksum={self.checksum}, slot={self.slot})")


class RecoveredBlocks:
    """Blocks a durable tier found at start-up, one row per block in column lists (``keys``,
    ``parent_keys``, ``raw_sizes``, ``stored_sizes``, ``codecs``), in the order the tier found
    them: what the index needs to hold each block and to name its copy's size and codec, with
    no record object per block (the tier keeps the rest: ``Tier.record``). Equal keys and sizes
    are one object (a child's parent key is its parent's key, where the tier holds both)."""

    __slots__ = ("keys", "parent_keys", "raw_sizes", "stored_sizes", "codecs")

    def __init__(self, keys: list[bytes], parent_keys: list[bytes | None], raw_sizes: list[int],
                 stored_sizes: list[int], codecs: list[int]) -> None:
        assert len(keys) == len(parent_keys) == len(raw_sizes) == len(stored_sizes) == len(codecs), "ragged columns"
        self.keys, self.parent_keys, self.raw_sizes = keys, parent_keys, raw_sizes
        self.stored_sizes, self.codecs = stored_sizes, codecs

    def __len__(self) -> int:
        return len(self.keys)

    def records(self) -> Iterator[BlockRecord]:
        """Each block's record, made now (its checksum 0: its tier keeps it)."""
        for row in zip(self.keys, self.parent_keys, self.stored_sizes, self.raw_sizes, self.codecs):
            yield BlockRecord.of_keys(*row)


class Tier(ABC):
    name: str = "tier"
    durable: bool = False
    #: writes are memory copies (microseconds): the store may make them under its lock. Copies into
    #: any other tier (a disk, a network) leave the lock where the store can (``Cascade.clear_room``)
    in_memory: bool = False

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = int(capacity_bytes)
        self.used_bytes = 0
        self.corrupt_dropped = 0

    @property
    def free_bytes(self) -> int:
        return self.capacity_bytes - self.used_bytes

    def checksum(self, key: bytes) -> int:
        """The xxh3_64 of a held block's stored payload where the tier keeps it apart from the
        block's record (a recovered NVMe block's), else 0: not known without reading it."""
        return 0

    def free_bytes_for(self, namespace_id: bytes) -> int:
        return self.free_bytes

    def assign_owners(self, owner_of) -> None:
        pass

    @abstractmethod
    def footprint(self, nbytes: int) -> int: ...

    @abstractmethod
    def allocate(self, record: BlockRecord) -> None: ...

    def allocate_run(self, records: list[BlockRecord]) -> int:
        """``allocate`` each record in order until one does not fit (``TierFull`` or
        ``BlockTooLarge``); returns how many were allocated. A tier may do the run at once."""
        done = 0
        for record in records:
            try:
                self.allocate(record)
            except (TierFull, BlockTooLarge):
                break
            done += 1
        return done

    def allocate_keys(self, keys: list[bytes], nbytes: int) -> int:
        """``allocate_run`` for new raw blocks of ``nbytes`` named by their keys alone (a memory
        tier's run of new blocks, whose copies the store holds no record of until one is asked
        for); returns how many, in order, were allocated."""
        return self.allocate_run([BlockRecord.of_keys(key, None, nbytes, nbytes) for key in keys])

    def write_key(self, key: bytes, data) -> None:
        """Fill the room ``allocate_keys`` took for ``key``: a memory tier's write (nothing to sync)."""
        raise NotImplementedError(f"the {self.name} tier takes no writes by key")

    def write_keys(self, keys: Sequence[bytes], datas: Sequence) -> tuple[int, Exception | None]:
        """``write_key`` for each key in order (a run of ``allocate_keys``), stopping at the first
        that fails: how many were written, and that failure (None: all were)."""
        for k, (key, data) in enumerate(zip(keys, datas)):
            try:
                self.write_key(key, data)
            except Exception as e:  # noqa: BLE001 - handed to the caller, which publishes the blocks before it
                return k, e
        return len(keys), None

    @abstractmethod
    def write(self, record: BlockRecord, data: memoryview) -> None: ...

    def write_unsynced(self, record: BlockRecord, data: memoryview, durable: bool = True) -> None:
        self.write(record, data)

    def write_many_unsynced(self, records: list[BlockRecord], datas: list, durable: bool = True) -> list:
        """``write_unsynced`` for each reserved block (a tier may write neighbours at once); per
        block None, or the ``TierIOError`` (``TierFull``, ``BlockTooLarge``) its write raised."""
        got: list = []
        for record, data in zip(records, datas):
            try:
                self.write_unsynced(record, data, durable)
                got.append(None)
            except (TierIOError, TierFull, BlockTooLarge) as e:
                got.append(e)
        return got

    def sync(self) -> None:
        pass

    @abstractmethod
    def read_into(self, key: bytes, out: memoryview) -> int: ...

    reads_in_runs = False   # read_many_into does better than one read_into after another

    def read_many_into(self, keys, outs) -> list:
        got: list = []
        for key, out in zip(keys, outs):
            try:
                got.append(self.read_into(key, out))
            except (KeyError, BlockCorrupt) as e:
                got.append(e)
        return got

    def extents(self, key: bytes) -> list[tuple[int, int]] | None:
        return None

    @abstractmethod
    def drop(self, key: bytes) -> None: ...

    def drop_many(self, keys) -> None:
        """``drop`` of each key (a batch of deletes or victims)."""
        for key in keys:
            self.drop(key)

    def finish_drops(self) -> None:
        pass

    def recover_blocks(self) -> Iterator[RecoveredBlocks]:
        return iter(())

    def recover(self) -> Iterator[BlockRecord]:
        """``recover_blocks``, each block's record one by one."""
        for found in self.recover_blocks():
            yield from found.records()

    def record(self, key: bytes) -> BlockRecord:
        raise KeyError(key)

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, int]:
        return {"capacity_bytes": self.capacity_bytes, "used_bytes": self.used_bytes,
                "corrupt_dropped": self.corrupt_dropped}
