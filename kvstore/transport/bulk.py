"""Remote bulk side channel: raw TCP for the bytes, gRPC for control.

Tuned gRPC streams in Python reach about half of raw TCP here, so remote clients that can open
one more TCP connection to the daemon move payloads over a plain socket with ``recv_into`` into
buffers they already own. Control stays on gRPC: every ``BulkGet``/``BulkPut`` is an ordinary,
authenticated, validated RPC that names a side-channel *session*; only its bytes ride the socket.

Opening a session: connect to ``bulk_port`` (from Handshake) and send ``MAGIC + ticket`` (the
ticket is a per-daemon secret handed out by Handshake, which is itself authenticated); the daemon
answers with a random 16-byte session id known only to this connection.

Framing (all integers little-endian):

* BulkGet — for each requested block in order the daemon writes ``u64 size`` (0 = miss) and then
  that many payload bytes. ``size == 2**64 - 1`` means the RPC failed: read its status.
* BulkPut — the client writes ``len(hashes) * block_bytes`` payload bytes after starting the RPC;
  the daemon reads exactly that many (draining them if it rejects the request).

A client that cannot connect (firewall, TLS-only deployment) keeps using the gRPC streams.
"""

from __future__ import annotations

import secrets
import select
import socket
import struct
import threading
import time

import numpy as np

MAGIC = b"KVSBULK1"
ERROR_SIZE = 2**64 - 1
MAX_SESSIONS = 1024
_U64 = struct.Struct("<Q")


def recv_exact_into(sock: socket.socket, view: memoryview) -> None:
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("side channel closed mid-transfer")
        got += k


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


class _Session:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.lock = threading.Lock()


class BulkServer:
    """Daemon side: accepts side-channel connections and hands their sockets to RPC handlers."""

    def __init__(self, host: str) -> None:
        self.ticket = secrets.token_bytes(16)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._sessions: dict[bytes, _Session] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kvstore-bulk-accept", daemon=True)
        self._thread.start()

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._greet, args=(conn,), daemon=True).start()

    def _greet(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(5.0)
            hello = recv_exact(conn, len(MAGIC) + len(self.ticket))
            if not secrets.compare_digest(hello, MAGIC + self.ticket):
                conn.close()
                return
            with self._lock:
                if len(self._sessions) >= MAX_SESSIONS:
                    conn.close()
                    return
                sid = secrets.token_bytes(16)
                self._sessions[sid] = _Session(conn)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(None)
            conn.sendall(sid)
        except OSError:
            conn.close()

    def session(self, sid: bytes) -> _Session | None:
        with self._lock:
            return self._sessions.get(sid)

    def drop(self, sid: bytes) -> None:
        with self._lock:
            s = self._sessions.pop(sid, None)
        if s is not None:
            try:
                s.sock.shutdown(socket.SHUT_RDWR)  # wakes a handler blocked in recv (close alone does not)
            except OSError:
                pass
            s.sock.close()

    @property
    def session_count(self) -> int:
        return len(self._sessions)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        with self._lock:
            sessions, self._sessions = list(self._sessions.values()), {}
        for s in sessions:
            s.sock.close()


class BulkChannel:
    """Client side: one side-channel connection (one transfer at a time, guarded by ``lock``)."""

    def __init__(self, host: str, port: int, ticket: bytes, timeout_s: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(MAGIC + ticket)
        self.session = recv_exact(self.sock, 16)
        self.lock = threading.Lock()
        self.timeout_s = timeout_s

    def wait_readable(self, rpc_future, deadline: float) -> None:
        """Block until the daemon starts writing; if the RPC fails first, raise its error."""
        while True:
            r, _, _ = select.select([self.sock], [], [], 0.02)
            if r:
                return
            if rpc_future.done():
                rpc_future.result()  # raises the RPC's error
                r, _, _ = select.select([self.sock], [], [], 1.0)
                if r:
                    return
                raise ConnectionError("side channel: the RPC finished but no data came")
            if time.monotonic() > deadline:
                raise TimeoutError("side channel: no answer before the deadline")

    def read_size(self) -> int | None:
        """The size of the next BulkGet block (0 = miss); None when the daemon signalled an error."""
        (size,) = _U64.unpack(recv_exact(self.sock, 8))
        return None if size == ERROR_SIZE else size

    def recv_into(self, dst: np.ndarray) -> None:
        recv_exact_into(self.sock, memoryview(dst).cast("B"))

    def send(self, src: np.ndarray) -> None:
        self.sock.sendall(memoryview(src).cast("B"))

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def send_block(sock: socket.socket, block: np.ndarray | None) -> None:
    """One BulkGet frame: the size (0 = miss) and the bytes."""
    if block is None:
        sock.sendall(_U64.pack(0))
        return
    header = _U64.pack(block.nbytes)
    payload = memoryview(block).cast("B")
    sent = sock.sendmsg([header, payload])  # one syscall (and no lone 8-byte packet) per block
    if sent < len(header):
        sock.sendall(header[sent:])
        sent = len(header)
    if sent - len(header) < len(payload):
        sock.sendall(payload[sent - len(header):])


def send_error(sock: socket.socket) -> None:
    sock.sendall(_U64.pack(ERROR_SIZE))


def drain(sock: socket.socket, nbytes: int, scratch: np.ndarray) -> None:
    """Read and discard ``nbytes`` the client already committed to sending."""
    view = memoryview(scratch).cast("B")
    while nbytes > 0:
        k = sock.recv_into(view, min(nbytes, len(view)))
        if k == 0:
            raise ConnectionError("side channel closed while draining")
        nbytes -= k
