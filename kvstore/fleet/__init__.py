"""Fleet mode: a Redis directory of who holds which block, peer fetch, and KV-aware routing.

A fleet is many daemons, one per inference node. Each daemon publishes the blocks its Store holds
to a directory in Redis; any daemon (or a router) can then ask which node holds the longest cached
prefix of a request, and a daemon that misses locally can fetch the blocks from a peer instead of
letting its engine recompute them.

Directory layout. Every key of one namespace shares the hash tag ``{<namespace hex>}``, so in a
Redis Cluster a namespace lives in one slot and its scripts touch only declared, co-located keys:

* ``<prefix>:{<ns>}:holders`` — HASH, field = raw block hash, value = the xxh3_64 of the block's
  bytes (8 bytes, little-endian) followed by a bitmap with two bits per node *slot*: "holds it" and
  "its copy is on disk (NVMe/Redis) rather than in GPU/CPU memory". A block held by 100 nodes is
  one field of ~33 bytes, so replicated prefixes (system prompts) cost almost nothing, and
  ``route`` is a single HMGET whose cost does not grow with the number of nodes.
* ``<prefix>:{<ns>}:nodes`` — HASH, field = slot number, value = ``"<expiry ms> <node id>
  <address>"``. A node takes the lowest free slot when it joins and refreshes its expiry with each
  heartbeat. A slot whose expiry has passed no longer counts anywhere (route, peer fetch) even
  before its bits are cleared; expiry 0 marks a slot dead for good (node closed, restarted, or
  swept). A janitor (any live node, under a lock, every few heartbeats) clears dead slots' bits
  and frees the slot. Both keys carry a long TTL refreshed by heartbeats, so a namespace whose
  whole fleet is gone disappears too.

Checksums: the first holder's checksum is the block's. A node whose bytes for the same hash
differ (non-deterministic kernels) is not advertised as a holder (``checksum_conflicts``), so a
fetcher can always verify what it receives against one published value.

Publishing: the Store calls ``blocks_added`` / ``blocks_removed`` with its lock held, so the
listener only appends to a queue. One background thread drains it: it pins each new block just
long enough to checksum it (zero-copy for the CPU arena, the recorded checksum for NVMe), keeps a
local mirror of what it published, and sends the delta in batched Lua calls. If Redis fails or
comes back empty (restart, failover, flush), the node joins again under a fresh slot and
republishes its mirror; the daemon keeps serving locally meanwhile. Peer fetch and routing degrade
to "no peers".

Peer fetch (``Fleet.lookup`` / ``Fleet.fetch``) runs in the daemon, not the client: every engine
gets it through one code path, the fetched copy lands in the local Store where all local workers
reuse it, clients need no Redis credentials, and a peer's bytes are checked against the published
checksum before a single byte is stored or served.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np
import xxhash

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import MAX_HASH_BYTES, ChainHasher, check_block_hash
from kvstore.redis_connection import connect  # noqa: F401 - re-exported: kvstore.fleet.connect
from kvstore.store import Lookup, Store, StoreListener

log = logging.getLogger("kvstore.fleet")

TIER_CODES = {"gpu": 0, "cpu": 1, "nvme": 2, "redis": 3}   # >= 2: "disk" in the holders bitmap
MAX_ROUTE_HASHES = 8192
PUBLISH_CHUNK = 256          # entries per Lua call: bounds how long one call holds Redis (~0.5 ms)
ROUTE_CHUNKS = (1024, 4096)  # HMGET sizes while some node still holds every block asked so far

# KEYS[1] holders. ARGV: slot, 'a' (add) | 'r' (remove), hash length, packed hashes,
# packed 9-byte values (checksum LE + tier code) for adds. Returns the number of checksum conflicts.
_PUBLISH_LUA = """
local slot = tonumber(ARGV[1])
local add = ARGV[2] == 'a'
local L = tonumber(ARGV[3])
local hs = ARGV[4]
local vs = ARGV[5]
local bi = 9 + math.floor(slot / 4)
local shift = (slot % 4) * 2
local both = bit.lshift(3, shift)
local hold = bit.lshift(1, shift)
local conflicts = 0
for i = 0, #hs / L - 1 do
  local h = string.sub(hs, i * L + 1, (i + 1) * L)
  local v = redis.call('HGET', KEYS[1], h)
  if add then
    local cs = string.sub(vs, i * 9 + 1, i * 9 + 8)
    local flag = hold
    if string.byte(vs, i * 9 + 9) >= 2 then flag = both end
    local skip = false
    if not v then
      v = cs
    elseif string.sub(v, 1, 8) ~= cs then
      if string.find(v, '[^%z]', 9) then
        skip = true
        conflicts = conflicts + 1
      else
        v = cs .. string.sub(v, 9)
      end
    end
    if not skip then
      if #v < bi then v = v .. string.rep('\\0', bi - #v) end
      local b = bit.bor(bit.band(string.byte(v, bi), bit.bnot(both)), flag)
      redis.call('HSET', KEYS[1], h, string.sub(v, 1, bi - 1) .. string.char(b) .. string.sub(v, bi + 1))
    end
  elseif v and #v >= bi then
    local b = bit.band(string.byte(v, bi), bit.bnot(both))
    v = string.sub(v, 1, bi - 1) .. string.char(b) .. string.sub(v, bi + 1)
    if string.find(v, '[^%z]', 9) then
      redis.call('HSET', KEYS[1], h, v)
    else
      redis.call('HDEL', KEYS[1], h)
    end
  end
end
return conflicts
"""

# KEYS[1] holders. ARGV: hash length, packed hashes, dead slots... Clears those slots' bits.
_SWEEP_LUA = """
local L = tonumber(ARGV[1])
local hs = ARGV[2]
local cleared = 0
for i = 0, #hs / L - 1 do
  local h = string.sub(hs, i * L + 1, (i + 1) * L)
  local v = redis.call('HGET', KEYS[1], h)
  if v then
    local changed = false
    for j = 3, #ARGV do
      local slot = tonumber(ARGV[j])
      local bi = 9 + math.floor(slot / 4)
      local mask = bit.lshift(3, (slot % 4) * 2)
      if #v >= bi and bit.band(string.byte(v, bi), mask) ~= 0 then
        v = string.sub(v, 1, bi - 1) .. string.char(bit.band(string.byte(v, bi), bit.bnot(mask))) .. string.sub(v, bi + 1)
        changed = true
      end
    end
    if changed then
      cleared = cleared + 1
      if string.find(v, '[^%z]', 9) then redis.call('HSET', KEYS[1], h, v) else redis.call('HDEL', KEYS[1], h) end
    end
  end
end
return cleared
"""

# KEYS[1] nodes. ARGV: node id, value. Marks earlier incarnations of the node dead, takes the
# lowest free slot. Returns the slot.
_JOIN_LUA = """
local all = redis.call('HGETALL', KEYS[1])
local used = {}
for i = 1, #all, 2 do
  used[tonumber(all[i])] = true
  local v = all[i + 1]
  local sp1 = string.find(v, ' ', 1, true)
  local sp2 = string.find(v, ' ', sp1 + 1, true)
  if sp1 and sp2 and string.sub(v, sp1 + 1, sp2 - 1) == ARGV[1] then
    redis.call('HSET', KEYS[1], all[i], '0' .. string.sub(v, sp1))
  end
end
local s = 0
while used[s] do s = s + 1 end
redis.call('HSET', KEYS[1], tostring(s), ARGV[2])
return s
"""

# KEYS[1] nodes, KEYS[2] holders. ARGV: slot, new value, keep ms. Refreshes the slot's expiry if
# it is still this node's and alive; 0 means "your slot is gone: join again and republish".
_HEARTBEAT_LUA = """
local v = redis.call('HGET', KEYS[1], ARGV[1])
local ok = 0
if v then
  local sp = string.find(v, ' ', 1, true)
  local sp_new = string.find(ARGV[2], ' ', 1, true)
  if sp and string.sub(v, sp) == string.sub(ARGV[2], sp_new) and tonumber(string.sub(v, 1, sp - 1)) > 0 then
    redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
    ok = 1
  end
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[2], ARGV[3])
return ok
"""

# KEYS[1] nodes. ARGV: now ms, grace ms. Marks slots expired for longer than grace as dead
# (expiry 0) and returns every dead slot.
_CLAIM_DEAD_LUA = """
local all = redis.call('HGETALL', KEYS[1])
local dead = {}
local limit = tonumber(ARGV[1]) - tonumber(ARGV[2])
for i = 1, #all, 2 do
  local v = all[i + 1]
  local sp = string.find(v, ' ', 1, true)
  local exp = tonumber(string.sub(v, 1, sp - 1))
  if exp < limit then
    if exp > 0 then redis.call('HSET', KEYS[1], all[i], '0' .. string.sub(v, sp)) end
    dead[#dead + 1] = all[i]
  end
end
return dead
"""


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


def pack_entry(checksum: int, tier: str) -> bytes:
    """The mirror's (and publish script's) value for one block: checksum LE + tier code."""
    return checksum.to_bytes(8, "little") + bytes([TIER_CODES.get(tier, 2)])


def _now_ms() -> int:
    """Wall-clock ms. Expiries are written and read with each node's own clock: NTP-level skew
    (milliseconds) is negligible next to ttl_s (seconds)."""
    return int(time.time() * 1000)


def node_value(node_id: str, address: str, ttl_s: float) -> str:
    """The nodes-hash value: when this slot stops counting as alive (ms since epoch), who, where."""
    return f"{_now_ms() + int(ttl_s * 1000)} {node_id} {address}"


def _marks(value: bytes | None, slot: int) -> bool:
    """Whether either of ``slot``'s two bits is set in a holders value."""
    i = 8 + slot // 4
    return value is not None and len(value) > i and bool(value[i] >> ((slot % 4) * 2) & 3)


def _holds(value: bytes | None, slot: int) -> bool:
    i = 8 + slot // 4
    return value is not None and len(value) > i and bool(value[i] >> ((slot % 4) * 2) & 1)


class _Batch:
    """Commands sent together: one pipeline on a standalone Redis; one by one on a cluster, whose
    redis-py pipeline refuses scripts (a namespace's keys share a slot, so order is preserved)."""

    def __init__(self, redis, cluster: bool) -> None:
        self.redis = redis
        self.pipe = None if cluster else redis.pipeline(transaction=False)
        self.results: list = []

    def script(self, script, keys: list, args: list) -> None:
        if self.pipe is None:
            self.results.append(script(keys=keys, args=args))
        else:
            script(keys=keys, args=args, client=self.pipe)

    def call(self, command: str, *args) -> None:
        if self.pipe is None:
            self.results.append(getattr(self.redis, command)(*args))
        else:
            getattr(self.pipe, command)(*args)

    def execute(self) -> list:
        return self.results if self.pipe is None else self.pipe.execute()


class Directory:
    """The Redis side of the fleet: key names and every script. Holds no Store, so a router or
    ``kvstore route`` can use it on its own."""

    def __init__(self, redis_url: str, key_prefix: str = "kvs", socket_timeout_s: float = 0.5,
                 client=None, keep_s: float = 600.0) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise InvalidArgument("key_prefix", "must be non-empty and contain no braces")
        self.prefix = key_prefix
        self.keep_ms = int(keep_s * 1000)   # TTL of a namespace's keys, pushed forward by every write
        self.redis = client if client is not None else connect(redis_url, socket_timeout_s)
        self._cluster = type(self.redis).__name__ == "RedisCluster"
        self._publish = self.redis.register_script(_PUBLISH_LUA)
        self._sweep = self.redis.register_script(_SWEEP_LUA)
        self._join = self.redis.register_script(_JOIN_LUA)
        self._heartbeat = self.redis.register_script(_HEARTBEAT_LUA)
        self._claim_dead = self.redis.register_script(_CLAIM_DEAD_LUA)

    def _batch(self) -> "_Batch":
        return _Batch(self.redis, self._cluster)

    def _tag(self, namespace_id: bytes) -> str:
        return f"{self.prefix}:{{{namespace_id.hex()}}}"

    def holders_key(self, namespace_id: bytes) -> str:
        return self._tag(namespace_id) + ":holders"

    def nodes_key(self, namespace_id: bytes) -> str:
        return self._tag(namespace_id) + ":nodes"

    def janitor_key(self, namespace_id: bytes) -> str:
        return self._tag(namespace_id) + ":janitor"

    # -- membership ------------------------------------------------------------------------------

    def join(self, namespace_id: bytes, node_id: str, address: str, ttl_s: float) -> int:
        """Take a slot in this namespace (earlier incarnations of ``node_id`` become dead)."""
        batch = self._batch()
        batch.script(self._join, [self.nodes_key(namespace_id)], [node_id, node_value(node_id, address, ttl_s)])
        batch.call("pexpire", self.nodes_key(namespace_id), self.keep_ms)
        return int(batch.execute()[0])

    def heartbeat(self, beats: Sequence[tuple[bytes, int]], node_id: str, address: str,
                  ttl_s: float) -> list[bool]:
        """Refresh this node's slots, one per namespace; False where the slot is gone."""
        batch = self._batch()
        value = node_value(node_id, address, ttl_s)
        for ns, slot in beats:
            batch.script(self._heartbeat, [self.nodes_key(ns), self.holders_key(ns)], [slot, value, self.keep_ms])
        return [bool(x) for x in batch.execute()]

    def leave(self, namespace_id: bytes, slot: int, hashes: Sequence[bytes]) -> None:
        """Withdraw ``hashes`` from ``slot`` and free it (a clean shutdown)."""
        self.publish(namespace_id, slot, {h: None for h in hashes})
        self.redis.hdel(self.nodes_key(namespace_id), str(slot))

    # -- entries ---------------------------------------------------------------------------------

    def publish(self, namespace_id: bytes, slot: int, changes: dict[bytes, bytes | None]) -> int:
        """Set (value = ``pack_entry``) or clear (None) ``slot``'s bit for each block hash, in
        bounded Lua calls pipelined together. Returns how many adds hit a checksum conflict."""
        key = self.holders_key(namespace_id)
        batch = self._batch()
        groups: dict[tuple[bool, int], list[tuple[bytes, bytes | None]]] = collections.defaultdict(list)
        for h, v in changes.items():
            groups[(v is not None, len(h))].append((h, v))
        for (is_add, length), items in groups.items():
            for i in range(0, len(items), PUBLISH_CHUNK):
                chunk = items[i:i + PUBLISH_CHUNK]
                batch.script(self._publish, [key], [
                    slot, "a" if is_add else "r", length, b"".join(h for h, _ in chunk),
                    b"".join(v for _, v in chunk) if is_add else b""])
        batch.call("pexpire", key, self.keep_ms)
        results = batch.execute()
        return int(sum(results[:-1]))

    def sweep(self, namespace_id: bytes, grace_s: float, lock_s: float = 60.0) -> int:
        """Janitor: clear the bits of slots dead for longer than ``grace_s`` and free them.
        One sweeper at a time per namespace (a lock with a TTL). Returns entries cleared."""
        if not self.redis.set(self.janitor_key(namespace_id), "1", nx=True, px=int(lock_s * 1000)):
            return 0
        try:
            dead = self._claim_dead(keys=[self.nodes_key(namespace_id)], args=[_now_ms(), int(grace_s * 1000)])
            if not dead:
                return 0
            cleared = 0
            key = self.holders_key(namespace_id)
            dead_slots = [int(x) for x in dead]
            for page in self._scan_pages(key):
                by_len: dict[int, list[bytes]] = collections.defaultdict(list)
                for f, v in page.items():   # only fields a dead slot still marks go to the script
                    if any(_marks(v, s) for s in dead_slots):
                        by_len[len(f)].append(f)
                for length, group in by_len.items():
                    cleared += int(self._sweep(keys=[key], args=[length, b"".join(group), *dead]))
            self.redis.hdel(self.nodes_key(namespace_id), *dead)
            return cleared
        finally:
            self.redis.delete(self.janitor_key(namespace_id))

    def _scan_pages(self, key: str, count: int = 2000):
        cursor = 0
        while True:
            cursor, page = self.redis.hscan(key, cursor, count=count)
            if page:
                yield page
            if cursor == 0:
                return

    # -- queries ---------------------------------------------------------------------------------

    def _live_slots(self, nodes: dict, now_ms: int) -> dict[int, tuple[str, str]]:
        live = {}
        for slot, v in nodes.items():
            expiry, node_id, address = v.decode().split(" ", 2)
            if int(expiry) >= now_ms:
                live[int(slot)] = (node_id, address)
        return live

    def route(self, namespace_id: bytes, hashes: Sequence[bytes],
              block_tokens: int | None = None) -> list[NodeRoute]:
        """Per live node holding at least the first block: how many leading blocks (and tokens)
        it can serve, and how many of those sit in memory vs on disk; longest first.
        Reads the nodes hash and the first 1024 blocks in one round trip, more only while some node
        still holds every block asked so far."""
        if len(hashes) > MAX_ROUTE_HASHES:
            raise InvalidArgument("hashes", f"{len(hashes)} hashes; at most {MAX_ROUTE_HASHES} per route")
        if not hashes:
            return []
        lengths = set(map(len, hashes)) if set(map(type, hashes)) == {bytes} else {0}
        if min(lengths) < 1 or max(lengths) > MAX_HASH_BYTES:
            for h in hashes:
                check_block_hash(h)   # raises, naming the field
            hashes = [bytes(h) for h in hashes]
        holders = self.holders_key(namespace_id)
        pipe = self.redis.pipeline(transaction=False)
        pipe.hgetall(self.nodes_key(namespace_id))
        pipe.hmget(holders, list(hashes[:ROUTE_CHUNKS[0]]))
        nodes, values = pipe.execute()
        live = self._live_slots(nodes, _now_ms())
        if not live:
            return []
        pos, step = len(values), 1
        while True:
            run, disk = _runs(values, max(live) + 1)
            if pos >= len(hashes) or not any(run[s] == pos for s in live):
                break
            size = ROUTE_CHUNKS[min(step, len(ROUTE_CHUNKS) - 1)]
            values = values + self.redis.hmget(holders, list(hashes[pos:pos + size]))
            pos, step = len(values), step + 1
        routes = []
        for slot, (node_id, address) in live.items():
            n = int(run[slot])
            if n:
                d = int(disk[slot])
                routes.append(NodeRoute(node_id, address, n, n * block_tokens if block_tokens else None,
                                        {"memory": n - d, "disk": d}, slot))
        routes.sort(key=lambda r: (-r.blocks, r.tiers["disk"], r.node_id))
        return routes

    def checksums(self, namespace_id: bytes, slot: int, hashes: Sequence[bytes]) -> list[int | None]:
        """The published checksum of each block that ``slot`` holds (None where it does not)."""
        if not hashes:
            return []
        values = self.redis.hmget(self.holders_key(namespace_id), list(hashes))
        return [int.from_bytes(v[:8], "little") if _holds(v, slot) else None for v in values]

    def entries(self, namespace_id: bytes, node_id: str) -> int:
        """How many blocks the live slots of ``node_id`` hold (a full scan: tests and tools)."""
        live = self._live_slots(self.redis.hgetall(self.nodes_key(namespace_id)), _now_ms())
        slots = [s for s, (n, _) in live.items() if n == node_id]
        if not slots:
            return 0
        count = 0
        for _, v in self.redis.hscan_iter(self.holders_key(namespace_id), count=1000):
            count += any(_holds(v, s) for s in slots)
        return count

    def close(self) -> None:
        try:
            self.redis.close()
        except Exception:  # noqa: BLE001 - closing a broken connection is not an error
            pass


def _runs(values: list[bytes | None], nslots: int) -> tuple[np.ndarray, np.ndarray]:
    """Per slot: the length of its leading run of held blocks, and how many of those are on disk."""
    if None in values:                 # nobody holds that block: no run goes past it
        values = values[:values.index(None)]
    if not values:
        return np.zeros(nslots, dtype=np.int64), np.zeros(nslots, dtype=np.int64)
    width = (nslots + 3) // 4
    rows = b"".join((v[8:8 + width] if v else b"").ljust(width, b"\0") for v in values)
    bits = np.unpackbits(np.frombuffer(rows, dtype=np.uint8).reshape(len(values), width), axis=1,
                         bitorder="little")
    hold = bits[:, 0::2].astype(bool)[:, :nslots]
    disk = bits[:, 1::2].astype(bool)[:, :nslots]
    full = hold.all(axis=0)
    run = np.where(full, len(values), hold.argmin(axis=0))
    in_run = np.arange(len(values))[:, None] < run[None, :]
    return run, (disk & in_run).sum(axis=0)


def _default_client_factory(token: str | None, timeout_s: float) -> Callable[[str], object]:
    def make(address: str):
        from kvstore.client import Client
        return Client(url=address, token=token, timeout_s=timeout_s, transport="grpc", retries=0)
    return make


class Fleet(StoreListener):
    """One daemon's membership in a fleet. Construct from config, ``start()``, ``close()``.

    The daemon wires it in two places: ``store`` is the daemon's Store (the Fleet registers itself
    as a listener), and the Lookup path calls ``fleet.lookup`` instead of ``store.lookup`` so a
    local miss is filled from a peer before the answer goes back."""

    def __init__(self, store: Store, redis_url: str, node_id: str, advertise_addr: str, *,
                 key_prefix: str = "kvs", heartbeat_s: float = 2.0, ttl_s: float = 10.0,
                 flush_interval_s: float = 0.02, sweep_every: int = 10, peer_token: str | None = None,
                 peer_timeout_s: float = 2.0, peer_fetch: bool = True, fetch_batch: int = 64,
                 socket_timeout_s: float = 0.5, shared_pool=None,
                 client_factory: Callable[[str], object] | None = None) -> None:
        if not node_id or any(c in node_id for c in " {}"):
            raise InvalidArgument("fleet.node_id", "must be non-empty, without spaces or braces")
        if not advertise_addr or " " in advertise_addr:
            raise InvalidArgument("fleet.advertise_addr", "must be a host:port peers can reach")
        if not 0 < heartbeat_s < ttl_s:
            raise InvalidArgument("fleet.ttl_s", f"must exceed heartbeat_s ({heartbeat_s}); got {ttl_s}")
        self.store = store
        self.node_id = node_id
        self.advertise_addr = advertise_addr
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self.flush_interval_s = flush_interval_s
        self.sweep_every = sweep_every
        self.peer_fetch_enabled = peer_fetch
        self.fetch_batch = fetch_batch
        # a namespace's keys outlive the last heartbeat of the whole fleet by keep_s
        self.directory = Directory(redis_url, key_prefix, socket_timeout_s, keep_s=max(60.0, 10 * ttl_s))
        self.shared_pool = shared_pool                     # a RedisTier shared by the fleet, or None
        self._client_factory = client_factory or _default_client_factory(peer_token, peer_timeout_s)
        self._clients: dict[str, object] = {}
        self._registered: set[tuple[str, bytes]] = set()
        self._clients_lock = threading.Lock()
        self._suspects: dict[str, float] = {}       # node id -> until when we skip it
        self._events: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._mirror: dict[bytes, dict[bytes, bytes]] = {}   # ns -> hash -> pack_entry: what we publish
        self._slots: dict[bytes, int] = {}                   # ns -> our slot in its directory
        self._resync = True                                  # (re)join and publish the whole mirror
        self._thread: threading.Thread | None = None
        self._scratch = np.empty(0, dtype=np.uint8)
        self.counters: dict[str, int] = collections.defaultdict(int)
        self.connected = True   # until the publisher thread fails to reach Redis

    # -- StoreListener (called with the store lock held: enqueue only) ---------------------------

    def blocks_added(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        self._events.append((True, namespace_id, list(block_hashes)))
        self._idle.clear()
        self._wake.set()

    def blocks_removed(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        self._events.append((False, namespace_id, list(block_hashes)))
        self._idle.clear()
        self._wake.set()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> "Fleet":
        for ns, hashes in self.store.subscribe(self).items():
            self._events.append((True, ns, hashes))  # events that race this are re-checked on drain
        self._thread = threading.Thread(target=self._run, name="kvstore-fleet", daemon=True)
        self._thread.start()
        self._wake.set()
        return self

    def close(self, unpublish: bool = True) -> None:
        """Stop publishing; by default also withdraw this node's entries so peers stop routing here."""
        self.store.unsubscribe(self)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if unpublish:
            try:
                for ns, slot in self._slots.items():
                    self.directory.leave(ns, slot, list(self._mirror.get(ns, ())))
            except Exception as e:  # noqa: BLE001 - Redis down at shutdown: the slot expires anyway
                log.info("fleet: could not withdraw entries at close (%s); they expire in %ss", e, self.ttl_s)
        with self._clients_lock:
            for c in self._clients.values():
                try:
                    c.close()
                except Exception:  # noqa: BLE001
                    pass
            self._clients.clear()
        self.directory.close()

    def wait_published(self, timeout_s: float = 10.0) -> bool:
        """Block until every store event so far is in Redis (tests, graceful drains)."""
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._idle.wait(timeout=0.05) and not self._events and not self._resync:
                return True
        return False

    # -- the background thread -------------------------------------------------------------------

    def _run(self) -> None:
        next_beat = 0.0
        backoff = 0.05
        while not self._stop.is_set():
            now = time.monotonic()
            self._wake.wait(timeout=max(0.0, min(next_beat - now, 1.0)))
            if self._stop.is_set():
                break
            if self._wake.is_set() and len(self._events) < 256:
                time.sleep(self.flush_interval_s)  # let a burst coalesce into one pipeline
            self._wake.clear()
            delta = self._drain()
            try:
                if self._resync:
                    self._republish()
                elif delta:
                    self._push(delta)
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + self.heartbeat_s
                self.connected = True
                backoff = 0.05
                if not self._events:
                    self._idle.set()
            except Exception as e:  # noqa: BLE001 - Redis down: keep serving, republish later
                if self.connected or self.counters["redis_errors"] == 0:
                    log.warning("fleet: directory unreachable (%s); serving locally, will republish", e)
                self.connected = False
                self._resync = True
                self.counters["redis_errors"] += 1
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.heartbeat_s)
                self._wake.set()

    def _drain(self) -> dict[bytes, dict[bytes, bytes | None]]:
        """Apply queued store events to the mirror; return what changed (None = withdrawn)."""
        delta: dict[bytes, dict[bytes, bytes | None]] = collections.defaultdict(dict)
        while self._events:
            added, ns, hashes = self._events.popleft()
            mine = self._mirror.setdefault(ns, {})
            for h in hashes:
                value = self._describe(ns, h) if added else None
                if value is None:
                    if mine.pop(h, None) is not None or not added:
                        delta[ns][h] = None
                else:
                    mine[h] = value
                    delta[ns][h] = value
        return delta

    def _describe(self, ns: bytes, h: bytes) -> bytes | None:
        """Checksum and tier of a block, read under a short pin; None if it is already gone."""
        with self.store.pinned(ns, h) as block:
            if block is None:
                return None
            record = block.record
            try:
                if record.checksum and record.codec == 0 and record.stored_size == record.raw_size:
                    checksum = record.checksum          # NVMe keeps the payload's xxh3_64 in its header
                elif (pieces := block.pieces()) is not None:
                    x = xxhash.xxh3_64()                # zero-copy over the arena, under the pin
                    for piece in pieces:
                        x.update(piece)
                    checksum = x.intdigest()
                else:
                    if self._scratch.nbytes < record.stored_size:
                        self._scratch = np.empty(record.stored_size, dtype=np.uint8)
                    n = block.read_into(self._scratch)
                    checksum = xxhash.xxh3_64_intdigest(self._scratch[:n])
                self.counters["checksummed"] += 1
                return pack_entry(checksum, block.tier)
            except Exception as e:  # noqa: BLE001 - a block we cannot read is not advertised
                self.counters["describe_failures"] += 1
                log.debug("fleet: cannot checksum block %s: %s", h.hex(), e)
                return None

    def _join(self, ns: bytes) -> int:
        slot = self.directory.join(ns, self.node_id, self.advertise_addr, self.ttl_s)
        self._slots[ns] = slot
        self.counters["joins"] += 1
        return slot

    def _push(self, delta: dict[bytes, dict[bytes, bytes | None]]) -> None:
        for ns, changes in delta.items():
            slot = self._slots.get(ns)
            if slot is None:
                slot = self._join(ns)
            self.counters["checksum_conflicts"] += self.directory.publish(ns, slot, changes)
            self.counters["published"] += sum(1 for v in changes.values() if v is not None)
            self.counters["withdrawn"] += sum(1 for v in changes.values() if v is None)
        self.counters["pushes"] += 1

    def _republish(self, namespaces: Sequence[bytes] | None = None) -> None:
        """Join under a fresh slot and publish the whole mirror (first start, Redis restarted or
        unreachable for a while: what Redis holds for the old slot may be stale or gone)."""
        for ns in list(self._mirror) if namespaces is None else namespaces:
            slot = self._join(ns)
            self.counters["checksum_conflicts"] += self.directory.publish(ns, slot, dict(self._mirror[ns]))
        self._resync = False
        self.counters["republishes"] += 1

    def _heartbeat(self) -> None:
        """Refresh our slots; a slot that vanished (Redis restarted, flushed, or we were presumed
        dead) means joining again and republishing. Every ``sweep_every`` beats, sweep dead slots."""
        beats = list(self._slots.items())
        if not beats:
            self.directory.redis.ping()   # nothing published yet: still notice a dead Redis
            return
        alive = self.directory.heartbeat(beats, self.node_id, self.advertise_addr, self.ttl_s)
        lost = [ns for (ns, _), ok in zip(beats, alive) if not ok]
        if lost:
            self.counters["slots_lost"] += len(lost)
            log.info("fleet: directory lost our entries for %d namespace(s); republishing", len(lost))
            self._republish(lost)
        self.counters["heartbeats"] += 1
        if self.counters["heartbeats"] % self.sweep_every == 0:
            for ns, _ in beats:
                self.counters["swept_entries"] += self.directory.sweep(ns, grace_s=self.ttl_s)

    # -- routing ---------------------------------------------------------------------------------

    def route(self, namespace_id: bytes, hashes: Sequence[bytes] | None = None, *,
              token_ids: Sequence[int] | None = None, hasher: ChainHasher | None = None) -> list[NodeRoute]:
        """Per node, the leading blocks/tokens of this request it holds, longest first.
        Give block ``hashes`` or ``token_ids`` (hashed here with ``hasher``, default xxh3_128
        seed 0 — it must match what the engine's connector uses). Redis down -> []."""
        block_tokens = self._block_tokens(namespace_id)
        if hashes is None:
            if token_ids is None:
                raise InvalidArgument("hashes", "give block hashes or token_ids")
            if block_tokens is None:
                raise InvalidArgument("namespace_id", "unknown here; route by hashes or register it")
            hashes = (hasher or ChainHasher()).chain(token_ids, block_tokens)
        try:
            return self.directory.route(namespace_id, hashes, block_tokens)
        except KVStoreError:
            raise
        except Exception as e:  # noqa: BLE001 - the directory is advice: no answer, not an error
            self.counters["route_errors"] += 1
            log.debug("fleet: route failed: %s", e)
            return []

    def _block_tokens(self, namespace_id: bytes) -> int | None:
        try:
            return self.store.namespace(namespace_id).layout.block_tokens
        except KVStoreError:
            return None

    # -- peer fetch ------------------------------------------------------------------------------

    def lookup(self, namespace_id: bytes, hashes: Sequence[bytes], lease: bool = True) -> Lookup:
        """``store.lookup``, but a local miss is first filled from peers (when fleet mode is on)."""
        result = self.store.lookup(namespace_id, hashes, lease=lease)
        if result.num_hit < len(hashes) and self.peer_fetch_enabled:
            first = result.num_hit
            parent = hashes[first - 1] if first else None
            if self.fetch(namespace_id, hashes[first:], parent=parent):
                result = self.store.lookup(namespace_id, hashes, lease=lease)
        return result

    def fetch(self, namespace_id: bytes, hashes: Sequence[bytes], parent: bytes | None = None) -> int:
        """Copy the leading blocks of ``hashes`` from peers into the local store; returns how many
        leading blocks are now local. A block whose bytes do not match the checksum its owner
        published is never stored (counted as ``peer_checksum_mismatch``); the run stops there."""
        hashes = list(hashes)
        if not hashes:
            return 0
        if not self.connected:   # the publisher saw Redis fail: do not make every miss wait for it
            self.counters["fetch_skipped_disconnected"] += 1
            return 0
        got = self._fetch_from_pool(namespace_id, hashes, parent) if self.shared_pool is not None else 0
        if got == len(hashes):
            self.counters["fetched_blocks"] += got
            return got
        try:
            routes = self.directory.route(namespace_id, hashes)
        except Exception as e:  # noqa: BLE001
            self.counters["fetch_directory_errors"] += 1
            log.debug("fleet: directory unavailable for fetch: %s", e)
            return got
        now = time.monotonic()
        for r in routes:
            if r.node_id == self.node_id or r.blocks <= got or self._suspects.get(r.node_id, 0) > now:
                continue
            got += self._fetch_from(r, namespace_id, hashes[got:r.blocks], hashes[got - 1] if got else parent)
            if got == len(hashes):
                break
        self.counters["fetched_blocks"] += got
        if got:
            self.counters["fetches"] += 1
        return got

    def _fetch_from_pool(self, ns: bytes, hashes: list[bytes], parent: bytes | None) -> int:
        """The leading blocks found in the shared Redis pool (verified there), stored locally."""
        try:
            datas = self.shared_pool.load(ns, hashes)
        except Exception as e:  # noqa: BLE001
            self.counters["pool_errors"] += 1
            log.debug("fleet: shared pool unavailable: %s", e)
            return 0
        run = 0
        while run < len(datas) and datas[run] is not None:
            run += 1
        if not run:
            return 0
        try:
            self.store.put(ns, hashes[:run], datas[:run], parent=parent)
        except KVStoreError as e:
            self.counters["pool_errors"] += 1
            log.info("fleet: could not keep blocks from the shared pool: %s", e)
            return 0
        self.counters["pool_blocks"] += run
        return run

    def _peer(self, address: str, ns: bytes):
        """A client for the peer, with the namespace registered there (the Client needs its layout)."""
        with self._clients_lock:
            client = self._clients.get(address)
            if client is None:
                client = self._client_factory(address)
                self._clients[address] = client
            if (address, ns) not in self._registered and hasattr(client, "register_namespace"):
                got = client.register_namespace(self.store.namespace(ns))
                if got != ns:
                    raise InvalidArgument("fleet.peer_token", f"peer {address} files this namespace under "
                                          "another tenant; give the fleet a token of the same tenant")
                self._registered.add((address, ns))
            return client

    def _fetch_from(self, route: NodeRoute, ns: bytes, want: list[bytes], parent: bytes | None) -> int:
        """Fetch ``want`` from one peer in batches, verifying each block; returns blocks stored."""
        stored = 0
        try:
            expected = self.directory.checksums(ns, route.slot, want)
            client = self._peer(route.address, ns)
            for i in range(0, len(want), self.fetch_batch):
                batch = want[i:i + self.fetch_batch]
                datas = client.get(ns, batch)
                run_h, run_d = [], []
                for h, data, want_sum in zip(batch, datas, expected[i:i + len(batch)]):
                    if data is None or want_sum is None:
                        self.counters["peer_misses"] += 1
                        break
                    if xxhash.xxh3_64_intdigest(data) != want_sum:
                        self.counters["peer_checksum_mismatch"] += 1
                        log.warning("fleet: block %s from %s failed its published checksum; not stored",
                                    h.hex(), route.node_id)
                        break
                    run_h.append(h)
                    run_d.append(data)
                if run_h:
                    self.store.put(ns, run_h, run_d, parent=want[i - 1] if i else parent)
                    stored += len(run_h)
                    parent = run_h[-1]
                if len(run_h) < len(batch):
                    break
        except KVStoreError as e:
            self.counters["peer_errors"] += 1
            self._suspects[route.node_id] = time.monotonic() + self.heartbeat_s
            log.info("fleet: peer %s at %s failed: %s", route.node_id, route.address, e)
        except Exception as e:  # noqa: BLE001 - a broken peer or directory is a miss, never a crash
            self.counters["peer_errors"] += 1
            self._suspects[route.node_id] = time.monotonic() + self.heartbeat_s
            log.info("fleet: fetch from %s failed: %s", route.node_id, e)
        return stored

    def stats(self) -> dict:
        return {"node_id": self.node_id, "connected": self.connected,
                "namespaces": len(self._mirror), "published_blocks": sum(len(m) for m in self._mirror.values()),
                "counters": dict(self.counters)}


# -- `kvstore route ...` ------------------------------------------------------------------------

def route_main(argv: Sequence[str] | None = None) -> int:
    """``kvstore route --redis URL --namespace HEX (--hashes HEX,... | --tokens 1,2,...)``:
    print which nodes hold the longest cached prefix of a request (JSON with ``--json``)."""
    p = argparse.ArgumentParser(prog="kvstore route", description=route_main.__doc__)
    p.add_argument("--redis", default=os.environ.get("KVSTORE_FLEET_REDIS_URL", "redis://127.0.0.1:6379/0"),
                   help="directory URL (redis://, rediss://, unix://, redis+cluster://)")
    p.add_argument("--key-prefix", default=os.environ.get("KVSTORE_FLEET_KEY_PREFIX", "kvs"))
    p.add_argument("--namespace", required=True, help="namespace id, 32 hex digits")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hashes", help="comma-separated block hashes in hex, in chain order")
    src.add_argument("--tokens", help="comma-separated token ids (hashed with --hash-algorithm/--hash-seed)")
    p.add_argument("--block-tokens", type=int, help="tokens per block (required with --tokens)")
    p.add_argument("--hash-algorithm", default="xxh3_128")
    p.add_argument("--hash-seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    try:
        ns = bytes.fromhex(args.namespace)
        if len(ns) != 16:
            raise ValueError
    except ValueError:
        p.error("--namespace: expected 32 hex digits")
    if args.hashes:
        try:
            hashes = [bytes.fromhex(h) for h in args.hashes.split(",") if h]
        except ValueError:
            p.error("--hashes: not hex")
    else:
        if not args.block_tokens:
            p.error("--block-tokens is required with --tokens")
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        hashes = ChainHasher(args.hash_algorithm, args.hash_seed).chain(tokens, args.block_tokens)
    directory = Directory(args.redis, args.key_prefix, socket_timeout_s=2.0)
    try:
        routes = directory.route(ns, hashes, args.block_tokens)
    except KVStoreError as e:
        print(f"kvstore route: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001
        print(f"kvstore route: directory unreachable at {args.redis}: {e}", file=sys.stderr)
        return 1
    finally:
        directory.close()
    if args.json:
        print(json.dumps({"blocks_requested": len(hashes), "nodes": [r.to_dict() for r in routes]}, indent=2))
    elif not routes:
        print(f"no node holds the first of {len(hashes)} blocks")
    else:
        print(f"{'node':<24} {'address':<24} {'blocks':>7} {'tokens':>8}  tiers")
        for r in routes:
            tiers = ", ".join(f"{k}={v}" for k, v in sorted(r.tiers.items()))
            print(f"{r.node_id:<24} {r.address:<24} {r.blocks:>7} {r.tokens if r.tokens is not None else '-':>8}  {tiers}")
    return 0
