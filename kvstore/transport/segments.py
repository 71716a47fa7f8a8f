"""Same-host zero-copy with authentication on: a tenant's arena segments, handed over by descriptor.

With tokens configured the daemon's CPU arena is one sealed ``memfd`` per segment, each holding
one tenant's blocks (``kvstore.tiers.cpu``). No path leads to them. A client gets the
descriptors of its own tenant's segments over a Unix socket in ``shm_dir``: it sends the ticket
Handshake gave it (bound to its token and checked against the current tokens on every request:
``transport.tickets``) and the segment numbers a lease named; the daemon answers with
``SCM_RIGHTS`` descriptors only for segments that hold that tenant's blocks at that moment, else
refuses the whole request.

Lease extents carry their segment's generation; a segment that passed to another tenant and back
has a new generation (and new memory), so a client maps it again rather than reading its old
mapping. Segments of another tenant never reach a client: not by path, not by descriptor.

Every answer to a good ticket also names the tenant's replaced segments (``(segment,
generation)``) that a descriptor or mapping somewhere still holds; ``SegmentMap`` lets go of
its mappings of them. The daemon counts them against the tenant until they are gone, and
refuses a request that would take the tenant past ``max_held_segment_bytes_per_tenant``
(status ``LIMIT``); the client then lets go of what the refusal named and asks once more.

Both ends live here. The daemon's (``SegmentBroker``) reads each request under the bounds of
``socket_server`` on connections not proved yet (whole within ``FIRST_DEADLINE_S``).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import socket
import struct
from collections.abc import Callable, Sequence
from typing import NamedTuple

import numpy as np

from kvstore.errors import QuotaExceeded
from kvstore.transport.shm import MappedArena
from kvstore.transport.socket_server import (GREETING, MAX_TENANT_BYTES, Connection, SocketServer, connect,
                                            read_greeting)
from kvstore.transport.tickets import TokenBook

MAGIC = b"KVSG"
MAX_SEGMENTS_PER_REQUEST = 64
MAX_REPLACED_LISTED = 1024
LIMIT_SETTING = "max_held_segment_bytes_per_tenant"
OK, REFUSED, LIMIT = 0, 1, 2   # answer statuses
_REPLY = struct.Struct("!BHH")         # status, count, replaced count; then (segment I, generation Q) each, handed
_ENTRY = struct.Struct("!IQ")          # first, then replaced
_MAX_REQUEST = GREETING.size + MAX_TENANT_BYTES + 2 + 4 * MAX_SEGMENTS_PER_REQUEST
_MAX_REPLY = _REPLY.size + _ENTRY.size * (MAX_SEGMENTS_PER_REQUEST + MAX_REPLACED_LISTED)


def _decode_request(data: bytes) -> tuple[bytes, str, list[int]] | None:
    """``(ticket, tenant, segments)`` once ``data`` is a whole request: the greeting
    (``socket_server.greeting``), ``u16`` count, ``u32`` segments. None while incomplete;
    ``ValueError`` for a malformed one."""
    greeted = read_greeting(data, MAGIC)
    if greeted is None:
        return None
    ticket, tenant, at = greeted
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
    return ticket, tenant, list(struct.unpack_from(f"!{count}I", data, at + 2))


class SegmentBroker(SocketServer):
    """Daemon side: hands a tenant's clients the descriptors of that tenant's segments.

    ``descriptor_for(segment, tenant)`` returns ``(fd, generation)`` for a segment holding the
    tenant's blocks now (a descriptor the broker closes after sending), None otherwise, and raises
    ``QuotaExceeded`` past the tenant's limit; ``replaced_for(tenant)`` names the tenant's replaced
    segments still held. One request per connection, answered and closed."""

    def __init__(self, shm_dir: str, descriptor_for: Callable[[int, str], tuple[int, int] | None],
                 replaced_for: Callable[[str], list[tuple[int, int]]],
                 tokens: TokenBook | None = None) -> None:
        self._descriptor_for = descriptor_for
        self._replaced_for = replaced_for
        super().__init__("segment-broker", shm_dir=shm_dir, max_read=_MAX_REQUEST + 1, tokens=tokens)
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

    def _answer(self, sock: socket.socket, ticket: bytes, tenant: str, segments: list[int]) -> None:
        if not self.tickets.admits(ticket, tenant):
            self._refuse(sock, "refused_ticket", REFUSED, [])
            return
        handed: list[tuple[int, int, int]] = []   # (segment, fd, generation)
        try:
            for s in segments:
                try:
                    got = self._descriptor_for(s, tenant)
                except QuotaExceeded:
                    self._refuse(sock, "refused_limit", LIMIT, self._replaced_for(tenant))
                    return
                if got is None:
                    self._refuse(sock, "refused_segment", REFUSED, self._replaced_for(tenant))
                    return
                handed.append((s, *got))
            reply = _reply(OK, [(s, g) for s, _, g in handed], self._replaced_for(tenant))
            with contextlib.suppress(OSError):
                socket.send_fds(sock, [reply], [fd for _, fd, _ in handed])
                self.counts["handed"] += len(handed)
        finally:
            for _, fd, _ in handed:
                os.close(fd)

    def _refuse(self, sock: socket.socket, reason: str, status: int, replaced: list[tuple[int, int]]) -> None:
        self.counts[reason] += 1
        with contextlib.suppress(OSError):
            sock.send(_reply(status, [], replaced))


def _reply(status: int, handed: list[tuple[int, int]], replaced: list[tuple[int, int]]) -> bytes:
    replaced = replaced[:MAX_REPLACED_LISTED]
    return (_REPLY.pack(status, len(handed), len(replaced))
            + b"".join(_ENTRY.pack(s, g) for s, g in handed + replaced))


class Answer(NamedTuple):
    """The broker's answer: ``handed`` as ``(segment, fd, generation)`` (the caller owns the fds),
    and the tenant's replaced segments still held, as ``(segment, generation)``."""
    handed: list[tuple[int, int, int]]
    replaced: list[tuple[int, int]]


class OverHeldLimit(PermissionError):
    """The tenant's clients hold ``max_held_segment_bytes_per_tenant`` of segments already;
    ``replaced`` names its replaced ones still held."""

    def __init__(self, replaced: list[tuple[int, int]]) -> None:
        super().__init__(f"segment broker refused: {LIMIT_SETTING} reached (this tenant's clients still "
                         f"hold {len(replaced)} replaced segments)")
        self.replaced = replaced


def ask(path: str, ticket: bytes, tenant: str, segments: Sequence[int], timeout_s: float = 2.0) -> Answer:
    """Client side: the broker's ``Answer`` for ``segments``. Raises ``OverHeldLimit`` or
    ``PermissionError`` when the daemon refuses, ``OSError`` when it cannot be reached."""
    with connect(path, MAGIC, ticket, tenant, timeout_s) as sock:
        sock.sendall(struct.pack(f"!H{len(segments)}I", len(segments), *segments))
        data = bytearray()
        fds: list[int] = []
        try:
            while not _whole(data):   # an answer with a long replaced list may come in several reads
                chunk, got, _, _ = socket.recv_fds(sock, _MAX_REPLY - len(data), MAX_SEGMENTS_PER_REQUEST)
                data += chunk
                fds += got
                if not chunk:
                    raise OSError("segment broker closed the connection without a whole answer")
            status, count, n_replaced = _REPLY.unpack_from(data)
            if count != len(fds):
                raise OSError("segment broker answer is malformed")
            entries = [_ENTRY.unpack_from(data, _REPLY.size + i * _ENTRY.size) for i in range(count + n_replaced)]
            replaced = entries[count:]
            if status == LIMIT:
                raise OverHeldLimit(replaced)
            if status != OK:
                raise PermissionError("segment broker refused the request")
        except BaseException:
            for fd in fds:
                os.close(fd)
            raise
    return Answer([(s, fd, g) for (s, g), fd in zip(entries, fds)], replaced)


def _whole(data: bytearray) -> bool:
    if len(data) < _REPLY.size:
        return False
    _, count, n_replaced = _REPLY.unpack_from(data)
    return len(data) == _REPLY.size + (count + n_replaced) * _ENTRY.size


class SegmentMap(MappedArena):
    """Client side: the daemon's arena as this tenant's segments, each mapped on first use.
    Slicing ``[off:off + n]`` and ``copy_in``/``copy_out`` work like ``shm.ArenaMap`` once
    ``ensure`` has mapped the segments a lease names (at the generations it names)."""

    def __init__(self, path: str, ticket: bytes, tenant: str, segment_bytes: int, timeout_s: float = 2.0) -> None:
        if segment_bytes <= 0:
            raise OSError("the daemon announced no segment size")
        self.path = path
        self.segment_bytes = segment_bytes
        self._ask_broker = functools.partial(ask, path, ticket, tenant, timeout_s=timeout_s)
        self._maps: dict[int, tuple[int, mmap.mmap, np.ndarray]] = {}   # segment -> (generation, mapping, array)
        self._ask([])   # reachable, and our ticket is good

    def ensure(self, extents) -> None:
        """Map (again) every segment an extent of a lease lies in whose generation we lack;
        ``extents`` have ``offset`` and ``generation`` (``shm_path.lease_slots``' pieces)."""
        wanted = {e.offset // self.segment_bytes: e.generation for e in extents}
        missing = sorted(s for s, g in wanted.items() if self._maps.get(s, (None,))[0] != g)
        for at in range(0, len(missing), MAX_SEGMENTS_PER_REQUEST):
            for s, fd, generation in self._ask(missing[at:at + MAX_SEGMENTS_PER_REQUEST]):
                try:
                    size = os.fstat(fd).st_size
                    m = mmap.mmap(fd, size)
                finally:
                    os.close(fd)
                self._unmap(s)
                self._maps[s] = (generation, m, np.frombuffer(m, dtype=np.uint8))
                if generation != wanted[s]:
                    raise OSError(f"segment {s} is at generation {generation}, the lease named {wanted[s]}")

    def _ask(self, segments: list[int]) -> list[tuple[int, int, int]]:
        """The broker's descriptors for ``segments``; replaced segments it names are let go of
        first, and a refusal for holding too many is answered by letting go and asking once more."""
        try:
            answer = self._ask_broker(segments)
        except OverHeldLimit as e:
            self._let_go(e.replaced)
            answer = self._ask_broker(segments)
        self._let_go(answer.replaced)
        return answer.handed

    def _let_go(self, replaced: list[tuple[int, int]]) -> None:
        for s, generation in replaced:
            if self._maps.get(s, (None,))[0] == generation:
                self._unmap(s)

    def _unmap(self, s: int) -> None:
        entry = self._maps.pop(s, None)
        if entry is None:
            return
        m = entry[1]
        del entry   # the array's hold on the mapping goes first
        with contextlib.suppress(BufferError):   # a caller's view still holds it: it goes with that view
            m.close()

    @property
    def memory(self):
        return self   # extents slice it (``__getitem__``)

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop = window.start or 0, window.stop
        s = start // self.segment_bytes
        base = s * self.segment_bytes
        return self._maps[s][2][start - base:stop - base]

    def close(self) -> None:
        self._maps = {}   # each mapping closes once no view of it is left
