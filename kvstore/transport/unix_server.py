"""The daemon end of a same-host Unix-socket service: one epoll thread, bounded connections.

Used by the segment broker (``segments``) and the lookup service (``local_lookup``). The socket
lives in ``shm_dir`` beside the arena (a path every same-host client, even in another container
sharing that directory, can reach), mode 0666: what admits a client is the ticket it sends, not
who it is. Nothing grows with idle or hostile connections: every connection has a deadline (the
subclass moves it); at most ``max_pending`` have not yet proved a tenant with a ticket (a new one
pushes the oldest of those out) and at most ``max_connections`` per tenant are admitted (a new one
pushes that tenant's least recently active out), so one tenant's connections, or anyone's
unproven ones, never push out another tenant's; one thread serves them all. An answer another thread sends (``send_soon``) never
waits for its reader: what the socket does not take at once, this thread writes later, and a
connection that leaves it untaken for ``SEND_WITHIN_S`` is ended. Sockets left by daemons that
died are swept at start.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import os
import re
import secrets
import select
import socket
import threading
import time
from collections import Counter, OrderedDict

from kvstore.transport.tickets import Tickets, TokenBook

log = logging.getLogger("kvstore.transport.unix_server")

_SOCKET_NAME = re.compile(r"^kvstore-(\d+)-[0-9a-f]{8}\.sock$")


SEND_WITHIN_S = 2.0   # an answer still not taken this long after it was ready ends its connection
_READ = select.EPOLLIN | select.EPOLLRDHUP   # what a connection is watched for (and EPOLLOUT while it has unsent bytes)


class Connection:
    """One client's connection; ``busy`` while a call it sent runs on another thread, ``unsent``
    what ``send_soon`` left for this server's thread to write (``unsent_until``: by when)."""
    __slots__ = ("sock", "buf", "deadline", "tenant", "ticket", "checked", "busy", "unsent", "unsent_until")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock, self.buf, self.deadline, self.tenant, self.busy = sock, bytearray(), deadline, None, False
        self.ticket = b""
        self.checked = 0   # the token book's generation its ticket was last checked at
        self.unsent: memoryview | None = None
        self.unsent_until = 0.0


class UnixServer:
    """Subclasses implement ``received(fd, conn)``: called with ``conn.buf`` grown by new bytes
    (it consumes what it can, answers on ``conn.sock``, may ``end(fd, reason)``).

    Tickets (``transport.tickets``): Handshake hands a caller ``ticket_for(its tenant, its
    token's digest)``, which the client presents here; a subclass that admits a connection with
    one calls ``admit``. A connection whose ticket the current tokens no longer admit is ended
    (``revoked``) before its next frame is read, and within a tick of the token change."""

    def __init__(self, shm_dir: str, name: str, max_connections: int, first_deadline_s: float,
                 max_read: int = 1 << 16, tokens: TokenBook | None = None, max_pending: int = 64,
                 max_tenants: int = 16) -> None:
        sweep_stale_sockets(shm_dir)
        self.tickets = Tickets(name, tokens)
        self._swept = self.tickets.generation
        self.max_connections, self.first_deadline_s, self.max_read = max_connections, first_deadline_s, max_read
        self.max_pending = min(max_pending, max_connections)
        self.max_total = max_connections * max_tenants
        self._per_tenant: Counter[str] = Counter()   # admitted connections by tenant
        self.path = os.path.join(shm_dir, f"kvstore-{os.getpid()}-{secrets.token_hex(4)}.sock")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.path)
        os.chmod(self.path, 0o666)
        self._listener.listen(128)
        self._listener.setblocking(False)
        self._poller = select.epoll()
        self._poller.register(self._listener.fileno(), select.EPOLLIN)
        self.conns: OrderedDict[int, Connection] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"kvstore-{name}", daemon=True)
        self._thread.start()

    def received(self, fd: int, conn: Connection) -> None:
        raise NotImplementedError

    def ticket_for(self, tenant: str, token_digest: bytes = b"") -> bytes:
        return self.tickets.issue(tenant, token_digest)

    def ticket_admits(self, ticket: bytes, tenant: str) -> bool:
        return self.tickets.admits(ticket, tenant)

    def admit(self, conn: Connection, ticket: bytes, tenant: str) -> bool:
        """Admit ``conn`` as ``tenant`` if ``ticket`` is good now; it is checked again whenever
        the tokens change."""
        generation = self.tickets.generation
        if not self.tickets.admits(ticket, tenant) or len(self.conns) > self.max_total:
            return False
        if self._per_tenant[tenant] >= self.max_connections:   # a tenant's connections push out only its own
            self.end(next(fd for fd, c in self.conns.items() if c.tenant == tenant), "pushed_out")
        conn.tenant, conn.ticket, conn.checked = tenant, ticket, generation
        self._per_tenant[tenant] += 1
        return True

    def _still_admitted(self, conn: Connection) -> bool:
        generation = self.tickets.generation
        if conn.tenant is None or conn.checked == generation:
            return True
        if not self.tickets.admits(conn.ticket, conn.tenant):
            return False
        conn.checked = generation
        return True

    def _loop(self) -> None:
        while not self._closed.is_set():
            try:
                events = self._poller.poll(0.25)
            except OSError:
                return
            for fd, mask in events:
                try:
                    if fd == self._listener.fileno():
                        self._accept()
                    elif fd in self.conns:
                        if mask & select.EPOLLOUT:
                            self._writable(fd)
                        if mask & ~select.EPOLLOUT and fd in self.conns:
                            self._readable(fd)
                except Exception:  # noqa: BLE001 - one bad connection must not stop the service
                    log.exception("%s: handling a connection failed", self._thread.name)
                    self.end(fd, "failed")
            now = time.monotonic()
            sweep = self._swept != self.tickets.generation
            if sweep:
                self._swept = self.tickets.generation
            for fd, conn in list(self.conns.items()):
                if sweep and not self._still_admitted(conn):
                    self.end(fd, "revoked")
                elif conn.deadline < now:
                    self.end(fd, "timed_out")
                elif conn.unsent is not None and conn.unsent_until < now:
                    self.end(fd, "stalled")   # it does not take its answer

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:   # e.g. out of descriptors: back off instead of spinning on the listener
                time.sleep(0.05)
                return
            sock.setblocking(False)
            pending = [fd for fd, c in self.conns.items() if c.tenant is None]
            if len(pending) >= self.max_pending:   # an unproven connection pushes out only unproven ones
                self.end(pending[0], "pushed_out")
            self._poller.register(sock.fileno(), _READ)
            self.conns[sock.fileno()] = Connection(sock, time.monotonic() + self.first_deadline_s)

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
                    self._poller.modify(fd, _READ | select.EPOLLOUT)

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
        self._poller.modify(fd, _READ)

    def end(self, fd: int, reason: str | None) -> None:
        if reason and fd in self.conns:   # counted before it leaves, so no reader sees it gone uncounted
            self.counts[reason] += 1
        conn = self.conns.pop(fd, None)
        if conn is None:
            return
        if conn.tenant is not None:
            self._per_tenant[conn.tenant] -= 1
            if not self._per_tenant[conn.tenant]:
                del self._per_tenant[conn.tenant]
        with contextlib.suppress(OSError, ValueError):
            self._poller.unregister(fd)
        conn.sock.close()

    def close(self) -> None:
        self._closed.set()
        self._thread.join(2)
        for fd in list(self.conns):
            self.end(fd, None)
        self._listener.close()
        self._poller.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def sweep_stale_sockets(shm_dir: str) -> None:
    """Unlink service sockets left by daemons that died without closing (kill -9)."""
    for path in glob.glob(os.path.join(shm_dir, "kvstore-*.sock")):
        m = _SOCKET_NAME.match(os.path.basename(path))
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            with contextlib.suppress(OSError):
                os.unlink(path)
        except PermissionError:
            pass
