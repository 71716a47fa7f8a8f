"""Redis tier: block payloads in a Redis (or Redis Cluster) shared by a fleet.

For fleets that want one shared pool instead of (or below) peer-to-peer fetch. Each block is one
string key ``<prefix>:blk:{<namespace hex>}:<hash hex>`` holding a header and the payload. With the
fleet's secret (a daemon in fleet mode passes it) the header (40 bytes: magic, codec, sizes) ends
in a keyed BLAKE2b-128 MAC of the value bound to its namespace and block hash: Redis is untrusted
storage, and a value anyone without the secret planted or copied is refused like a corrupt one.
Without a secret the header (32 bytes) ends in the payload's xxh3_64, which catches damage only. Keys are content-addressed, so every daemon of
the fleet writes and finds a block under the same name (``load`` reads blocks this daemon never
stored; the fleet uses it before asking peers).

Contract notes (see ``tiers/base.py``):

* ``capacity_bytes`` is this daemon's budget in the pool, enforced locally by ``allocate`` (no I/O
  under the Store lock); the Redis server's own ``maxmemory`` bounds the pool as a whole.
* Every key has a TTL (``ttl_s``) refreshed on each read, so blocks of a crashed daemon, or ones a
  peer overwrote and nobody reads, go away by themselves.
* ``read_into`` verifies the header and checksum; a mismatch deletes the key and raises
  ``BlockCorrupt``. A key that vanished (TTL, ``maxmemory`` eviction, Redis restart, another
  daemon's delete) also raises ``BlockCorrupt``: the Store turns both into a counted miss, never
  a wrong byte.
* ``drop`` releases the budget at once and queues the delete; the queue is sent ahead of the next
  write or read, so dropping a copy never waits on the network. (Demotion *into* this tier
  writes under the Store lock, as NVMe demotion does: one SET round trip per demoted block.)
* Not durable: a restarted daemon starts with an empty budget; what it left in Redis is still
  reachable through ``load`` until its TTL runs out.
"""

from __future__ import annotations

import collections
import hashlib
import hmac
import struct
import threading
from collections.abc import Sequence

import numpy as np
import xxhash

from kvstore.buffers import as_bytes
from kvstore.errors import BlockCorrupt, BlockTooLarge, InvalidArgument, TierFull, TierIOError
from kvstore.redis_connection import connect
from kvstore.tiers.base import BlockRecord, Tier

MAGIC = b"KVSR"
VERSION = 1
_HEADER = struct.Struct("<4sBBHQQQ")  # magic version codec reserved raw_size stored_size checksum
HEADER_BYTES = _HEADER.size           # 32
SIGNED_VERSION = 2
_SIGNED = struct.Struct("<4sBBHQQ16s")   # ... raw_size stored_size MAC (keyed BLAKE2b-128)
SIGNED_HEADER_BYTES = _SIGNED.size       # 40
_FIELDS = struct.Struct("<BQQ")          # what the MAC binds besides the key and the payload
REDIS_MAX_VALUE = 512 * 1024 * 1024   # Redis' proto-max-bulk-len default


def block_redis_key(prefix: str, namespace_id: bytes, block_hash: bytes) -> str:
    return f"{prefix}:blk:{{{namespace_id.hex()}}}:{block_hash.hex()}"


class RedisTier(Tier):
    name = "redis"
    durable = False

    def __init__(self, capacity_bytes: int, redis_url: str = "redis://127.0.0.1:6379/0", *,
                 key_prefix: str = "kvs", ttl_s: float = 3600.0, max_block_bytes: int = 64 * 1024 * 1024,
                 socket_timeout_s: float = 2.0, client=None, secret: bytes | None = None) -> None:
        """``secret`` (the fleet's): every value carries a MAC under it, bound to its namespace,
        block hash, codec and sizes, and a value whose MAC does not verify is never served."""
        super().__init__(capacity_bytes)
        if ttl_s <= 0:
            raise InvalidArgument("redis.ttl_s", "must be > 0 (every pool key expires)")
        if not 0 < max_block_bytes <= REDIS_MAX_VALUE - HEADER_BYTES:
            raise InvalidArgument("redis.max_block_bytes", f"must be in (0, {REDIS_MAX_VALUE - HEADER_BYTES}]")
        if not key_prefix or "{" in key_prefix or "}" in key_prefix:
            raise InvalidArgument("redis.key_prefix", "must be non-empty and contain no braces")
        if client is None:
            client = connect(redis_url, socket_timeout_s)
        self.redis = client
        self.prefix = key_prefix
        self.ttl_ms = int(ttl_s * 1000)
        self.max_block_bytes = int(max_block_bytes)
        self._reserved: dict[bytes, tuple[BlockRecord, int]] = {}  # key -> (record, footprint)
        self._lock = threading.Lock()
        self._pending_deletes: collections.deque[str] = collections.deque()
        self.expired_misses = 0
        self.forged_refused = 0   # values whose MAC did not verify (planted or copied by a Redis writer)
        self._mac_key = (hashlib.blake2b(secret, digest_size=32, person=b"kvstore-pool").digest()
                         if secret else None)
        self.header_bytes = SIGNED_HEADER_BYTES if self._mac_key else HEADER_BYTES

    def _key(self, key: bytes) -> str:
        return block_redis_key(self.prefix, key[:16], key[16:])

    # -- contract --------------------------------------------------------------------------------

    def footprint(self, nbytes: int) -> int:
        if nbytes > self.max_block_bytes:
            raise BlockTooLarge(f"a {nbytes}-byte block exceeds the redis tier's max_block_bytes "
                                f"({self.max_block_bytes})")
        fp = self.header_bytes + nbytes
        if fp > self.capacity_bytes:
            raise BlockTooLarge(f"a {nbytes}-byte block exceeds the redis tier ({self.capacity_bytes} bytes)")
        return fp

    def allocate(self, record: BlockRecord) -> None:
        fp = self.footprint(record.stored_size)
        with self._lock:
            if record.key in self._reserved:
                raise KeyError(f"{record.key.hex()} already in redis tier")
            if fp > self.free_bytes:
                raise TierFull(f"redis tier has {self.free_bytes} free bytes of its budget, needs {fp}")
            self._reserved[record.key] = (record, fp)
            self.used_bytes += fp

    def write(self, record: BlockRecord, data) -> None:
        src = as_bytes(data)[:record.stored_size]
        if src.nbytes != record.stored_size:
            self.drop(record.key)
            raise InvalidArgument("data", f"{src.nbytes} bytes for a {record.stored_size}-byte record")
        checksum = xxhash.xxh3_64_intdigest(src)
        record.checksum = checksum
        if self._mac_key is None:
            head = _HEADER.pack(MAGIC, VERSION, record.codec, 0, record.raw_size, record.stored_size, checksum)
        else:
            head = _SIGNED.pack(MAGIC, SIGNED_VERSION, record.codec, 0, record.raw_size, record.stored_size,
                                self._mac(record.key, record.codec, record.raw_size, record.stored_size, src))
        value = head + src.tobytes()
        try:
            self._send_deletes()
            self.redis.set(self._key(record.key), value, px=self.ttl_ms)
        except Exception as e:  # noqa: BLE001 - any client failure is an I/O failure of this tier
            self.drop(record.key)
            raise TierIOError(f"redis tier: SET failed: {e}") from e

    def read_into(self, key: bytes, out) -> int:
        record, _ = self._reserved[key]
        try:
            self._send_deletes()
            value = self.redis.getex(self._key(key), px=self.ttl_ms)
        except Exception as e:  # noqa: BLE001
            raise TierIOError(f"redis tier: GET failed: {e}") from e
        if value is None:
            self.expired_misses += 1
            self._forget(key)
            raise BlockCorrupt(f"redis tier: block {key.hex()} expired or was evicted from Redis")
        payload = self._verify(value, record.stored_size, key)
        if payload is None:
            self.corrupt_dropped += 1
            self.drop(key)
            raise BlockCorrupt(f"redis tier: block {key.hex()} failed its checksum; deleted")
        dst = as_bytes(out)
        n = payload.nbytes
        np.copyto(dst[:n], payload)
        return n

    def drop(self, key: bytes) -> None:
        if self._forget(key):
            self._pending_deletes.append(self._key(key))

    def close(self) -> None:
        try:
            self._send_deletes()
        except Exception:  # noqa: BLE001 - keys left behind expire by TTL
            pass
        try:
            self.redis.close()
        except Exception:  # noqa: BLE001
            pass

    def stats(self) -> dict[str, int]:
        return {**super().stats(), "blocks": len(self._reserved), "expired_misses": self.expired_misses,
                "forged_refused": self.forged_refused,
                "pending_deletes": len(self._pending_deletes)}

    # -- shared-pool reads (blocks other daemons stored) -----------------------------------------

    def load(self, namespace_id: bytes, hashes: Sequence[bytes], with_codecs: bool = False) -> list:
        """The verified payloads of blocks in the pool, whoever stored them (None: absent or
        corrupt); ``with_codecs``: each as ``(codec id, payload)``. One pipeline; refreshes their TTLs."""
        pipe = self.redis.pipeline(transaction=False)
        for h in hashes:
            pipe.getex(block_redis_key(self.prefix, namespace_id, h), px=self.ttl_ms)
        out: list[bytes | None] = []
        for h, value in zip(hashes, pipe.execute()):
            payload = None if value is None else self._verify(value, None, namespace_id + h)
            if value is not None and payload is None:
                self.corrupt_dropped += 1
                self.redis.delete(block_redis_key(self.prefix, namespace_id, h))
            if payload is None or not with_codecs:
                out.append(None if payload is None else payload.tobytes())
            else:
                out.append((_HEADER.unpack_from(value)[2], payload.tobytes()))
        return out

    # -- helpers ---------------------------------------------------------------------------------

    def _mac(self, key: bytes, codec: int, raw_size: int, stored_size: int, payload) -> bytes:
        """A MAC of one block's value, bound to its key (namespace id + block hash), so a value
        copied under another key, or planted by anyone without the secret, does not verify."""
        mac = hashlib.blake2b(key=self._mac_key, digest_size=16)
        mac.update(len(key).to_bytes(2, "little") + key)
        mac.update(_FIELDS.pack(codec, raw_size, stored_size))
        mac.update(payload)
        return mac.digest()

    def _verify(self, value: bytes, stored_size: int | None, key: bytes) -> np.ndarray | None:
        """The payload of ``value`` if it is whole and authentic: with a secret, its MAC for
        ``key`` must verify (an unsigned or v1 value is refused); without, its checksum."""
        signed = self._mac_key is not None
        header, expected_version = (_SIGNED, SIGNED_VERSION) if signed else (_HEADER, VERSION)
        if len(value) < header.size:
            return None
        magic, version, codec, _, raw, stored, check = header.unpack_from(value)   # check: MAC or checksum
        if magic != MAGIC or version != expected_version or len(value) != header.size + stored:
            return None
        payload = np.frombuffer(value, dtype=np.uint8, offset=header.size)
        if signed:
            if not hmac.compare_digest(check, self._mac(key, codec, raw, stored, payload)):
                self.forged_refused += 1
                return None
        elif xxhash.xxh3_64_intdigest(payload) != check:
            return None
        if stored_size is not None and stored != stored_size:
            return None
        return payload

    def _forget(self, key: bytes) -> bool:
        with self._lock:
            entry = self._reserved.pop(key, None)
            if entry is None:
                return False
            self.used_bytes -= entry[1]
            return True

    def _send_deletes(self) -> None:
        while self._pending_deletes:
            keys = []
            while self._pending_deletes and len(keys) < 1000:
                keys.append(self._pending_deletes.popleft())
            pipe = self.redis.pipeline(transaction=False)
            for k in keys:  # one key per command: namespaces live in different cluster slots
                pipe.unlink(k)
            try:
                pipe.execute()
            except Exception:
                self._pending_deletes.extendleft(reversed(keys))  # retry later; TTL is the backstop
                raise
