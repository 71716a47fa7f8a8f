"""Fleet mode: a Redis directory of who holds which block, peer fetch, and KV-aware routing.

A fleet is many daemons, one per inference node. Each daemon publishes the blocks its Store holds
to a directory in Redis; any daemon (or a router) can then ask which node holds the longest cached
prefix of a request, and a daemon that misses locally can fetch the blocks from a peer instead of
letting its engine recompute them.

Directory layout (every key of one namespace shares the hash tag ``{<namespace hex>}``, so in a
Redis Cluster they live in one slot and the route script may touch them all):

* ``<prefix>:{<ns>}:n:<node_id>`` — HASH, field = raw block hash, value = 9 bytes: xxh3_64 of
  the block's bytes (little-endian) + one tier code. Key TTL ``ttl_s``, refreshed by the owner's
  heartbeat, so a node killed with SIGKILL loses its entries after at most ``ttl_s`` with no
  janitor. One entry is ~80 bytes of Redis memory (measured: docs/fleet.md).
* ``<prefix>:{<ns>}:nodes`` — HASH, field = node id, value = ``"<expiry ms> <address>"``. The
  route script skips nodes whose expiry has passed even before their entries expire.

Why per-node hashes rather than one set of holders per block: expiry is free (a key TTL, no
read-modify-write, no garbage after a crash), the owner's checksum sits beside its entry, and a
restart or Redis loss is repaired by rewriting one's own keys only.

Publishing: the Store calls ``blocks_added`` / ``blocks_removed`` with its lock held, so the
listener only appends to a queue. One background thread drains it: it pins each new block just
long enough to checksum it (zero-copy for the CPU arena, the recorded checksum for NVMe), keeps a
local mirror of what it published, and pushes the delta with one pipeline per batch. If Redis
fails or comes back empty (restart, failover, flush), the mirror is republished in full; the
daemon keeps serving locally meanwhile. Peer fetch and routing degrade to "no peers".

Peer fetch (``Fleet.lookup`` / ``Fleet.fetch``) runs in the daemon, not the client: every engine
gets it through one code path, the fetched copy lands in the local Store where all local workers
reuse it, clients need no Redis credentials, and a peer's bytes are checked against the checksum
its owner published before a single byte is stored or served.
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

from kvstore.errors import BlockCorrupt, InvalidArgument, KVStoreError
from kvstore.keys import ChainHasher, check_block_hash
from kvstore.store import Lookup, Store, StoreListener

log = logging.getLogger("kvstore.fleet")

TIER_CODES = {"gpu": 0, "cpu": 1, "nvme": 2, "redis": 3}
TIER_NAMES = {v: k for k, v in TIER_CODES.items()}
UNKNOWN_TIER = 255
MAX_ROUTE_HASHES = 8192
_PUSH_CHUNK = 1000

# Per live node: the length of the leading run of ``hashes`` present in its hash, read in growing
# chunks (8, 32, 128, 512...) so a node holding nothing costs one small HMGET. Returns a flat list
# [node_id, address, tier codes of the run, ...] for nodes with a run of at least one block.
_ROUTE_LUA = """
local t = redis.call('TIME')
local now_ms = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local nodes = redis.call('HGETALL', KEYS[1])
local n = #ARGV
local out = {}
for i = 1, #nodes, 2 do
  local id = nodes[i]
  local v = nodes[i + 1]
  local sp = string.find(v, ' ', 1, true)
  if sp and tonumber(string.sub(v, 1, sp - 1)) >= now_ms then
    local key = KEYS[2] .. id
    local count = 0
    local tiers = {}
    local first = 2
    local step = 8
    local done = false
    while first <= n and not done do
      local last = math.min(first + step - 1, n)
      local vals = redis.call('HMGET', key, unpack(ARGV, first, last))
      for k = 1, #vals do
        local val = vals[k]
        if not val then done = true; break end
        count = count + 1
        tiers[count] = string.sub(val, 9, 9)
      end
      first = last + 1
      step = math.min(step * 4, 512)
    end
    if count > 0 then
      out[#out + 1] = id
      out[#out + 1] = string.sub(v, sp + 1)
      out[#out + 1] = table.concat(tiers)
    end
  end
end
return out
"""
# ARGV[1] is unused padding so that hashes start at ARGV[2] (keeps the index arithmetic obvious).


@dataclasses.dataclass
class NodeRoute:
    """What one node can serve of a request: its leading cached blocks and where they sit."""

    node_id: str
    address: str
    blocks: int
    tokens: int | None            # blocks x block_tokens when the layout is known
    tiers: dict[str, int]         # tier name -> how many of those blocks it published there

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def connect(redis_url: str, socket_timeout_s: float = 0.5):
    """A redis-py client for ``redis://``/``rediss://``/``unix://`` or a cluster client for
    ``redis+cluster://host:port``. Short timeouts: the directory is advice, never worth a stall."""
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    kw = dict(socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
              retry=Retry(ExponentialBackoff(cap=0.2, base=0.01), 1), health_check_interval=5)
    if redis_url.startswith("redis+cluster://"):
        from redis.cluster import RedisCluster
        return RedisCluster.from_url("redis://" + redis_url[len("redis+cluster://"):], **kw)
    return redis.Redis.from_url(redis_url, **kw)


def pack_entry(checksum: int, tier: str) -> bytes:
    return checksum.to_bytes(8, "little") + bytes([TIER_CODES.get(tier, UNKNOWN_TIER)])


def node_field(address: str, ttl_s: float) -> str:
    """The nodes-hash value: when this node stops counting as alive (ms since epoch), and where."""
    return f"{int((time.time() + ttl_s) * 1000)} {address}"


def _unpack_checksum(value: bytes | None) -> int | None:
    return None if value is None or len(value) < 8 else int.from_bytes(value[:8], "little")


class Directory:
    """The Redis side of the fleet: key names, the route query, checksum look-ups.
    Holds no Store, so a router or ``kvstore route`` can use it on its own."""

    def __init__(self, redis_url: str, key_prefix: str = "kvs", socket_timeout_s: float = 0.5,
                 client=None) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise InvalidArgument("key_prefix", "must be non-empty and contain no braces")
        self.prefix = key_prefix
        self.redis = client if client is not None else connect(redis_url, socket_timeout_s)
        self._route_script = self.redis.register_script(_ROUTE_LUA)

    def node_key(self, namespace_id: bytes, node_id: str) -> str:
        return f"{self.prefix}:{{{namespace_id.hex()}}}:n:{node_id}"

    def nodes_key(self, namespace_id: bytes) -> str:
        return f"{self.prefix}:{{{namespace_id.hex()}}}:nodes"

    def route(self, namespace_id: bytes, hashes: Sequence[bytes],
              block_tokens: int | None = None) -> list[NodeRoute]:
        """Per live node holding at least the first block: how many leading blocks (and tokens)
        it can serve and from which tiers; longest first. One round trip (a Lua script)."""
        if len(hashes) > MAX_ROUTE_HASHES:
            raise InvalidArgument("hashes", f"{len(hashes)} hashes; at most {MAX_ROUTE_HASHES} per route")
        if not hashes:
            return []
        for h in hashes:
            check_block_hash(h)
        flat = self._route_script(keys=[self.nodes_key(namespace_id), self.node_key(namespace_id, "")],
                                  args=[b"", *hashes])
        routes = []
        for i in range(0, len(flat), 3):
            node_id, address, codes = flat[i].decode(), flat[i + 1].decode(), flat[i + 2]
            tiers: dict[str, int] = {}
            for code, count in collections.Counter(codes).items():
                name = TIER_NAMES.get(code, "unknown")
                tiers[name] = tiers.get(name, 0) + count
            n = len(codes)
            routes.append(NodeRoute(node_id, address, n, n * block_tokens if block_tokens else None, tiers))
        routes.sort(key=lambda r: (-r.blocks, -r.tiers.get("gpu", 0) - r.tiers.get("cpu", 0), r.node_id))
        return routes

    def publish(self, node_id: str, address: str, ttl_s: float,
                delta: dict[bytes, dict[bytes, bytes | None]], replace: bool = False) -> tuple[int, int]:
        """Write one node's changes (hash -> packed value, or None to withdraw) in one pipeline,
        refreshing its TTLs; ``replace`` first deletes what the node had (a full republish).
        Returns (entries written, entries withdrawn)."""
        pipe = self.redis.pipeline(transaction=False)
        field = node_field(address, ttl_s)
        ttl_ms = int(ttl_s * 1000)
        n_add = n_del = 0
        for ns, changes in delta.items():
            key = self.node_key(ns, node_id)
            if replace:
                pipe.delete(key)
            adds = [(h, v) for h, v in changes.items() if v is not None]
            dels = [h for h, v in changes.items() if v is None]
            for i in range(0, len(adds), _PUSH_CHUNK):
                pipe.hset(key, mapping=dict(adds[i:i + _PUSH_CHUNK]))
            for i in range(0, len(dels), _PUSH_CHUNK):
                pipe.hdel(key, *dels[i:i + _PUSH_CHUNK])
            pipe.pexpire(key, ttl_ms)
            pipe.hset(self.nodes_key(ns), node_id, field)
            pipe.pexpire(self.nodes_key(ns), ttl_ms)
            n_add += len(adds)
            n_del += len(dels)
        pipe.execute()
        return n_add, n_del

    def checksums(self, namespace_id: bytes, node_id: str, hashes: Sequence[bytes]) -> list[int | None]:
        """What ``node_id`` published for each block (None where it publishes nothing)."""
        if not hashes:
            return []
        return [_unpack_checksum(v) for v in self.redis.hmget(self.node_key(namespace_id, node_id), list(hashes))]

    def entries(self, namespace_id: bytes, node_id: str) -> int:
        return int(self.redis.hlen(self.node_key(namespace_id, node_id)))

    def close(self) -> None:
        try:
            self.redis.close()
        except Exception:  # noqa: BLE001 - closing a broken connection is not an error
            pass


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
                 flush_interval_s: float = 0.02, peer_token: str | None = None,
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
        self.peer_fetch_enabled = peer_fetch
        self.fetch_batch = fetch_batch
        self.directory = Directory(redis_url, key_prefix, socket_timeout_s)
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
        self._mirror: dict[bytes, dict[bytes, bytes]] = {}   # what we believe Redis holds for us
        self._resync = True                                  # first flush replaces stale keys
        self._thread: threading.Thread | None = None
        self._scratch = np.empty(0, dtype=np.uint8)
        self.counters: dict[str, int] = collections.defaultdict(int)
        self.connected = False

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
        with self.store._lock:  # noqa: SLF001 - a consistent snapshot needs the store's own lock
            self.store.listeners.append(self)
            held: dict[bytes, list[bytes]] = collections.defaultdict(list)
            for entry in self.store._index.values():  # noqa: SLF001
                if entry.ready and not entry.doomed:
                    held[entry.namespace_id].append(entry.block_hash)
            for ns, hashes in held.items():
                self._events.append((True, ns, hashes))
        self._thread = threading.Thread(target=self._run, name="kvstore-fleet", daemon=True)
        self._thread.start()
        self._wake.set()
        return self

    def close(self, unpublish: bool = True) -> None:
        """Stop publishing; by default also withdraw this node's entries so peers stop routing here."""
        with self.store._lock:  # noqa: SLF001
            if self in self.store.listeners:
                self.store.listeners.remove(self)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if unpublish:
            try:
                pipe = self.directory.redis.pipeline(transaction=False)
                for ns in self._mirror:
                    pipe.delete(self.directory.node_key(ns, self.node_id))
                    pipe.hdel(self.directory.nodes_key(ns), self.node_id)
                pipe.execute()
            except Exception as e:  # noqa: BLE001 - Redis down at shutdown: entries expire anyway
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
        store = self.store
        with store._lock:  # noqa: SLF001 - pin/unpin are the store's own primitives
            entry = store._pin(ns, h)  # noqa: SLF001
            if entry is None:
                return None
            t = entry.fastest
            record = entry.copies[t]
            tier = store.tiers[t]
        try:
            if record.checksum and record.codec == 0 and record.stored_size == record.raw_size:
                checksum = record.checksum
            elif hasattr(tier, "view"):
                x = xxhash.xxh3_64()
                for piece in tier.view(entry.key):
                    x.update(piece)
                checksum = x.intdigest()
            else:
                if self._scratch.nbytes < record.stored_size:
                    self._scratch = np.empty(record.stored_size, dtype=np.uint8)
                n = tier.read_into(entry.key, self._scratch)
                checksum = xxhash.xxh3_64_intdigest(self._scratch[:n])
            self.counters["checksummed"] += 1
            return pack_entry(checksum, tier.name)
        except (BlockCorrupt, KeyError):
            return None
        finally:
            with store._lock:  # noqa: SLF001
                store._unpin(entry)  # noqa: SLF001

    def _node_field(self) -> str:
        return node_field(self.advertise_addr, self.ttl_s)

    def _push(self, delta: dict[bytes, dict[bytes, bytes | None]]) -> None:
        n_add, n_del = self.directory.publish(self.node_id, self.advertise_addr, self.ttl_s, delta)
        self.counters["published"] += n_add
        self.counters["withdrawn"] += n_del
        self.counters["pushes"] += 1

    def _republish(self) -> None:
        """Replace this node's entries with the mirror (first start, Redis restarted or lost)."""
        for ns, held in list(self._mirror.items()):
            self.directory.publish(self.node_id, self.advertise_addr, self.ttl_s, {ns: dict(held)}, replace=True)
        self._resync = False
        self.counters["republishes"] += 1

    def _heartbeat(self) -> None:
        """Refresh TTLs; an entry set that vanished (Redis restarted, flushed) triggers a republish.
        Also drops other nodes' expired fields from the nodes hash (they no longer route)."""
        d = self.directory
        namespaces = list(self._mirror)
        if not namespaces:
            return
        pipe = d.redis.pipeline(transaction=False)
        field = self._node_field()
        ttl_ms = int(self.ttl_s * 1000)
        for ns in namespaces:
            pipe.pexpire(d.node_key(ns, self.node_id), ttl_ms)
            pipe.hset(d.nodes_key(ns), self.node_id, field)
            pipe.pexpire(d.nodes_key(ns), ttl_ms)
        results = pipe.execute()
        for i, ns in enumerate(namespaces):
            if not results[3 * i] and self._mirror[ns]:
                self.counters["entries_lost"] += 1
                self._resync = True
        self.counters["heartbeats"] += 1
        if self.counters["heartbeats"] % 10 == 1:
            self._prune_dead_nodes(namespaces)
        if self._resync:
            self._republish()

    def _prune_dead_nodes(self, namespaces: list[bytes]) -> None:
        now_ms = time.time() * 1000
        for ns in namespaces:
            key = self.directory.nodes_key(ns)
            dead = [node for node, v in self.directory.redis.hgetall(key).items()
                    if float(v.split(b" ", 1)[0]) < now_ms - self.ttl_s * 1000]
            if dead:
                self.directory.redis.hdel(key, *dead)
                self.counters["pruned_nodes"] += len(dead)

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
            expected = self.directory.checksums(ns, route.node_id, want)
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
