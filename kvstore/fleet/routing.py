"""Route answers: which live nodes hold the longest cached prefix of a request.

Only nodes whose signed entry verifies, and whose run no tombstone revokes, are ever named
(their id, address and epoch come from the directory's verified view); the block counts come from
the holders bitmaps, which the Redis ACL protects, not the fleet secret: a directory writer can
make a route say a verified node holds more than it does (a wasted fetch, then a miss), never
send anyone elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from itertools import repeat

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.fleet.records import HOLDER_PREFIX_BYTES
from kvstore.keys import MAX_HASH_BYTES, check_block_hash
from kvstore.redis_connection import call_packed, packed_hmget

MAX_ROUTE_HASHES = 8192
ROUTE_CHUNKS = (1024, 4096)  # HMGET sizes while some node still holds every block asked so far


@dataclasses.dataclass
class NodeRoute:
    """What one node can serve of a request: its leading cached blocks and where they sit."""

    node_id: str
    address: str
    blocks: int
    tokens: int | None            # blocks x block_tokens when the layout is known
    tiers: dict[str, int]         # "memory" (GPU/CPU) and "disk" (NVMe/Redis): blocks of the run in each
    slot: int = -1                # the node's slot in this namespace's directory
    epoch: int = 0                # the node's run its entry was signed for (it proves itself for it)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def leading_runs(values: list[bytes | None], slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per slot of ``slots`` (in that order): the length of its leading run of held blocks, and
    how many of those are on disk. Memory is bounded by the values and the highest slot asked for
    (below MAX_SLOTS), never by anything else read from Redis.

    Computed on the bitmaps as bytes, a row per block: the "holds" bits ANDed down the rows
    (a bit stays set while its slot's run lasts), then set bits counted per column; numpy's
    per-row overhead is what a route of 1024 blocks spent its time on, so every pass is over
    whole rows."""
    if None in values:                 # nobody holds that block: no run goes past it
        values = values[:values.index(None)]
    if not values or not slots:
        return np.zeros(len(slots), dtype=np.int64), np.zeros(len(slots), dtype=np.int64)
    width = HOLDER_PREFIX_BYTES + max(slots) // 4 + 1   # the bytes that carry the slots asked for
    lengths = set(map(len, values))
    if len(lengths) == 1 and (length := min(lengths)) >= width and length <= 2 * width:   # the usual case
        joined = b"".join(values)
    elif max(lengths) <= width:   # some shorter than others: padded (in C)
        joined, length = b"".join(map(bytes.ljust, values, repeat(width), repeat(b"\0"))), width
    else:                         # some longer than a row needs (a hostile writer's huge value): cut
        joined, length = b"".join(v[:width].ljust(width, b"\0") for v in values), width
    rows = np.frombuffer(joined, dtype=np.uint8).reshape(len(values), length)[:, HOLDER_PREFIX_BYTES:width]
    held = np.bitwise_and.accumulate(rows & _HOLD_BITS, axis=0)   # slot s's bit: block i is in its run
    disk = held & (rows >> 1)                                     # ... and on disk there
    counts = _column_counts(held | disk << 1)   # unpacked, bit 2s of a row is slot s's "holds", 2s+1 "on disk"
    at = 2 * np.asarray(slots)
    return counts[at], counts[at + 1]


_HOLD_BITS = 0x55   # the low bit of each slot's pair


def _column_counts(rows: np.ndarray) -> np.ndarray:
    """Set bits per bit column of a uint8 matrix (little-endian bit order within each byte),
    summed 255 rows at a time in uint8: no overflow, and no casting, which made one sum several
    times slower."""
    bits = np.unpackbits(rows, axis=1, bitorder="little")
    counts = np.zeros(bits.shape[1], dtype=np.int64)
    for at in range(0, len(bits), 255):
        counts += np.add.reduce(bits[at:at + 255], axis=0, dtype=np.uint8)
    return counts


def checked_hashes(hashes: Sequence[bytes]) -> Sequence[bytes]:
    """The request's hashes as bytes, or InvalidArgument naming the field."""
    if len(hashes) > MAX_ROUTE_HASHES:
        raise InvalidArgument("hashes", f"{len(hashes)} hashes; at most {MAX_ROUTE_HASHES} per route")
    lengths = set(map(len, hashes)) if set(map(type, hashes)) == {bytes} else {0}
    if min(lengths) < 1 or max(lengths) > MAX_HASH_BYTES:
        for h in hashes:
            check_block_hash(h)   # raises, naming the field
        return [bytes(h) for h in hashes]
    return hashes


def route(directory, namespace_id: bytes, hashes: Sequence[bytes],
          block_tokens: int | None = None) -> list[NodeRoute]:
    """Per verified live node holding at least the first block: how many leading blocks (and
    tokens) it can serve, and how many of those sit in memory vs on disk; longest first.
    Reads the nodes hash, the tombstones and the first 1024 blocks in one round trip, more only
    while some node still holds every block asked so far. ``directory`` is a ``Directory``."""
    if not hashes:
        return []
    hashes = checked_hashes(hashes)
    holders = directory.holders_key(namespace_id)
    nodes, values, revoked = _nodes_and_holders(directory, namespace_id, holders, hashes[:ROUTE_CHUNKS[0]])
    live = directory.live_nodes(namespace_id, nodes, revoked)
    if not live:
        return []
    slots = sorted(live)
    pos, step = len(values), 1
    while True:
        run, disk = leading_runs(values, slots)
        if pos >= len(hashes) or not (run == pos).any():
            break
        size = ROUTE_CHUNKS[min(step, len(ROUTE_CHUNKS) - 1)]
        values = values + _holders(directory.redis, holders, hashes[pos:pos + size])
        pos, step = len(values), step + 1
    routes = []
    for i, slot in enumerate(slots):
        n = int(run[i])
        if n:
            node_id, address, epoch = live[slot]
            d = int(disk[i])
            routes.append(NodeRoute(node_id, address, n, n * block_tokens if block_tokens else None,
                                    {"memory": n - d, "disk": d}, slot, epoch))
    routes.sort(key=lambda r: (-r.blocks, r.tiers["disk"], r.node_id))
    return routes


def _nodes_and_holders(directory, namespace_id: bytes, holders: str,
                       hashes: Sequence[bytes]) -> tuple[dict, list, dict]:
    """The nodes hash, the holders values of ``hashes`` and the tombstones, in one round trip:
    sent pre-packed where the client allows (``redis_connection.call_packed``), else as a pipeline."""
    nodes_key, revoked_key = directory.nodes_key(namespace_id), directory.revoked_key(namespace_id)
    packed = packed_hmget(holders, hashes)
    replies = call_packed(directory.redis, [("HGETALL", nodes_key), packed, ("HGETALL", revoked_key)]) \
        if packed else None
    if replies is None:
        pipe = directory.redis.pipeline(transaction=False)
        pipe.hgetall(nodes_key)
        pipe.hmget(holders, list(hashes))
        pipe.hgetall(revoked_key)
        return tuple(pipe.execute())
    nodes, values, revoked = replies
    return _as_dict(nodes), values, _as_dict(revoked)


def _as_dict(reply) -> dict:
    """RESP2 answers HGETALL with field, value, field, value ..."""
    return dict(zip(reply[::2], reply[1::2])) if isinstance(reply, list) else reply


def _holders(client, holders: str, hashes: Sequence[bytes]) -> list:
    packed = packed_hmget(holders, hashes)
    replies = call_packed(client, [packed]) if packed else None
    return replies[0] if replies is not None else client.hmget(holders, list(hashes))
