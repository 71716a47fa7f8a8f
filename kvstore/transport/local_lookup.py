"""Same-host Lookup over a Unix socket: the scheduler's question ("how much of this chain is
cached?") without a gRPC call.

An engine's scheduler asks once per request, hit or miss, and waits for the answer before it
schedules anything; over gRPC that costs a round trip of several hundred microseconds in Python.
Here a same-host client keeps one Unix-socket connection open (path and ticket from Handshake,
the ticket an HMAC of its tenant under a secret of this daemon run, as for the side channel) and
sends length-prefixed requests; the daemon answers each on one epoll thread
(``unix_server.UnixServer``), straight from the store's index.

Frames (all integers big-endian): greeting ``MAGIC + ticket(32) + u16 tenant length + tenant``;
request ``u32 length`` then ``u8 lease, u8 namespace length, namespace, u16 count, u8 hash length,
hashes``; answer ``u32 length`` then ``u8 status, u32 hits``, then the hits' tier names joined by
commas. Status 0 is an answer; any other is the error the handler raised, by name, after it (the
client raises the same class). Nothing grows with idle or hostile connections: a greeting must
arrive within ``GREETING_DEADLINE_S``, at most ``MAX_CONNECTIONS`` stay open (the least recently
used goes first), a frame over ``MAX_FRAME`` closes its connection.
"""

from __future__ import annotations

import contextlib
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence

from kvstore.transport.unix_server import Connection, UnixServer

MAGIC = b"KVLK"
GREETING_DEADLINE_S = 2.0
IDLE_S = 300.0
MAX_CONNECTIONS = 256
MAX_FRAME = 1 << 20          # 8192 hashes of 64 bytes and then some
_LEN = struct.Struct("!I")
_HEAD = struct.Struct("!4s32sH")
_ANSWER = struct.Struct("!BI")


def encode_lookup(namespace_id: bytes, hashes: Sequence[bytes], lease: bool) -> bytes:
    width = len(hashes[0]) if hashes else 0
    if any(len(h) != width for h in hashes) or width > 255 or len(namespace_id) > 255 or len(hashes) > 0xFFFF:
        raise ValueError("hashes of one width (at most 255 bytes), at most 65535 of them")
    body = (bytes([int(lease), len(namespace_id)]) + namespace_id + struct.pack("!HB", len(hashes), width)
            + b"".join(hashes))
    return _LEN.pack(len(body)) + body


def _decode_lookup(body: bytes) -> tuple[bool, bytes, list[bytes]]:
    lease, ns_len = body[0], body[1]
    namespace_id = body[2:2 + ns_len]
    count, width = struct.unpack_from("!HB", body, 2 + ns_len)
    at = 5 + ns_len
    if len(body) != at + count * width:
        raise ValueError("frame size does not match its count")
    return bool(lease), namespace_id, [body[at + i * width:at + (i + 1) * width] for i in range(count)]


class LocalLookupServer(UnixServer):
    """Daemon side. ``handler(tenant, namespace_id, hashes, lease)`` returns ``(hits, tiers)`` or
    raises; it runs on this server's one thread, so it must be quick (an index lookup)."""

    def __init__(self, shm_dir: str, handler: Callable[[str, bytes, list[bytes], bool], tuple[int, list[str]]]) -> None:
        self._handler = handler
        super().__init__(shm_dir, "local-lookup", MAX_CONNECTIONS, GREETING_DEADLINE_S)

    def received(self, fd: int, conn: Connection) -> None:
        if conn.tenant is None and not self._greet(fd, conn):
            return
        while len(conn.buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(conn.buf)
            if n > MAX_FRAME:
                self.end(fd, "oversized")
                return
            if len(conn.buf) < _LEN.size + n:
                return
            body, conn.buf = bytes(conn.buf[_LEN.size:_LEN.size + n]), conn.buf[_LEN.size + n:]
            conn.deadline = time.monotonic() + IDLE_S
            try:
                conn.sock.sendall(self._answer(conn.tenant, body))   # a few hundred bytes: a stalled peer only
            except OSError:
                self.end(fd, "stalled")   # a client that does not read its answers is dropped
                return

    def _greet(self, fd: int, conn: Connection) -> bool:
        if len(conn.buf) < _HEAD.size:
            return False
        magic, ticket, name_len = _HEAD.unpack_from(conn.buf)
        if magic != MAGIC or name_len > 256:
            self.end(fd, "refused")
            return False
        if len(conn.buf) < _HEAD.size + name_len:
            return False
        tenant = bytes(conn.buf[_HEAD.size:_HEAD.size + name_len]).decode("utf-8", "replace")
        if not self.ticket_admits(ticket, tenant):
            self.end(fd, "refused")
            return False
        conn.tenant, conn.buf = tenant, conn.buf[_HEAD.size + name_len:]
        conn.deadline = time.monotonic() + IDLE_S
        self.counts["sessions"] += 1
        return True

    def _answer(self, tenant: str, body: bytes) -> bytes:
        try:
            lease, namespace_id, hashes = _decode_lookup(body)
            hits, tiers = self._handler(tenant, namespace_id, hashes, lease)
            rest = _ANSWER.pack(0, hits) + ",".join(tiers).encode()
            self.counts["lookups"] += 1
        except Exception as e:  # noqa: BLE001 - the error goes back to the caller, by class
            rest = _ANSWER.pack(1, 0) + f"{type(e).__name__}:{e}".encode("utf-8", "replace")[:4096]
        return _LEN.pack(len(rest)) + rest


class LocalLookupError(Exception):
    """The daemon answered with an error: ``kind`` is the class name it raised, ``message`` its text."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.message = kind, message


class LocalLookup:
    """Client side: one connection, one request at a time (a lock serialises callers)."""

    def __init__(self, path: str, ticket: bytes, tenant: str, timeout_s: float = 2.0) -> None:
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout_s)
            self._sock.connect(path)
            name = tenant.encode("utf-8")
            self._sock.sendall(_HEAD.pack(MAGIC, ticket, len(name)) + name)
        except OSError:
            self._sock.close()
            raise

    def lookup(self, namespace_id: bytes, hashes: Sequence[bytes], lease: bool = True) -> tuple[int, list[str]]:
        """``(hits, tiers)``; ``LocalLookupError`` for the daemon's refusal, OSError when the
        connection is gone (the caller falls back to gRPC)."""
        frame = encode_lookup(namespace_id, hashes, lease)
        with self._lock:
            self._sock.sendall(frame)
            (n,) = _LEN.unpack(self._recv(_LEN.size))
            body = self._recv(n)
        status, hits = _ANSWER.unpack_from(body)
        rest = body[_ANSWER.size:].decode("utf-8", "replace")
        if status != 0:
            kind, _, message = rest.partition(":")
            raise LocalLookupError(kind, message)
        return hits, rest.split(",") if rest else []

    def _recv(self, n: int) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            chunk = self._sock.recv(n - len(buf))
            if not chunk:
                raise OSError("the daemon closed the lookup connection")
            buf += chunk
        return bytes(buf)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
