"""Same-host zero-copy with authentication on: a tenant's arena segments, handed over by descriptor.

With tokens configured the daemon's CPU arena is one sealed ``memfd`` per segment, each holding
one tenant's blocks (``kvstore.tiers.cpu``). No path leads to them. A client gets the
descriptors of its own tenant's segments over a Unix socket beside the old arena path: it sends
the ticket Handshake gave it (bound to its token and checked against the current tokens on every
request: ``transport.tickets``) and the
segment numbers a lease named; the daemon answers with ``SCM_RIGHTS`` descriptors only for
segments that hold that tenant's blocks at that moment, else refuses the whole request.

Lease extents carry their segment's generation; a segment that passed to another tenant and back
has a new generation (and new memory), so a client maps it again rather than reading its old
mapping. Segments of another tenant never reach a client: not by path, not by descriptor.

Both ends live here. The daemon's end (``SegmentBroker``) is a ``socket_server.SocketServer`` on
a Unix socket: a request must arrive within ``REQUEST_DEADLINE_S`` of connecting, at most
``MAX_PENDING`` wait, so idle or hostile connections hold no thread and cannot grow anything.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import socket
import struct
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.buffers import copy_each, copy_each_in, gather, scatter
from kvstore.transport.tickets import TokenBook
from kvstore.transport.socket_server import Connection, SocketServer

MAGIC = b"KVSG"
MAX_TENANT_BYTES = 256
MAX_SEGMENTS_PER_REQUEST = 64
REQUEST_DEADLINE_S = 2.0
MAX_PENDING = 64
_HEAD = struct.Struct("!4s32sH")      # magic, ticket, tenant length; then tenant, count (H), segments (I each)
_REPLY = struct.Struct("!BH")          # status (0 ok), count; then (segment I, generation Q) each
_ENTRY = struct.Struct("!IQ")
_MAX_REQUEST = _HEAD.size + MAX_TENANT_BYTES + 2 + 4 * MAX_SEGMENTS_PER_REQUEST


def encode_request(ticket: bytes, tenant: str, segments: Sequence[int]) -> bytes:
    name = tenant.encode("utf-8")
    return (_HEAD.pack(MAGIC, ticket, len(name)) + name + struct.pack("!H", len(segments))
            + b"".join(struct.pack("!I", s) for s in segments))


def _decode_request(data: bytes) -> tuple[bytes, str, list[int]] | None:
    """``(ticket, tenant, segments)`` once ``data`` is a whole request; None while incomplete.
    Raises ``ValueError`` for a malformed one."""
    if len(data) < _HEAD.size:
        return None
    magic, ticket, name_len = _HEAD.unpack_from(data)
    if magic != MAGIC or name_len > MAX_TENANT_BYTES:
        raise ValueError("bad request head")
    at = _HEAD.size + name_len
    if len(data) < at + 2:
        return None
    (count,) = struct.unpack_from("!H", data, at)
    if count > MAX_SEGMENTS_PER_REQUEST:
        raise ValueError("too many segments")
    end = at + 2 + 4 * count
    if len(data) < end:
        return None
    if len(data) > end:
        raise ValueError("trailing bytes")
    segments = list(struct.unpack_from(f"!{count}I", data, at + 2))
    return ticket, data[_HEAD.size:at].decode("utf-8", "replace"), segments


class SegmentBroker(SocketServer):
    """Daemon side: hands a tenant's clients the descriptors of that tenant's segments.

    ``descriptor_for(segment, tenant)`` returns ``(fd, generation)`` for a segment holding the
    tenant's blocks now (a descriptor the broker closes after sending), None otherwise. One
    request per connection, answered and closed."""

    def __init__(self, shm_dir: str, descriptor_for: Callable[[int, str], tuple[int, int] | None],
                 tokens: TokenBook | None = None) -> None:
        self._descriptor_for = descriptor_for
        super().__init__("segment-broker", shm_dir=shm_dir, first_deadline_s=REQUEST_DEADLINE_S,
                         max_pending=MAX_PENDING, max_read=_MAX_REQUEST + 1, tokens=tokens)
        self.start()

    def received(self, fd: int, conn: Connection) -> None:
        try:
            request = _decode_request(bytes(conn.buf))
        except ValueError:
            self.end(fd, "malformed")
            return
        if request is None:
            if len(conn.buf) > _MAX_REQUEST:
                self.end(fd, "malformed")
            return
        self._answer(conn.sock, *request)
        self.end(fd, None)

    def _answer(self, conn: socket.socket, ticket: bytes, tenant: str, segments: list[int]) -> None:
        if not self.tickets.admits(ticket, tenant):
            self._refuse(conn, "refused_ticket")
            return
        handed: list[tuple[int, int, int]] = []   # (segment, fd, generation)
        try:
            for s in segments:
                got = self._descriptor_for(s, tenant)
                if got is None:
                    self._refuse(conn, "refused_segment")
                    return
                handed.append((s, *got))
            reply = _REPLY.pack(0, len(handed)) + b"".join(_ENTRY.pack(s, g) for s, _, g in handed)
            with contextlib.suppress(OSError):
                socket.send_fds(conn, [reply], [fd for _, fd, _ in handed])
                self.counts["handed"] += len(handed)
        finally:
            for _, fd, _ in handed:
                os.close(fd)

    def _refuse(self, conn: socket.socket, reason: str) -> None:
        self.counts[reason] += 1
        with contextlib.suppress(OSError):
            conn.send(_REPLY.pack(1, 0))


def request_segments(path: str, ticket: bytes, tenant: str, segments: Sequence[int],
                     timeout_s: float = 2.0) -> list[tuple[int, int, int]]:
    """Client side: ``[(segment, fd, generation)]`` for ``segments`` (the caller owns the fds).
    Raises ``PermissionError`` when the daemon refuses, ``OSError`` when it cannot be reached."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.sendall(encode_request(ticket, tenant, segments))
        data, fds, _, _ = socket.recv_fds(sock, _REPLY.size + _ENTRY.size * MAX_SEGMENTS_PER_REQUEST,
                                          MAX_SEGMENTS_PER_REQUEST)
    try:
        if len(data) < _REPLY.size:
            raise OSError("segment broker closed the connection without an answer")
        status, count = _REPLY.unpack_from(data)
        if status != 0:
            raise PermissionError("segment broker refused the request")
        if count != len(fds) or len(data) < _REPLY.size + count * _ENTRY.size:
            raise OSError("segment broker answer is malformed")
        entries = [_ENTRY.unpack_from(data, _REPLY.size + i * _ENTRY.size) for i in range(count)]
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return [(s, fd, g) for (s, g), fd in zip(entries, fds)]


class SegmentMap:
    """Client side: the daemon's arena as this tenant's segments, each mapped on first use.
    Slicing ``[off:off + n]`` and ``copy_in``/``copy_out`` work like ``shm.ArenaMap`` once
    ``ensure`` has mapped the segments a lease names (at the generations it names)."""

    def __init__(self, path: str, ticket: bytes, tenant: str, segment_bytes: int, timeout_s: float = 2.0) -> None:
        if segment_bytes <= 0:
            raise OSError("the daemon announced no segment size")
        self.path = path
        self._ticket, self._tenant = ticket, tenant
        self.segment_bytes = segment_bytes
        self.timeout_s = timeout_s
        self._maps: dict[int, tuple[int, np.ndarray]] = {}   # segment -> (generation, its mapping)
        request_segments(path, ticket, tenant, [], timeout_s)   # reachable, and our ticket is good

    def ensure(self, extents) -> None:
        """Map (again) every segment an extent of a lease lies in whose generation we lack;
        ``extents`` have ``offset`` and ``generation`` (``shm_path.lease_slots``' pieces)."""
        wanted = {e.offset // self.segment_bytes: e.generation for e in extents}
        missing = sorted(s for s, g in wanted.items() if self._maps.get(s, (None,))[0] != g)
        for at in range(0, len(missing), MAX_SEGMENTS_PER_REQUEST):
            for s, fd, generation in request_segments(self.path, self._ticket, self._tenant,
                                                      missing[at:at + MAX_SEGMENTS_PER_REQUEST], self.timeout_s):
                try:
                    size = os.fstat(fd).st_size
                    self._maps[s] = (generation, np.frombuffer(mmap.mmap(fd, size), dtype=np.uint8))
                finally:
                    os.close(fd)
                if generation != wanted[s]:
                    raise OSError(f"segment {s} is at generation {generation}, the lease named {wanted[s]}")

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop = window.start or 0, window.stop
        s = start // self.segment_bytes
        base = s * self.segment_bytes
        return self._maps[s][1][start - base:stop - base]

    def copy_out(self, extents: Sequence[tuple[int, int]], dst: np.ndarray) -> int:
        return gather(self, extents, dst)

    def copy_in(self, extents: Sequence[tuple[int, int]], src: np.ndarray) -> int:
        return scatter(self, extents, src)

    def copy_each_out(self, offsets: Sequence[int], lengths: Sequence[int], dsts: Sequence[np.ndarray]) -> None:
        copy_each(self, offsets, lengths, dsts)

    def copy_each_in(self, offsets: Sequence[int], srcs: Sequence[np.ndarray], before_part=None,
                     threads: int | None = None) -> None:
        copy_each_in(self, offsets, srcs, before_part, threads)

    def close(self) -> None:
        self._maps = {}   # each mapping closes once no view of it is left
