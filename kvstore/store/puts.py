"""Writing a chain of new blocks by value (a client's put, a peer fetch), each in the form the tier
it lands in keeps: encoded where that tier has a codec (``transcoding``), so the tier's used bytes
shrink by the codec's ratio. The encoding for the first tier tried runs before the store lock is
taken; a block already present is never encoded at all.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.buffers import as_bytes
from kvstore.errors import InvalidArgument, WrongBlockSize
from kvstore.keys import Namespace
from kvstore.store.cascade import Cascade
from kvstore.store.transcoding import StagedBlock
from kvstore.tiers.base import BlockRecord


def checked_payloads(ns: Namespace, payloads: Sequence, codecs: Sequence[int] | None) -> list:
    """Byte views of ``payloads``: raw ones exactly a block, encoded ones (``codecs[i]`` != 0)
    shorter than a block (their header and checksum are checked when they are first decoded)."""
    if codecs is not None and len(codecs) != len(payloads):
        raise InvalidArgument("codecs", f"{len(codecs)} codec ids for {len(payloads)} payloads")
    arrays = [as_bytes(p) for p in payloads]
    for i, a in enumerate(arrays):
        encoded = codecs is not None and codecs[i] != 0
        if not encoded and a.nbytes != ns.block_bytes:
            raise WrongBlockSize(ns.block_bytes, a.nbytes, i)
        if encoded and not 0 < a.nbytes < ns.block_bytes:
            raise InvalidArgument("blocks", f"encoded payload {i} is {a.nbytes} bytes; it must be shorter "
                                            f"than a {ns.block_bytes}-byte block")
    return arrays


def put_chain(cascade: Cascade, ns: Namespace, hashes: Sequence[bytes], arrays: Sequence,
              parent: bytes | None, codecs: Sequence[int] | None = None) -> list[str]:
    """Store ``arrays[i]`` (encoded with ``codecs[i]``; None: all raw) under ``hashes[i]``, whose
    parent is ``hashes[i-1]`` (the first's is ``parent``). Per block "stored", "exists" or
    "persisted". Raises ``StoreFull`` if a block fits nowhere; blocks before it stay."""
    results: list[str] = []
    on_durable: list[int] = []  # indices of blocks written to the durable tier, not yet synced
    parents = [parent] + list(hashes[:-1])
    try:
        for i, (h, p, data) in enumerate(zip(hashes, parents, arrays)):
            if cascade.index.find(ns.id, h) is not None:  # checked again under the lock by reserve
                results.append("exists")
                continue
            codec = 0 if codecs is None else int(codecs[i])
            staged = StagedBlock(cascade.transcoder, BlockRecord(ns.id, h, p, data.nbytes, ns.block_bytes, codec),
                                 data)
            staged.placement(0)  # encode for the first tier tried before the lock is taken
            entry = cascade.reserve(ns.id, h, p, ns.block_bytes, 0, staged=staged)
            if entry is None:
                results.append("exists")
                continue
            t = entry.fastest
            placed = staged.placement(t)
            try:
                cascade.tiers[t].write_unsynced(entry.copies[t], placed.payload)
            except Exception:
                with cascade.lock:
                    cascade.drop_entry(entry)
                raise
            with cascade.lock:
                cascade.transcoder.count(t, placed, entry.raw_size)
            results.append("stored")
            if cascade.publish(entry, placed.payload):
                on_durable.append(len(results) - 1)
    finally:
        # blocks written before a failure stay; one directory sync covers the whole batch
        if on_durable and cascade.sync_durable():
            for i in on_durable:
                results[i] = "persisted"
    return results
