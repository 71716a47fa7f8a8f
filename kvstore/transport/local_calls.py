"""Same-host lease calls over the daemon's Unix socket: the shm path's RPCs without gRPC.

A same-host get is a PrepareLoad, a memcpy and a CompleteLoad; a put a PrepareStore, a memcpy and
a CompleteStore. Over gRPC in Python each of those calls costs about a millisecond of the two
processes' time, more than copying a few MiB, so for the small loads a scheduler step makes the
round trips, not the copies, would be the get. The lookup service's socket (``local_lookup``)
carries them instead: the same request and response messages, framed as its lookups are, answered
by the same servicer methods on a small pool of the daemon's threads (a lease call does store work;
the socket's one thread must stay free for lookups).

Frames (integers big-endian): request ``u32 length``, then ``u8 CALL, u8 method`` (its index in
``LEASE_METHODS``) and the serialized request message; answer ``u32 length``, then ``u8 status``:
0 is ``u16 length`` + the call's trailing metadata (``key=value`` lines: the daemon run that
answered, a load that stopped at an unstaged block) + the serialized response; 1 is the error the
servicer raised, ``class NUL field NUL message``, which the client raises as the same class.

A connection carries one call at a time (the client keeps a few, one per call in flight): a
request sent before the previous answer closes the connection. Answers leave by
``SocketServer.send_soon``, so no daemon thread waits for a caller to read. The greeting, the
ticket check and the bounds on connections are the lookup service's.
"""

from __future__ import annotations

import functools
import os
import socket
import struct
import threading
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvstore.proto import kvstore_pb2 as pb
from kvstore.threads import BUDGET
from kvstore.transport.bulk import readable_within
from kvstore.transport.local_lookup import CALL, MAGIC, MAX_FRAME, CallFailed, frame, recv_frame
from kvstore.transport.socket_server import Connection, connect

LEASE_METHODS = ("PrepareStore", "CompleteStore", "AbortStore", "PrepareLoad", "CompleteLoad")
_RPCS = pb.DESCRIPTOR.services_by_name["KVStore"].methods_by_name
REQUESTS = {m: getattr(pb, _RPCS[m].input_type.name) for m in LEASE_METHODS}     # message class of each call
RESPONSES = {m: getattr(pb, _RPCS[m].output_type.name) for m in LEASE_METHODS}   # and of its answer
CALL_WORKERS = BUDGET.local_calls   # lease calls of all same-host clients run on this many daemon threads
KEEP_IDLE = 8          # connections a client keeps open between calls
_META_LEN = struct.Struct("!H")


def encode_call(method: str, request: bytes) -> bytes:
    return frame(bytes([CALL, LEASE_METHODS.index(method)]) + request)


def _answered(response: bytes, metadata) -> bytes:
    meta = "\n".join(f"{k}={v}" for k, v in metadata).encode()
    return frame(b"\0" + _META_LEN.pack(len(meta)) + meta + response)


def _refused(kind: str, field: str, message: str) -> bytes:
    return frame(b"\1" + f"{kind}\0{field}\0{message}".encode("utf-8", "replace")[:4096])


class CallServer:
    """Daemon side, plugged into ``LocalLookupServer`` (``calls=``), which sets ``send`` to its
    ``send_soon``. ``handler(tenant, method, request)`` returns ``(response bytes, trailing
    metadata pairs)`` or raises ``CallFailed``; it runs on this server's own pool of
    ``CALL_WORKERS`` threads."""

    def __init__(self, handler: Callable[[str, str, bytes], tuple[bytes, tuple]]) -> None:
        self._handler = handler
        self._pool = ThreadPoolExecutor(CALL_WORKERS, thread_name_prefix="kvstore-local-call")
        self.send: Callable[[int, Connection, bytes], None] | None = None
        self.counts: Counter[str] = Counter()

    def take(self, fd: int, conn: Connection, body: bytes) -> None:
        """Start the call in ``body`` (on the socket's thread, which goes on at once)."""
        conn.busy = True
        try:
            self._pool.submit(self._run, fd, conn, body)
        except RuntimeError:   # closing: no more calls
            self._answer(fd, conn, _refused("DaemonUnavailable", "", "the daemon is stopping"))

    def _run(self, fd: int, conn: Connection, body: bytes) -> None:
        try:
            if len(body) < 2 or body[1] >= len(LEASE_METHODS):
                raise CallFailed("InvalidArgument", "method", f"method: unknown lease call {body[1:2].hex()}")
            response, metadata = self._handler(conn.tenant, LEASE_METHODS[body[1]], body[2:])
            answer = _answered(response, metadata)
            self.counts["calls"] += 1
        except CallFailed as e:
            answer = _refused(e.kind, e.field, e.message)
            self.counts["refused"] += 1
        except Exception as e:  # noqa: BLE001 - the caller waits for an answer: it gets one
            answer = _refused("", "", f"internal error: {type(e).__name__}")
            self.counts["failed"] += 1
        self._answer(fd, conn, answer)

    def _answer(self, fd: int, conn: Connection, answer: bytes) -> None:
        conn.busy = False   # before the answer leaves: the caller's next call may arrive at once
        self.send(fd, conn, answer)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class LocalCalls:
    """Client side: each call takes a connection of its own (a kept idle one, or a new one), so
    calls from several threads run at once and one connection never carries two. Raises
    ``CallFailed`` for the daemon's refusal, ``TimeoutError`` when it does not answer in time,
    and any other OSError when the socket is gone (the caller then asks over gRPC)."""

    def __init__(self, path: str, ticket: bytes, tenant: str, timeout_s: float) -> None:
        self._connect = functools.partial(connect, path, MAGIC, ticket, tenant, timeout_s)
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._pid = os.getpid()
        self._closed = False
        self.answered = 0   # calls the daemon answered here (tests and benchmarks read it)
        self._idle.append(self._connect())   # a socket we cannot reach is found now, not mid-put

    def call(self, method: str, request: bytes) -> tuple[bytes, tuple]:
        """``(response bytes, trailing metadata pairs)`` of one lease call."""
        if 2 + len(request) > MAX_FRAME:   # its frame's body: op, method, request
            raise OSError(f"a {method} of {len(request)} bytes is over the socket's frame bound")
        sock = self._take()
        try:
            sock.sendall(encode_call(method, request))
            body = recv_frame(sock)
        except BaseException:
            sock.close()
            raise
        self._give_back(sock)
        self.answered += 1
        if body[:1] == b"\0":
            (m,) = _META_LEN.unpack_from(body, 1)
            meta = bytes(body[3:3 + m]).decode("utf-8", "replace")
            pairs = tuple(tuple(line.split("=", 1)) for line in meta.split("\n") if "=" in line)
            return bytes(body[3 + m:]), pairs
        kind, field, message = (bytes(body[1:]).decode("utf-8", "replace").split("\0", 2) + ["", ""])[:3]
        raise CallFailed(kind, field, message)

    def _take(self) -> socket.socket:
        with self._lock:
            if self._pid != os.getpid():   # a forked child: the parent's connections are not ours
                self._idle, self._pid = [], os.getpid()
            while self._idle:
                sock = self._idle.pop()
                if not readable_within(sock):   # nothing is owed between calls: readable is a hangup
                    return sock
                sock.close()   # the daemon closed it while it idled (its bound, or pushed out)
        return self._connect()

    def _give_back(self, sock: socket.socket) -> None:
        with self._lock:
            if len(self._idle) < KEEP_IDLE and self._pid == os.getpid() and not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def close(self) -> None:
        """Close the kept connections (one in use closes when its call ends)."""
        with self._lock:
            idle, self._idle, self._closed = self._idle, [], True
        for sock in idle:
            sock.close()
