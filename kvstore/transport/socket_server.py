"""The daemon's socket servers share this base: the side channel (TCP, ``bulk_server``), the lookup
and lease-call socket (``local_lookup``) and the segment broker (``segments``), both Unix sockets.

Threads. Each server runs one thread (``kvstore-<name>``) that owns its listening socket, its epoll
set and every connection in ``conns``: only it accepts, reads, calls the protocol's
``received(fd, conn)``, moves deadlines and ends connections, so ``conns`` needs no lock. Other
threads reach a server only through ``ticket_for`` (Handshake), ``send_soon`` (an answer computed
elsewhere: what the socket does not take at once this thread writes later), the counters and
``close``. A protocol may ``hand_off`` a connection whose ticket it checked to a table of its own
(the side channel lends sessions to RPC handlers) and watch it in the same epoll set; its hooks
``watched``, ``tick`` and ``revoked`` run on this thread too, and that table needs its own lock.

Caps: nothing grows with idle or hostile connections.
* A connection that has not yet proved a tenant with a ticket (its greeting, or its one request)
  must do so within ``FIRST_DEADLINE_S``; at most ``MAX_PENDING`` of those are open, and a new one
  pushes the least recently active of them out, so unproven connections push out only each other
  and a flood of silent ones delays a real client by no more than its round trip.
* A tenant has at most ``max_per_tenant`` admitted connections (a new one pushes out that tenant's
  least recently active), and all tenants together at most ``max_per_tenant * MAX_TENANTS``
  (beyond that a ticket is refused): one tenant never pushes out another's connections.
* When ``accept`` fails (out of descriptors or memory) the listener is left unwatched until the
  next tick instead of spinning on it; connections already open are served meanwhile.

Tickets (``transport.tickets``): Handshake hands a caller ``ticket_for(its tenant, its token's
digest)``; a Unix-socket client presents it in its ``greeting``, which ``greet`` admits by. A
connection admitted with one is checked again before its next frame is read once the tokens have
changed, and every connection whose ticket they no longer admit is ended (``revoked``) within a
tick (``TICK_S``) of the change. Deadlines and send bounds are checked every tick too.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import select
import socket
import struct
import threading
import time
from collections import Counter, OrderedDict

from kvstore import dead_owners
from kvstore.transport.tickets import Tickets, TokenBook

log = logging.getLogger("kvstore.transport.socket_server")

TICK_S = 0.25            # deadlines, send bounds and revocations are checked at least this often
SEND_WITHIN_S = 2.0      # an answer still not taken this long after it was ready ends its connection
FIRST_DEADLINE_S = 2.0   # a connection must prove a tenant within this long of being accepted
MAX_PENDING = 64         # connections that have not proved one yet, at most
MAX_TENANTS = 16         # tenants' worth of admitted connections, at most
MAX_TENANT_BYTES = 256   # a tenant's name in a greeting, at most
GREETING = struct.Struct("!4s32sH")   # a Unix-socket greeting: magic, ticket, tenant length; then the tenant
_READ = select.EPOLLIN | select.EPOLLRDHUP   # what a connection is watched for (and EPOLLOUT while it has unsent bytes)
_SOCKET_NAME = re.compile(r"^kvstore-(\d+)-[0-9a-f]{8}\.sock$")


class Connection:
    """One client's connection; ``tenant`` once a ticket admitted it, ``busy`` while a call it
    sent runs on another thread, ``unsent`` what ``send_soon`` left for the server's thread to
    write (``unsent_until``: by when)."""
    __slots__ = ("sock", "buf", "deadline", "tenant", "ticket", "checked", "busy", "unsent", "unsent_until")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.buf, self.deadline, self.tenant, self.busy = sock, bytearray(), deadline, None, False
        self.ticket = b""
        self.checked = 0   # the token book's generation its ticket was last checked at
        self.unsent: memoryview | None = None
        self.unsent_until = 0.0


class SocketServer:
    """Listens on ``host`` (TCP, any free port: ``port``) or in ``shm_dir`` (a Unix socket,
    ``path``). Subclasses implement ``received(fd, conn)``: called on the server's thread with
    ``conn.buf`` grown by new bytes; it consumes what it can, answers on ``conn.sock``, and may
    ``admit``, ``end`` or ``hand_off`` the connection. They call ``start()`` once built."""

    def __init__(self, name: str, *, host: str | None = None, shm_dir: str | None = None, max_per_tenant: int = 0,
                 max_read: int = 1 << 16, tokens: TokenBook | None = None, ticket_bytes: int = 32,
                 remember_tickets: int = 0) -> None:
        self.name = name
        self.tickets = Tickets(name, tokens, size=ticket_bytes, remember=remember_tickets)
        self._swept = self.tickets.generation
        self.max_read, self.max_per_tenant = max_read, max_per_tenant
        self._per_tenant: Counter[str] = Counter()   # admitted connections by tenant
        self.port, self.path = 0, None
        if shm_dir is not None:   # beside the arena, where same-host clients (other containers too) reach it
            dead_owners.sweep(shm_dir, _SOCKET_NAME)   # sockets of daemons that died without closing (kill -9)
            self.path = os.path.join(shm_dir, f"kvstore-{os.getpid()}-{secrets.token_hex(4)}.sock")
            self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._listener.bind(self.path)
            os.chmod(self.path, 0o666)   # the ticket admits a client, not who it is
        else:
            self._listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._listener.bind((host, 0))
            self.port = self._listener.getsockname()[1]
        self._listener.listen(256)
        self._listener.setblocking(False)
        self._wake_reader, self._wake_writer = socket.socketpair()
        self.poller = select.epoll()
        self.poller.register(self._listener.fileno(), select.EPOLLIN)
        self.poller.register(self._wake_reader.fileno(), select.EPOLLIN)
        self._accept_failing = False   # the listener is unwatched until the next tick
        self.conns: OrderedDict[int, Connection] = OrderedDict()   # least recently active first
        self.counts: Counter[str] = Counter()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name=f"kvstore-{name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    # -- what protocols implement ------------------------------------------------------------------

    def received(self, fd: int, conn: Connection) -> None:
        raise NotImplementedError

    def watched(self, fd: int, events: int) -> None:
        """An fd the protocol registered in ``poller`` itself turned ready."""

    def tick(self, now: float) -> None:
        """Called every ``TICK_S`` on the server's thread."""

    def revoked(self) -> None:
        """The tokens changed: end what the protocol holds outside ``conns`` that they no longer admit."""

    # -- tickets and admission ---------------------------------------------------------------------

    def ticket_for(self, tenant: str, token_digest: bytes = b"") -> bytes:
        return self.tickets.issue(tenant, token_digest)

    def admit(self, conn: Connection, ticket: bytes, tenant: str) -> bool:
        """Admit ``conn`` as ``tenant`` if ``ticket`` is good now (checked again whenever the
        tokens change); a tenant at its cap loses its least recently active connection."""
        generation = self.tickets.generation
        if not self.tickets.admits(ticket, tenant) or len(self.conns) > self.max_per_tenant * MAX_TENANTS:
            return False
        if self._per_tenant[tenant] >= self.max_per_tenant:
            self.end(next(fd for fd, c in self.conns.items() if c.tenant == tenant), "pushed_out")
        conn.tenant, conn.ticket, conn.checked = tenant, ticket, generation
        self._per_tenant[tenant] += 1
        return True

    def greet(self, fd: int, conn: Connection, magic: bytes) -> bool:
        """Admit ``conn`` by the greeting at the start of ``conn.buf`` (``greeting``), taken off the
        buffer; False while it is incomplete, and once it ended the connection (``refused``)."""
        try:
            greeted = read_greeting(conn.buf, magic)
            if greeted is None:
                return False
            ticket, tenant, size = greeted
            admitted = self.admit(conn, ticket, tenant)
        except ValueError:
            admitted = False
        if not admitted:
            self.end(fd, "refused")
            return False
        del conn.buf[:size]
        return True

    def _still_admitted(self, conn: Connection) -> bool:
        generation = self.tickets.generation
        if conn.tenant is None or conn.checked == generation:
            return True
        if not self.tickets.admits(conn.ticket, conn.tenant):
            return False
        conn.checked = generation
        return True

    # -- the server's thread -----------------------------------------------------------------------

    def _loop(self) -> None:
        listener_fd, wake_fd = self._listener.fileno(), self._wake_reader.fileno()
        next_tick = time.monotonic() + TICK_S
        while True:
            try:
                events = self.poller.poll(max(0.0, next_tick - time.monotonic()))
            except (OSError, ValueError):
                return   # closed under us
            for fd, mask in events:
                if fd == wake_fd:
                    return
                try:
                    if fd == listener_fd:
                        self._accept()
                    elif fd in self.conns:
                        if mask & select.EPOLLOUT:
                            self._writable(fd)
                        if mask & ~select.EPOLLOUT and fd in self.conns:
                            self._readable(fd)
                    else:
                        self.watched(fd, mask)
                except Exception:  # noqa: BLE001 - one bad connection must not stop the service
                    log.exception("%s: handling a connection failed", self.name)
                    self.end(fd, "failed")
            now = time.monotonic()
            if self._swept != self.tickets.generation:
                self._swept = self.tickets.generation
                for fd in [fd for fd, c in self.conns.items() if not self._still_admitted(c)]:
                    self.end(fd, "revoked")
                self.revoked()
            if now >= next_tick:
                self._expire(now)
                self.tick(now)
                next_tick = now + TICK_S

    def _expire(self, now: float) -> None:
        if self._accept_failing:
            self.poller.modify(self._listener.fileno(), select.EPOLLIN)
        for fd, conn in list(self.conns.items()):
            if conn.deadline < now:
                self.end(fd, "timed_out")
            elif conn.unsent is not None and conn.unsent_until < now:
                self.end(fd, "stalled")   # it does not take its answer

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:   # e.g. out of descriptors: the listener stays ready, so stop watching it a while
                if not self._accept_failing:
                    log.warning("%s: accept failed (retried every %.2fs until it works): %s", self.name, TICK_S, e)
                self._accept_failing = True
                self.counts["accept_failed"] += 1
                self.poller.modify(self._listener.fileno(), 0)
                return
            self._accept_failing = False
            sock.setblocking(False)
            if self.pending >= MAX_PENDING:
                self.end(next(fd for fd, c in self.conns.items() if c.tenant is None), "pushed_out")
            self.poller.register(sock.fileno(), _READ)
            self.conns[sock.fileno()] = Connection(sock, time.monotonic() + FIRST_DEADLINE_S)

    def _readable(self, fd: int) -> None:
        conn = self.conns[fd]
        try:
            chunk = conn.sock.recv(self.max_read)
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.end(fd, "closed")
            return
        if not self._still_admitted(conn):
            self.end(fd, "revoked")
            return
        conn.buf += chunk
        self.conns.move_to_end(fd)
        self.received(fd, conn)

    def send_soon(self, fd: int, conn: Connection, data: bytes) -> None:
        """Send ``data`` on ``conn`` from any thread without waiting for its reader: what the
        socket does not take now, this server's thread writes when it can, within
        ``SEND_WITHIN_S`` (else the connection ends). So a caller that stops reading holds up
        no thread of the daemon, only its own connection."""
        try:
            sent = conn.sock.send(data)
        except BlockingIOError:
            sent = 0
        except OSError:
            return   # gone: its hangup reaches this server's thread
        if sent < len(data):
            conn.unsent_until = time.monotonic() + SEND_WITHIN_S
            conn.unsent = memoryview(data)[sent:]
            with contextlib.suppress(OSError, ValueError):   # ended meanwhile: nothing to write to
                if self.conns.get(fd) is conn:
                    self.poller.modify(fd, _READ | select.EPOLLOUT)

    def _writable(self, fd: int) -> None:
        conn = self.conns[fd]
        if conn.unsent is not None:
            try:
                conn.unsent = conn.unsent[conn.sock.send(conn.unsent):]
            except BlockingIOError:
                return
            except OSError:
                self.end(fd, "closed")
                return
            if conn.unsent:
                return
            conn.unsent = None
        self.poller.modify(fd, _READ)

    def hand_off(self, fd: int) -> socket.socket:
        """Take ``fd``'s connection out of this server (unwatched, not closed) for the protocol to keep."""
        conn = self.conns.pop(fd)
        if conn.tenant is not None:
            self._per_tenant[conn.tenant] -= 1
            if not self._per_tenant[conn.tenant]:
                del self._per_tenant[conn.tenant]
        with contextlib.suppress(OSError, ValueError):
            self.poller.unregister(fd)
        return conn.sock

    def end(self, fd: int, reason: str | None) -> None:
        if fd in self.conns:
            if reason:   # counted before it leaves, so no reader sees it gone uncounted
                self.counts[reason] += 1
            self.hand_off(fd).close()

    @property
    def pending(self) -> int:
        """Connections that have not proved a tenant yet."""
        return len(self.conns) - self._per_tenant.total()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"x")
        if self._thread.is_alive():
            self._thread.join(5.0)
        for fd in list(self.conns):
            self.end(fd, None)
        self._listener.close()
        self.poller.close()
        self._wake_reader.close()
        self._wake_writer.close()
        if self.path is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)


def greeting(magic: bytes, ticket: bytes, tenant: str) -> bytes:
    """What a client of a Unix-socket service sends first: the service's magic, the ticket
    Handshake gave it and its tenant's name."""
    name = tenant.encode("utf-8")
    return GREETING.pack(magic, ticket, len(name)) + name


def connect(path: str, magic: bytes, ticket: bytes, tenant: str, timeout_s: float) -> socket.socket:
    """A client's connection to the Unix-socket service at ``path``, greeted; ``timeout_s`` bounds each wait on it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.sendall(greeting(magic, ticket, tenant))
    except OSError:
        sock.close()
        raise
    return sock


def read_greeting(buf, magic: bytes) -> tuple[bytes, str, int] | None:
    """``(ticket, tenant, its length)`` of the greeting ``buf`` starts with; None while it is
    incomplete. ``ValueError`` for another service's magic or a name over ``MAX_TENANT_BYTES``."""
    if len(buf) < GREETING.size:
        return None
    got, ticket, name_len = GREETING.unpack_from(buf)
    if got != magic or name_len > MAX_TENANT_BYTES:
        raise ValueError("not a greeting of this service")
    end = GREETING.size + name_len
    return (ticket, bytes(buf[GREETING.size:end]).decode("utf-8", "replace"), end) if len(buf) >= end else None
