"""Remote bulk side channel: raw TCP for the bytes, gRPC for control (wire format and client end).

Tuned gRPC streams in Python reach about half of raw TCP here, so remote clients that can open
one more TCP connection to the daemon move payloads over a plain socket with ``recv_into`` into
buffers they already own. Control stays on gRPC: every ``BulkGet``/``BulkPut`` is an ordinary,
authenticated, validated RPC that names a side-channel *session*; only its bytes ride the socket.

Opening a session: connect to ``bulk_port`` (from Handshake) and send ``MAGIC + ticket`` within
the daemon's greeting deadline. The ticket (16 bytes) comes from an authenticated Handshake and is
bound to the caller's tenant; the daemon answers with a random 16-byte session id known only to
this connection, and accepts that id only in RPCs of the same tenant. The daemon's end
(``bulk_server``) may end an idle session, which ``BulkChannel.alive`` then reports.

Framing (all integers little-endian):

* BulkGet — for each requested block in order the daemon writes ``u64 size`` (0 = miss) and then
  that many payload bytes. ``size == 2**64 - 1`` means the RPC failed: read its status.
* BulkPut — the client writes ``len(hashes) * block_bytes`` payload bytes after starting the RPC
  (``sum(sizes)`` for payloads it encoded itself: ``BulkRequest.codec``/``sizes``); the daemon
  reads exactly that many (draining them if it rejects the request).

Between transfers the daemon never writes: a side-channel socket that turns readable while idle
has been closed by the daemon (or is out of step) and must be replaced. A client that cannot
connect (firewall, TLS-only deployment) keeps using the gRPC streams.
"""

from __future__ import annotations

import contextlib
import select
import socket
import struct
import threading
import time

import numpy as np

MAGIC = b"KVSBULK1"
TICKET_BYTES = 16
SESSION_ID_BYTES = 16
GREETING_BYTES = len(MAGIC) + TICKET_BYTES
ERROR_SIZE = 2**64 - 1
_U64 = struct.Struct("<Q")
_MISS = _U64.pack(0)
_U8 = np.dtype(np.uint8)


def recv_exact_into(sock: socket.socket, view: memoryview, on_bytes=None) -> None:
    """Fill ``view`` from ``sock``; ``on_bytes()`` after each read that brought some (a stall
    watch sees a slow sender's progress within a large read)."""
    got = 0
    n = len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("the peer closed the connection mid-transfer")
        got += k
        if on_bytes is not None:
            on_bytes()


def recv_exact_into_each(sock: socket.socket, views: list, on_bytes=None) -> None:
    """Fill every buffer of ``views`` (flat byte buffers: ``memoryview``s cast to bytes, uint8
    numpy arrays) in order from ``sock``, a run of up to ``SEND_RUN_BUFFERS`` per ``recvmsg_into``
    (one syscall for many small blocks, as ``send_all`` sends them); ``on_bytes()`` after each
    read that brought some."""
    at, offset = 0, 0   # the first buffer not yet full, and how much of it is
    while at < len(views):
        run = [views[at][offset:]] + views[at + 1:at + SEND_RUN_BUFFERS]
        k = sock.recvmsg_into(run)[0]
        if k == 0:
            raise ConnectionError("the peer closed the connection mid-transfer")
        if on_bytes is not None:
            on_bytes()
        k += offset
        while at < len(views) and k >= len(views[at]):
            k -= len(views[at])
            at += 1
        offset = k


#: one ``sendmsg`` carries buffers up to this many bytes (and below the kernel's IOV_MAX of 1024)
SEND_RUN_BYTES = 1 << 20
SEND_RUN_BUFFERS = 256


def byte_view(buf):
    """``buf`` as a flat byte buffer whose ``len`` is its size in bytes: a uint8 numpy array as
    it is (what the arena's views and a put's blocks are), anything else cast to bytes."""
    if type(buf) is np.ndarray and buf.dtype is _U8:
        return buf
    return memoryview(buf).cast("B")


def send_all(sock: socket.socket, views: list, on_bytes=None) -> None:
    """Send every byte of ``views`` (flat byte buffers, as ``byte_view`` makes them) in order,
    small ones a run of up to ``SEND_RUN_BYTES`` per ``sendmsg``: small blocks then cost a
    syscall per run, not per block. A larger buffer goes alone. ``on_bytes()`` after each run is
    sent."""
    lengths = [len(v) for v in views]
    at, n = 0, len(views)
    while at < n:
        stop, size = at + 1, lengths[at]
        while stop < n and stop - at < SEND_RUN_BUFFERS and size + lengths[stop] <= SEND_RUN_BYTES:
            size += lengths[stop]
            stop += 1
        sent = sock.sendmsg(views[at:stop])
        if sent < size:   # past the buffers sent whole; the rest of a partly sent one by sendall
            while sent >= lengths[at]:
                sent -= lengths[at]
                at += 1
            sock.sendall(views[at][sent:])
            at += 1
            if on_bytes is not None:
                on_bytes()
            continue   # the buffers after it start the next run
        at = stop
        if on_bytes is not None:
            on_bytes()


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_exact_into(sock, memoryview(buf))
    return bytes(buf)


def readable_within(sock: socket.socket, timeout_s: float = 0.0) -> bool:
    """Whether ``sock`` has bytes (or EOF) to read within ``timeout_s``; ``poll``, not ``select``,
    so a process holding more than 1,024 descriptors can use it. A poll object of its own: it
    sends nothing, wakes nobody and may be called from several threads at once."""
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLPRI)
    return bool(poller.poll(int(timeout_s * 1000)))


class BulkChannel:
    """Client side: one side-channel connection (one transfer at a time, guarded by ``lock``)."""

    def __init__(self, host: str, port: int, ticket: bytes, timeout_s: float) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        try:
            self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sock.sendall(MAGIC + ticket)
            self.session = recv_exact(self.sock, SESSION_ID_BYTES)
        except OSError:
            self.sock.close()
            raise
        self.lock = threading.Lock()
        self.timeout_s = timeout_s
        self._head = memoryview(bytearray(_U64.size))   # a frame's size, read with the block before it

    def alive(self) -> bool:
        """False once the daemon has closed this session (idle past its bound, evicted for a new
        client, daemon restarted): idle, the socket has nothing to read unless it is gone."""
        try:
            return self.sock.fileno() >= 0 and not readable_within(self.sock)
        except (OSError, ValueError):
            return False

    def wait_readable(self, rpc_future, deadline: float) -> None:
        """Block until the daemon starts writing; if the RPC fails first, raise its error."""
        while True:
            if readable_within(self.sock, 0.02):
                return
            if rpc_future.done():
                rpc_future.result()  # raises the RPC's error
                if readable_within(self.sock, 1.0):
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

    def recv_into_and_size(self, dst: np.ndarray) -> int | None:
        """``recv_into`` a block's bytes and, in the same reads, the next frame's size (as
        ``read_size``): one syscall per block of a BulkGet rather than two. Only where a next
        frame is due (the block is not the last asked for): the daemon writes nothing else."""
        recv_exact_into_each(self.sock, [memoryview(dst).cast("B"), self._head])
        (size,) = _U64.unpack(self._head)
        return None if size == ERROR_SIZE else size

    def send_each(self, srcs) -> None:
        """Every array of ``srcs``, in order, a run of them per syscall (``send_all``)."""
        send_all(self.sock, [byte_view(a) for a in srcs])

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.close()


def send_blocks(sock: socket.socket, blocks, on_bytes=None) -> list[int]:
    """BulkGet frames of ``blocks`` (each a list of pieces, or None for a miss), in order: each
    block's size (0 = miss) and the bytes of its pieces, a run of frames per ``sendmsg``
    (``send_all``: a syscall per run of small blocks, not one per block); returns each block's
    size. ``on_bytes()`` after each run is sent."""
    parts, sizes = [], []
    for pieces in blocks:
        if pieces is None:
            parts.append(_MISS)
            sizes.append(0)
            continue
        views = [byte_view(p) for p in pieces]
        size = sum(map(len, views))
        parts.append(_U64.pack(size))
        parts += views
        sizes.append(size)
    send_all(sock, parts, on_bytes)
    return sizes


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
