"""The Redis side of the fleet: key names, membership, signed entries and the janitor.

Layout. Every key of one namespace shares the hash tag ``{<namespace hex>}``, so in a Redis
Cluster a namespace lives in one slot and its scripts touch only declared, co-located keys:

* ``<prefix>:{<ns>}:holders`` — HASH, field = raw block hash, value = signed checksum + holders
  bitmap (``records``). A block held by 100 nodes is one field, so ``route`` is a single HMGET
  whose cost does not grow with the number of nodes.
* ``<prefix>:{<ns>}:nodes`` — HASH, field = slot number, value = signed ``"<expiry ms> <node id>
  <address> <epoch> <mac>"``. A node takes the lowest free slot when it joins and refreshes its expiry
  with each heartbeat; a slot whose expiry has passed no longer counts anywhere; expiry 0 marks
  it dead for good. A janitor (any live node, under a lock) clears dead slots' bits and frees them,
  and repairs a namespace whose keys broke a node's commands (``repair``): one namespace's broken
  or full keys cost only that namespace, and only until then.
* ``<prefix>:{<ns>}:revoked`` — HASH, field = ``"<node id> <epoch>"``, value = signed ``"<until ms>
  <mac>"``: a node that leaves revokes its run (epoch) here, so its signed entry, written back by
  whoever saved it, is refused until it would have expired anyway. Readers also remember the
  tombstones they have seen, so deleting one later does not bring its entry back for them. (What
  keeps such an entry harmless when the tombstone was deleted before a reader saw it is the peer
  proof: ``peer_proof``.)

Trust. Whatever this class reads back is checked before anyone acts on it: a node entry or a
checksum whose MAC does not verify under the fleet secret, and any malformed value, is ignored
and counted (``rejected_unsigned``, ``rejected_bad_mac``, ``rejected_malformed``).
"""

from __future__ import annotations

import collections
from collections.abc import Sequence

from redis.exceptions import ResponseError

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.fleet import lua
from kvstore.fleet.records import (CHECKSUM_BYTES, MAX_SLOTS, format_node_value, holds,
                                   marks, now_ms, parse_node_entry, parse_slot, parse_tombstone)
from kvstore.fleet.routing import NodeRoute, route
from kvstore.fleet.signing import DirectorySigner
from kvstore.redis_connection import connect

PUBLISH_CHUNK = 256          # entries per Lua call: bounds how long one call holds Redis (~0.5 ms)
_VERIFIED_CACHE = 4096       # node values already verified (they change with every heartbeat)
_REVOKED_MEMORY = 4096       # revoked node runs remembered by a reader


class DirectoryFull(KVStoreError):
    """Every slot of a namespace is taken (MAX_SLOTS): this node cannot publish there."""

    grpc_status = "RESOURCE_EXHAUSTED"


class _Batch:
    """Commands sent together: one pipeline on a standalone Redis; one by one on a cluster, whose
    redis-py pipeline refuses scripts (a namespace's keys share a slot, so order is preserved)."""

    def __init__(self, redis, cluster: bool) -> None:
        self.redis = redis
        self.pipe = None if cluster else redis.pipeline(transaction=False)
        self.results: list = []

    def script(self, script, keys: list, args: list) -> None:
        if self.pipe is None:
            self.results.append(_answer(lambda: script(keys=keys, args=args)))
        else:
            script(keys=keys, args=args, client=self.pipe)

    def call(self, command: str, *args) -> None:
        if self.pipe is None:
            self.results.append(_answer(lambda: getattr(self.redis, command)(*args)))
        else:
            getattr(self.pipe, command)(*args)

    def execute(self) -> list:
        """Each command's answer, or the ``ResponseError`` Redis answered it with (a key of the
        wrong type, ...): one namespace's broken key fails that namespace's commands only. A
        connection failure raises."""
        return self.results if self.pipe is None else self.pipe.execute(raise_on_error=False)


def _answer(command):
    try:
        return command()
    except ResponseError as e:
        return e


def _type_of(redis, key: str) -> str:
    kind = redis.type(key)
    return kind.decode() if isinstance(kind, bytes) else kind


def _raised(results: list) -> list:
    """``results``, raising the first ``ResponseError`` among them."""
    for r in results:
        if isinstance(r, ResponseError):
            raise r
    return results


class Directory:
    """Key names, scripts and verified reads of one fleet's directory. Holds no Store, so a router
    or ``kvstore route`` can use it on its own (with the fleet secret)."""

    def __init__(self, redis_url: str, key_prefix: str = "kvs", socket_timeout_s: float = 0.5,
                 client=None, keep_s: float = 600.0, *, secret=None,
                 counters: dict[str, int] | None = None) -> None:
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise InvalidArgument("key_prefix", "must be non-empty and contain no braces")
        self.signer = DirectorySigner(secret)
        self.prefix = key_prefix
        self.keep_ms = int(keep_s * 1000)   # TTL of a namespace's keys, pushed forward by every write
        self.counters: dict[str, int] = counters if counters is not None else collections.defaultdict(int)
        # (namespace, field, raw value) -> (slot, node id, address, expiry, epoch) of values that verified
        self._verified: dict[tuple, tuple[int, str, str, int, int]] = {}
        self._revoked: dict[tuple[bytes, str, int], int] = {}   # (namespace, node id, epoch) -> until ms
        self.redis = client if client is not None else connect(redis_url, socket_timeout_s)
        self._cluster = type(self.redis).__name__ == "RedisCluster"
        self._publish = self.redis.register_script(lua.PUBLISH)
        self._sweep = self.redis.register_script(lua.SWEEP)
        self._join = self.redis.register_script(lua.JOIN)
        self._heartbeat = self.redis.register_script(lua.HEARTBEAT)
        self._claim_dead = self.redis.register_script(lua.CLAIM_DEAD)

    def _batch(self) -> _Batch:
        return _Batch(self.redis, self._cluster)

    def _tag(self, namespace_id: bytes) -> str:
        return f"{self.prefix}:{{{namespace_id.hex()}}}"

    def holders_key(self, namespace_id: bytes) -> str:
        return self._tag(namespace_id) + ":holders"

    def nodes_key(self, namespace_id: bytes) -> str:
        return self._tag(namespace_id) + ":nodes"

    def janitor_key(self, namespace_id: bytes) -> str:
        return self._tag(namespace_id) + ":janitor"

    def revoked_key(self, namespace_id: bytes) -> str:
        return self._tag(namespace_id) + ":revoked"

    def _node_value(self, namespace_id: bytes, slot: int, node_id: str, address: str, ttl_s: float,
                    epoch: int) -> str:
        expiry = now_ms() + int(ttl_s * 1000)
        mac = self.signer.node_mac(namespace_id, slot, expiry, node_id, address, epoch)
        return format_node_value(expiry, node_id, address, epoch, mac)

    # -- membership ------------------------------------------------------------------------------

    def join(self, namespace_id: bytes, node_id: str, address: str, ttl_s: float, epoch: int = 0) -> int:
        """Take the lowest free slot in this namespace (earlier incarnations of ``node_id`` become
        dead). The value is signed for its slot, so the script names the slot and we sign again
        when another node took it first."""
        key = self.nodes_key(namespace_id)
        slot = 0
        for _ in range(16):
            batch = self._batch()
            batch.script(self._join, [key], [node_id, slot,
                                             self._node_value(namespace_id, slot, node_id, address, ttl_s,
                                                              epoch)])
            batch.call("pexpire", key, self.keep_ms)
            got = int(_raised(batch.execute())[0])
            if got >= 0:
                return got
            slot = -got - 1
            if slot >= MAX_SLOTS:
                break
        raise DirectoryFull(f"fleet: no free slot for this node in namespace {namespace_id.hex()} "
                            f"(at most {MAX_SLOTS})")

    def heartbeat(self, beats: Sequence[tuple[bytes, int]], node_id: str, address: str,
                  ttl_s: float, epoch: int = 0) -> list[bool | ResponseError]:
        """Refresh this node's slots, one per namespace; False where the slot is gone, the error
        where that namespace's keys are broken (the others are refreshed all the same). The
        script also deletes a ``revoked`` key of the wrong type (it would fail every route)."""
        batch = self._batch()
        for ns, slot in beats:
            value = self._node_value(ns, slot, node_id, address, ttl_s, epoch)
            batch.script(self._heartbeat, [self.nodes_key(ns), self.holders_key(ns), self.revoked_key(ns)],
                         [slot, value, self.keep_ms, node_id, address])
        return [x if isinstance(x, ResponseError) else bool(x) for x in batch.execute()]

    def leave(self, namespace_id: bytes, slot: int, hashes: Sequence[bytes], node_id: str | None = None,
              epoch: int = 0, ttl_s: float = 0.0) -> None:
        """Withdraw ``hashes`` from ``slot`` and free it (a clean shutdown). With ``node_id``, also
        revoke this run (``epoch``) for ``ttl_s``, as long as any entry it signed can live."""
        self.publish(namespace_id, slot, {h: None for h in hashes})
        batch = self._batch()
        if node_id is not None:
            until = now_ms() + int(ttl_s * 1000) + 1000
            key = self.revoked_key(namespace_id)
            batch.call("hset", key, f"{node_id} {epoch}",
                       f"{until} {self.signer.tombstone_mac(namespace_id, node_id, epoch, until)}")
            batch.call("pexpire", key, self.keep_ms)
        batch.call("hdel", self.nodes_key(namespace_id), str(slot))
        _raised(batch.execute()[-1:])   # a revoked key of the wrong type does not keep the slot taken

    # -- entries ---------------------------------------------------------------------------------

    def publish(self, namespace_id: bytes, slot: int, changes: dict[bytes, bytes | None]) -> int:
        """Set (value = ``pack_entry``) or clear (None) ``slot``'s bit for each block hash, in
        bounded Lua calls pipelined together; each checksum goes out signed for its block.
        Returns how many adds hit a checksum conflict."""
        key = self.holders_key(namespace_id)
        batch = self._batch()
        groups: dict[tuple[bool, int], list[tuple[bytes, bytes | None]]] = collections.defaultdict(list)
        for h, v in changes.items():
            groups[(v is not None, len(h))].append((h, v))
        for (is_add, length), items in groups.items():
            for i in range(0, len(items), PUBLISH_CHUNK):
                chunk = items[i:i + PUBLISH_CHUNK]
                values = b"".join(self.signer.checksum_prefix(namespace_id, h, v[:CHECKSUM_BYTES]) + v[CHECKSUM_BYTES:]
                                  for h, v in chunk) if is_add else b""
                batch.script(self._publish, [key], [slot, "a" if is_add else "r", length,
                                                    b"".join(h for h, _ in chunk), values])
        batch.call("pexpire", key, self.keep_ms)
        results = _raised(batch.execute())
        return int(sum(results[:-1]))

    def sweep(self, namespace_id: bytes, grace_s: float, lock_s: float = 60.0) -> int:
        """Janitor: clear the bits of slots dead for longer than ``grace_s`` and free them.
        One sweeper at a time per namespace (a lock with a TTL). Returns entries cleared."""
        if not self.redis.set(self.janitor_key(namespace_id), "1", nx=True, px=int(lock_s * 1000)):
            return 0
        try:
            self._clear_tombstones(namespace_id)
            dead = self._claim_dead(keys=[self.nodes_key(namespace_id)], args=[now_ms(), int(grace_s * 1000)])
            dead_slots = [s for s in map(parse_slot, dead) if s is not None]
            if not dead_slots:
                return 0
            cleared = 0
            key = self.holders_key(namespace_id)
            for page in self._scan_pages(key):
                by_len: dict[int, list[bytes]] = collections.defaultdict(list)
                for f, v in page.items():   # only fields a dead slot still marks go to the script
                    if any(marks(v, s) for s in dead_slots):
                        by_len[len(f)].append(f)
                for length, group in by_len.items():
                    cleared += int(self._sweep(keys=[key], args=[length, b"".join(group), *dead_slots]))
            self.redis.hdel(self.nodes_key(namespace_id), *map(str, dead_slots))
            return cleared
        finally:
            self.redis.delete(self.janitor_key(namespace_id))

    def _clear_tombstones(self, namespace_id: bytes) -> None:
        """Delete tombstones that have run out, are malformed or do not verify (part of ``sweep``)."""
        key = self.revoked_key(namespace_id)
        if _type_of(self.redis, key) != "hash":
            return
        now = now_ms()
        stale = [field for page in self._scan_pages(key) for field, value in page.items()
                 if self._tombstone(namespace_id, field, value, now) is None]
        for at in range(0, len(stale), 512):
            self.redis.hdel(key, *stale[at:at + 512])

    def _tombstone(self, namespace_id: bytes, field, value, now: int) -> tuple[str, int, int] | None:
        """``(node id, epoch, until ms)`` of a tombstone that verifies and has not run out."""
        parsed = parse_tombstone(field, value)
        if parsed is None:
            return None
        node_id, epoch, until, mac = parsed
        if until < now or not self.signer.tombstone_verifies(namespace_id, node_id, epoch, until, mac):
            return None
        return node_id, epoch, until

    def repair(self, namespace_id: bytes, lock_s: float = 60.0) -> int:
        """Janitor for a namespace whose keys broke this node's commands: a nodes or holders key
        that is not a hash (anyone who can write Redis can make it one) is deleted, and node
        entries that do not verify under the fleet secret (unsigned, forged, malformed, filling
        the slots) are removed; expired ones are left to ``sweep``. Live nodes republish what
        they hold on their next heartbeat. Returns what it deleted (keys and entries)."""
        if not self.redis.set(self.janitor_key(namespace_id), "1", nx=True, px=int(lock_s * 1000)):
            return 0
        try:
            removed = 0
            for key in (self.nodes_key(namespace_id), self.holders_key(namespace_id),
                        self.revoked_key(namespace_id)):
                if _type_of(self.redis, key) not in ("hash", "none"):
                    removed += self.redis.delete(key)
            nodes = self.nodes_key(namespace_id)
            now = now_ms()
            forged = []
            for page in self._scan_pages(nodes):
                for field, value in page.items():
                    slot = parse_slot(field)
                    entry = parse_node_entry(slot, value) if slot is not None else None
                    if entry is not None and entry.expiry_ms < now:
                        continue   # expired or dead: the sweep's to clear, with its holder bits
                    if entry is None or self._verify_node(namespace_id, field, value) is None:
                        forged.append(field)
            for at in range(0, len(forged), 512):
                removed += self.redis.hdel(nodes, *forged[at:at + 512])
            self.counters["repaired"] += removed
            return removed
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

    # -- verified reads --------------------------------------------------------------------------

    def _reject(self, why: str) -> None:
        self.counters[f"rejected_{why}"] += 1

    def live_nodes(self, namespace_id: bytes, nodes: dict,
                   revoked: dict | None = None) -> dict[int, tuple[str, str, int]]:
        """Slot -> (node id, address, epoch) of the nodes-hash entries that are alive, signed by a
        daemon of this fleet for this namespace and slot, and of a run no tombstone revokes (those
        in ``revoked``, the raw tombstones hash, and those seen before). Everything else is
        skipped. A value that verified once is remembered as parsed (a route reads every node's
        value, and parsing and checking 100 of them took half of a route's time); only its expiry
        is checked again."""
        live = {}
        now = now_ms()
        self._learn_revoked(namespace_id, revoked or {}, now)
        for field, value in nodes.items():
            known = self._verified.get((namespace_id, field, value))
            if known is None:
                known = self._verify_node(namespace_id, field, value)
                if known is None:
                    continue
            slot, node_id, address, expiry_ms, epoch = known
            if expiry_ms < now:   # expired or dead: not counted, whatever it says
                continue
            if self._revoked.get((namespace_id, node_id, epoch), -1) >= now:
                self._reject("revoked")
                continue
            live[slot] = (node_id, address, epoch)
        return live

    def _learn_revoked(self, namespace_id: bytes, revoked: dict, now: int) -> None:
        """Remember the tombstones of ``revoked`` that verify (bounded: run-out ones go first)."""
        for field, value in revoked.items():
            known = self._tombstone(namespace_id, field, value, now)
            if known is None:
                continue
            node_id, epoch, until = known
            if len(self._revoked) >= _REVOKED_MEMORY and (namespace_id, node_id, epoch) not in self._revoked:
                self._revoked = {k: t for k, t in self._revoked.items() if t >= now}
                if len(self._revoked) >= _REVOKED_MEMORY:
                    self._revoked.pop(next(iter(self._revoked)))
            self._revoked[(namespace_id, node_id, epoch)] = until

    def members(self, namespace_id: bytes) -> dict[int, tuple[str, str, int]]:
        """``live_nodes`` of a namespace, read in one round trip (its nodes and tombstones)."""
        batch = self._batch()
        batch.call("hgetall", self.nodes_key(namespace_id))
        batch.call("hgetall", self.revoked_key(namespace_id))
        nodes, revoked = batch.execute()
        if isinstance(nodes, ResponseError):
            raise nodes
        return self.live_nodes(namespace_id, nodes, {} if isinstance(revoked, ResponseError) else revoked)

    def revoked(self, namespace_id: bytes) -> dict:
        """The raw tombstones hash of a namespace (empty when it is missing or not a hash)."""
        try:
            return self.redis.hgetall(self.revoked_key(namespace_id))
        except ResponseError:
            return {}

    def _verify_node(self, namespace_id: bytes, field, value) -> tuple[int, str, str, int, int] | None:
        slot = parse_slot(field)
        entry = parse_node_entry(slot, value) if slot is not None else None
        if entry is None:
            self._reject("malformed")
            return None
        if entry.expiry_ms < now_ms():
            return None
        if not entry.mac:
            self._reject("unsigned")
            return None
        if not self.signer.node_verifies(namespace_id, entry):
            self._reject("bad_mac")
            return None
        known = (entry.slot, entry.node_id, entry.address, entry.expiry_ms, entry.epoch)
        if len(self._verified) >= _VERIFIED_CACHE:
            self._verified.clear()
        self._verified[(namespace_id, field, value)] = known
        return known

    def route(self, namespace_id: bytes, hashes: Sequence[bytes],
              block_tokens: int | None = None) -> list[NodeRoute]:
        """See ``routing.route``: verified live nodes holding a leading run, longest first."""
        return route(self, namespace_id, hashes, block_tokens)

    def checksums(self, namespace_id: bytes, slot: int, hashes: Sequence[bytes]) -> list[int | None]:
        """The published checksum of each block that ``slot`` holds, where its MAC verifies for
        that very block (None where it does not, or the slot does not hold it)."""
        if not hashes:
            return []
        values = self.redis.hmget(self.holders_key(namespace_id), list(hashes))
        out: list[int | None] = []
        for h, v in zip(hashes, values):
            if not holds(v, slot):
                out.append(None)
            elif not self.signer.checksum_verifies(namespace_id, h, v):
                self._reject("bad_mac")
                out.append(None)
            else:
                out.append(int.from_bytes(v[:CHECKSUM_BYTES], "little"))
        return out

    def entries(self, namespace_id: bytes, node_id: str) -> int:
        """How many blocks the live slots of ``node_id`` hold (a full scan: tests and tools)."""
        live = self.live_nodes(namespace_id, self.redis.hgetall(self.nodes_key(namespace_id)),
                               self.revoked(namespace_id))
        slots = [s for s, (n, _, _) in live.items() if n == node_id]
        if not slots:
            return 0
        count = 0
        for _, v in self.redis.hscan_iter(self.holders_key(namespace_id), count=1000):
            count += any(holds(v, s) for s in slots)
        return count

    def close(self) -> None:
        try:
            self.redis.close()
        except Exception:  # noqa: BLE001 - closing a broken connection is not an error
            pass
