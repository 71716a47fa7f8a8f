"""Same-host Lookup over a Unix socket: the scheduler's question ("how much of this chain is
cached?") without a gRPC call.

An engine's scheduler asks once per request, hit or miss, and waits for the answer before it
schedules anything; over gRPC that costs a round trip of several hundred microseconds in Python.
Here a same-host client keeps one Unix-socket connection open (path and ticket from Handshake:
``transport.tickets``) and sends length-prefixed requests; the daemon answers each on the socket
server's one thread (``socket_server``), straight from the store's index.

Where the daemon offers one, the client also maps its tenant's lookup index
(``transport.lookup_index``) and answers from it without a round trip; it then only *tells* the
daemon (a frame with no answer, sent by a thread of its own with the others of the last couple of
milliseconds: ``Teller``) so the blocks are pinned under a lease and the lookup is counted. It
asks over the socket when the index cannot say, and the first time it names a namespace (so an
unknown one is refused by name, not answered "0 hits").

Frames (all integers big-endian): greeting ``MAGIC + ticket(32) + u16 tenant length + tenant``
(``socket_server.greeting``); request ``u32 length`` then ``u8 op, u8 namespace length, namespace,
u16 count, u8 hash length, hashes``; answer ``u32 length`` then ``u8 status, u32 hits``, then the
hits' tier names joined by commas. Ops: ``LOOKUP`` / ``LOOKUP_LEASE`` are answered; ``CALL`` (the
shm path's lease calls, framed in ``local_calls``) is answered from other threads, one per
connection at a time; ``TOLD`` / ``TOLD_LEASE`` (a lookup the client answered from the index: the
hashes it found, then ``u16`` how many it asked about) are not; ``INDEX`` (no namespace, no
hashes) is answered with the index's descriptor attached (``SCM_RIGHTS``), status 1 when there is
none. Status 0 is an answer; any other is the error the handler raised, by name, after it (the
client raises the same class). Bounds beside the base's: ``MAX_CONNECTIONS`` per tenant; a
connection closes on a frame over ``MAX_FRAME`` or after ``IDLE_S`` without one.
"""

from __future__ import annotations

import contextlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

from kvstore.transport.bulk import readable_within, recv_exact
from kvstore.transport.lookup_index import IndexReader
from kvstore.transport.socket_server import Connection, SocketServer, connect
from kvstore.transport.tickets import TokenBook

if TYPE_CHECKING:
    from kvstore.transport.local_calls import CallServer

MAGIC = b"KVLK"
IDLE_S = 300.0
MAX_CONNECTIONS = 256        # greeted connections of one tenant
MAX_FRAME = 1 << 20          # 8192 hashes of 64 bytes and then some
_LEN = struct.Struct("!I")
_ANSWER = struct.Struct("!BI")
LOOKUP, LOOKUP_LEASE, TOLD, TOLD_LEASE, INDEX, CALL = range(6)


class IndexProvider(Protocol):
    """What the server needs of the daemon's lookup indexes (``service.lookup_indexes``)."""

    def descriptor_for(self, tenant: str) -> int | None: ...

    def revoke(self, tenants: set[str]) -> None: ...

    def close(self) -> None: ...


class CallFailed(Exception):
    """What a lookup or lease call raised in the daemon, to be raised again by the client: ``kind``
    is the class name (empty for an unexpected error), ``field`` the field it names (lease calls)."""

    def __init__(self, kind: str, field: str, message: str) -> None:
        super().__init__(message)
        self.kind, self.field, self.message = kind, field, message


class Unframeable(ValueError):
    """A lookup this socket's frames cannot carry (mixed or over-wide hashes, too many of them):
    the caller asks over gRPC, which answers or refuses it by name; the connection is fine."""


def encode_lookup(namespace_id: bytes, hashes: Sequence[bytes], op: int, asked: int | None = None) -> bytes:
    """A request frame; for ``TOLD``/``TOLD_LEASE`` (a lookup the client answered from the index)
    ``hashes`` are those it found and ``asked`` how many it asked about (for the daemon's counts)."""
    widths = set(map(len, hashes))
    width = widths.pop() if len(widths) == 1 else 0 if not widths else 256
    if width > 255 or len(namespace_id) > 255 or len(hashes) > 0xFFFF:
        raise Unframeable("hashes of one width (at most 255 bytes), at most 65535 of them")
    told = b"" if asked is None else struct.pack("!H", min(asked, 0xFFFF))
    return frame(bytes([op, len(namespace_id)]) + namespace_id + struct.pack("!HB", len(hashes), width)
                 + b"".join(hashes) + told)


def frame(body: bytes) -> bytes:
    """``body`` behind its ``u32`` length: every request and answer on this socket."""
    return _LEN.pack(len(body)) + body


def recv_frame(sock: socket.socket) -> bytes:
    """The body of the next frame (its length read first); ConnectionError when the daemon closes first."""
    (n,) = _LEN.unpack(recv_exact(sock, _LEN.size))
    return recv_exact(sock, n)


def _decode_lookup(body: bytes) -> tuple[int, bytes, list[bytes]]:
    op, ns_len = body[0], body[1]
    namespace_id = body[2:2 + ns_len]
    count, width = struct.unpack_from("!HB", body, 2 + ns_len)
    at = 5 + ns_len
    if len(body) != at + count * width + (2 if op in (TOLD, TOLD_LEASE) else 0):
        raise ValueError("frame size does not match its count")
    return op, namespace_id, [body[at + i * width:at + (i + 1) * width] for i in range(count)]


class LocalLookupServer(SocketServer):
    """Daemon side. ``handler(tenant, namespace_id, hashes, lease)`` returns ``(hits, tiers)`` or
    raises; ``told(tenant, namespace_id, hit_hashes, asked, lease)`` takes note of a lookup the
    client answered itself (pins ``hit_hashes`` with ``lease``, counts it). Both run on this
    server's one thread, so they must be quick (an index lookup). ``indexes`` hands out
    lookup-index descriptors (None: none is offered that tenant); ``calls`` takes ``CALL`` frames
    (the shm path's lease calls, ``local_calls``; None: refused). This server closes both."""

    def __init__(self, shm_dir: str, handler: Callable[[str, bytes, list[bytes], bool], tuple[int, list[str]]],
                 told: Callable[[str, bytes, list[bytes], int, bool], None], indexes: IndexProvider,
                 calls: CallServer | None = None, tokens: TokenBook | None = None) -> None:
        self._handler, self._told, self._indexes, self._calls = handler, told, indexes, calls
        self.takes_calls = calls is not None   # whether this socket carries lease calls
        if calls is not None:
            calls.send = self.send_soon
        super().__init__("local-lookup", shm_dir=shm_dir, max_per_tenant=MAX_CONNECTIONS, tokens=tokens)
        self.start()

    def received(self, fd: int, conn: Connection) -> None:
        if conn.tenant is None:
            if not self.greet(fd, conn, MAGIC):
                return
            conn.deadline = time.monotonic() + IDLE_S
            self.counts["sessions"] += 1
        call_taken = False   # a lease call started from this buffer (its thread may have answered already)
        while len(conn.buf) >= _LEN.size:
            (n,) = _LEN.unpack_from(conn.buf)
            if n > MAX_FRAME:
                self.end(fd, "oversized")
                return
            if len(conn.buf) < _LEN.size + n:
                return
            body, conn.buf = bytes(conn.buf[_LEN.size:_LEN.size + n]), conn.buf[_LEN.size + n:]
            if conn.busy or conn.unsent is not None or call_taken:   # sent before its call's answer was taken
                self.end(fd, "pipelined")
                return
            call_taken = bool(body) and body[0] == CALL and self.takes_calls
            conn.deadline = time.monotonic() + IDLE_S
            try:
                self._serve(fd, conn, body)
            except OSError:
                self.end(fd, "stalled")   # a client that does not read its answers is dropped
                return

    def _serve(self, fd: int, conn: Connection, body: bytes) -> None:
        op = body[0] if body else LOOKUP
        if op == CALL and self.takes_calls:
            self._calls.take(fd, conn, body)   # answered from the calls' own threads
            return
        if op == INDEX:
            index_fd = self._indexes.descriptor_for(conn.tenant)
            if index_fd is None:
                conn.sock.sendall(frame(_ANSWER.pack(1, 0)))
                return
            try:
                socket.send_fds(conn.sock, [frame(_ANSWER.pack(0, 0))], [index_fd])
                self.counts["indexes_handed"] += 1
            finally:
                os.close(index_fd)
            return
        if op in (TOLD, TOLD_LEASE):   # answered from the index already: pin and count, no reply
            try:
                _, namespace_id, hashes = _decode_lookup(body)
                (asked,) = struct.unpack_from("!H", body, len(body) - 2)
                self._told(conn.tenant, namespace_id, hashes, asked, op == TOLD_LEASE)
                self.counts["told"] += 1
            except Exception:  # noqa: BLE001 - nobody waits for this answer
                self.counts["told_refused"] += 1
            return
        conn.sock.sendall(self._answer(conn.tenant, body))   # a few hundred bytes: a stalled peer only

    def _answer(self, tenant: str, body: bytes) -> bytes:
        try:
            op, namespace_id, hashes = _decode_lookup(body)
            if op not in (LOOKUP, LOOKUP_LEASE):
                raise ValueError(f"unknown lookup op {op}")
            hits, tiers = self._handler(tenant, namespace_id, hashes, op == LOOKUP_LEASE)
            rest = _ANSWER.pack(0, hits) + ",".join(tiers).encode()
            self.counts["lookups"] += 1
        except Exception as e:  # noqa: BLE001 - the error goes back to the caller, by class
            rest = _ANSWER.pack(1, 0) + f"{type(e).__name__}:{e}".encode("utf-8", "replace")[:4096]
        return frame(rest)

    def revoke(self, tenants: set[str]) -> None:
        """Stop keeping ``tenants``' mapped indexes (a reload took a token from each): a client
        still mapping one finds it closed and asks here, where its revoked ticket is refused."""
        self._indexes.revoke(tenants)

    def close(self) -> None:
        super().close()
        self._indexes.close()
        if self.takes_calls:
            self._calls.close()


TELL_EVERY_S = 0.002   # an index-answered lookup reaches the daemon this late at most (plus a send)
TELLER_IDLE_S = 0.2    # the teller thread sleeps until the next lookup after this long without one


class Teller:
    """Sends the daemon the notes of index-answered lookups from a thread of its own, all that
    piled up in one send every ``TELL_EVERY_S`` (encoding them there too). Why: a send wakes the
    daemon's socket thread, which costs the sender that wakeup and, on a busy host, can preempt
    it; so the caller only appends to a list, and the one wakeup it may cause is the teller's,
    after ``TELLER_IDLE_S`` without lookups. The cost: the pins land up to ``TELL_EVERY_S`` later
    (a block evicted in between is a later miss, as any lost race to eviction)."""

    def __init__(self, send: Callable[[list], None]) -> None:
        self._send = send
        self._pending: list = []
        self._cond = threading.Condition()
        self._asleep = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def tell(self, note) -> None:
        with self._cond:
            self._pending.append(note)
            if self._thread is None or not self._thread.is_alive():   # first use, or a forked child
                self._thread = threading.Thread(target=self._run, name="kvstore-lookup-teller", daemon=True)
                self._thread.start()
            elif self._asleep:
                self._cond.notify()

    def _run(self) -> None:
        last = time.monotonic()
        while True:
            with self._cond:
                if not self._pending and not self._closed and time.monotonic() - last > TELLER_IDLE_S:
                    self._asleep = True
                    self._cond.wait_for(lambda: self._pending or self._closed)
                    self._asleep = False
                batch, self._pending = self._pending, []
                closed = self._closed
            if batch:
                self._send(batch)
                last = time.monotonic()
            elif closed:
                return
            time.sleep(TELL_EVERY_S)

    def close(self) -> None:
        """Tell what is pending, then stop."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(1.0)


class LocalLookup:
    """Client side: one connection, one request at a time (a lock serialises callers), and the
    daemon's lookup index when it offers one (``use_index``)."""

    def __init__(self, path: str, ticket: bytes, tenant: str, timeout_s: float = 2.0, use_index: bool = True) -> None:
        self._lock = threading.Lock()
        self._sock = connect(path, MAGIC, ticket, tenant, timeout_s)
        self.index: IndexReader | None = None
        self.told_dropped = 0             # index answers the daemon was too busy to hear of
        self._known: set[bytes] = set()   # namespaces the daemon answered for over the socket
        self._teller = Teller(self._send_told)
        try:
            if use_index:
                self.index = self._map_index()
        except OSError:
            self._sock.close()
            raise

    def _map_index(self) -> IndexReader | None:
        self._sock.sendall(encode_lookup(b"", [], INDEX))
        data, fds, _, _ = socket.recv_fds(self._sock, _LEN.size + _ANSWER.size, 1)
        try:
            if len(data) < _LEN.size + _ANSWER.size:
                data += recv_exact(self._sock, _LEN.size + _ANSWER.size - len(data))
            status, _ = _ANSWER.unpack_from(data, _LEN.size)
            return IndexReader(fds[0]) if status == 0 and fds else None
        finally:
            for fd in fds:
                os.close(fd)

    def lookup(self, namespace_id: bytes, hashes: Sequence[bytes], lease: bool = True) -> tuple[int, list[str]]:
        """``(hits, tiers)``; ``CallFailed`` for the daemon's refusal, OSError when the
        connection is gone (the caller falls back to gRPC)."""
        if self.index is not None and namespace_id in self._known:
            got = self.index.leading_hits(namespace_id, hashes)
            if got is not None:
                # the daemon died if it closed this connection: its table's answer is not trusted
                # either (a hung one is caught by the table's heartbeat instead)
                if readable_within(self._sock):
                    raise OSError("the daemon closed the lookup connection")
                self._teller.tell((namespace_id, hashes[:got[0]], len(hashes), lease))
                return got
        request = encode_lookup(namespace_id, hashes, LOOKUP_LEASE if lease else LOOKUP)
        with self._lock:
            self._sock.sendall(request)
            body = recv_frame(self._sock)
        status, hits = _ANSWER.unpack_from(body)
        rest = body[_ANSWER.size:].decode("utf-8", "replace")
        if status != 0:
            kind, _, message = rest.partition(":")
            raise CallFailed(kind, "", message)
        self._known.add(bytes(namespace_id))
        return hits, rest.split(",") if rest else []

    def _send_told(self, notes: list[tuple]) -> None:
        """The teller's send: ``TOLD`` frames nobody answers, without waiting on a busy daemon; a
        partial write is finished (the stream must stay framed). A lost connection is left for
        the next lookup to find."""
        frames = []
        for namespace_id, hit, asked, lease in notes:
            try:
                frames.append(encode_lookup(namespace_id, hit, TOLD_LEASE if lease else TOLD, asked))
            except ValueError:   # hashes the frame cannot carry (over 255 bytes): not told
                self.told_dropped += 1
        data = b"".join(frames)
        with self._lock:
            try:
                sent = self._sock.send(data, socket.MSG_DONTWAIT)
                if sent < len(data):
                    self._sock.sendall(data[sent:])
            except BlockingIOError:
                self.told_dropped += len(frames)   # the daemon is behind: these go unpinned and uncounted
            except OSError:
                pass

    def close(self) -> None:
        self._teller.close()
        if self.index is not None:
            self.index.close()
            self.index = None
        with contextlib.suppress(OSError):
            self._sock.close()
