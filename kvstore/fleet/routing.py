"""Route answers: which live nodes hold the longest cached prefix of a request.

Only nodes whose signed entry verifies are ever named (their id and address come from the
directory's verified view); the block counts come from the holders bitmaps, which the Redis ACL
protects, not the fleet secret: a directory writer can make a route say a verified node holds
more than it does (a wasted fetch, then a miss), never send anyone elsewhere.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.fleet.records import bitmap_columns
from kvstore.keys import MAX_HASH_BYTES, check_block_hash

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

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def leading_runs(values: list[bytes | None], slots: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Per slot of ``slots`` (in that order): the length of its leading run of held blocks, and
    how many of those are on disk. Memory is bounded by the values and the highest slot asked for
    (below MAX_SLOTS), never by anything else read from Redis."""
    if None in values:                 # nobody holds that block: no run goes past it
        values = values[:values.index(None)]
    if not values or not slots:
        return np.zeros(len(slots), dtype=np.int64), np.zeros(len(slots), dtype=np.int64)
    columns, shifts = bitmap_columns(slots)
    width = max(columns) + 1
    rows = b"".join(v[:width].ljust(width, b"\0") for v in values)
    pairs = np.frombuffer(rows, dtype=np.uint8).reshape(len(values), width)[:, columns] >> np.array(shifts, np.uint8)
    hold = (pairs & 1).astype(bool)
    disk = (pairs & 2).astype(bool)
    run = np.where(hold.all(axis=0), len(values), hold.argmin(axis=0))
    in_run = np.arange(len(values))[:, None] < run[None, :]
    return run, (disk & in_run).sum(axis=0)


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
    Reads the nodes hash and the first 1024 blocks in one round trip, more only while some node
    still holds every block asked so far. ``directory`` is a ``Directory``."""
    if not hashes:
        return []
    hashes = checked_hashes(hashes)
    holders = directory.holders_key(namespace_id)
    pipe = directory.redis.pipeline(transaction=False)
    pipe.hgetall(directory.nodes_key(namespace_id))
    pipe.hmget(holders, list(hashes[:ROUTE_CHUNKS[0]]))
    nodes, values = pipe.execute()
    live = directory.live_nodes(namespace_id, nodes)
    if not live:
        return []
    slots = sorted(live)
    pos, step = len(values), 1
    while True:
        run, disk = leading_runs(values, slots)
        if pos >= len(hashes) or not (run == pos).any():
            break
        size = ROUTE_CHUNKS[min(step, len(ROUTE_CHUNKS) - 1)]
        values = values + directory.redis.hmget(holders, list(hashes[pos:pos + size]))
        pos, step = len(values), step + 1
    routes = []
    for i, slot in enumerate(slots):
        n = int(run[i])
        if n:
            node_id, address = live[slot]
            d = int(disk[i])
            routes.append(NodeRoute(node_id, address, n, n * block_tokens if block_tokens else None,
                                    {"memory": n - d, "disk": d}, slot))
    routes.sort(key=lambda r: (-r.blocks, r.tiers["disk"], r.node_id))
    return routes
