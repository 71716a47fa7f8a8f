"""Daemon end of the bulk side channel: one I/O thread accepts, greets and watches every connection.

Nothing here grows with idle or hostile connections. A connection that has not finished its
greeting (``MAGIC + ticket``, see ``kvstore.transport.bulk``) within ``GREETING_DEADLINE_S`` is
closed; at most ``MAX_PENDING_GREETINGS`` wait at once (a new one pushes out the oldest, so a
flood of silent connections delays a real client's greeting by no more than its round trip).
Greeted connections become sessions (``kvstore.transport.bulk_sessions``): closed when their client
goes, after ``SESSION_IDLE_S`` idle, or least-recently-used first when ``MAX_SESSIONS`` are open.
All of it runs on a single epoll loop thread; RPC handlers borrow sessions' sockets.

Tickets bind sessions to tenants: Handshake hands a caller ``ticket_for(its tenant, its token's
digest)`` (``transport.tickets``), and the session a ticket opens answers only RPCs of that
tenant. A ticket whose token a reload removed or changed opens nothing, and the sessions it
opened are closed within ``REVOKE_WITHIN_S``.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import select
import socket
import threading
import time
from collections import OrderedDict

from kvstore.transport.bulk import GREETING_BYTES, MAGIC, TICKET_BYTES
from kvstore.transport.bulk_sessions import Session, SessionTable
from kvstore.transport.tickets import Tickets, TokenBook

log = logging.getLogger("kvstore.transport.bulk_server")

GREETING_DEADLINE_S = 2.0      # a connection must send its greeting within this long of being accepted
MAX_PENDING_GREETINGS = 64     # connections accepted and not yet greeted, at most
SESSION_IDLE_S = 300.0         # a session unused this long is closed (its client reconnects on next use)
MAX_SESSIONS = 1024            # open sessions; the least recently used idle one makes room for a new one
MAX_TICKET_TENANTS = 4096      # tickets remembered (bounded by the configured tokens)
REVOKE_WITHIN_S = 0.25         # sessions of a revoked token are closed this soon after the tokens change
_WATCH_GREETING = select.EPOLLIN | select.EPOLLRDHUP


class _Greeting:
    __slots__ = ("sock", "received", "deadline")

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self.sock = sock
        self.received = b""
        self.deadline = deadline


class BulkServer:
    """Daemon side: accepts side-channel connections and lends their sockets to RPC handlers."""

    def __init__(self, host: str, *, idle_s: float = SESSION_IDLE_S, greeting_deadline_s: float = GREETING_DEADLINE_S,
                 max_pending_greetings: int = MAX_PENDING_GREETINGS, max_sessions: int = MAX_SESSIONS,
                 tokens: TokenBook | None = None) -> None:
        self.tickets = Tickets("side-channel", tokens, size=TICKET_BYTES)
        self._tenant_by_ticket: OrderedDict[bytes, str] = OrderedDict()
        self._tickets_lock = threading.Lock()
        self.greeting_deadline_s = greeting_deadline_s
        self.max_pending_greetings = max_pending_greetings
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(256)
        self._listener.setblocking(False)
        self.port = self._listener.getsockname()[1]
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._poller = select.epoll()
        self._poller.register(self._listener.fileno(), select.EPOLLIN)
        self._poller.register(self._wake_reader.fileno(), select.EPOLLIN)
        self._greetings: OrderedDict[int, _Greeting] = OrderedDict()   # by fd, oldest first
        self.sessions = SessionTable(self._poller, max_sessions, idle_s)
        self.counts = {"greetings_timed_out": 0, "greetings_pushed_out": 0, "greetings_abandoned": 0,
                       "greetings_refused": 0}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvstore-bulk-io", daemon=True)
        self._thread.start()

    # -- what RPC handlers use ---------------------------------------------------------------------

    def ticket_for(self, tenant: str, token_digest: bytes = b"") -> bytes:
        """The ticket a Handshake of ``tenant`` hands out: it opens sessions of that tenant only,
        while the token it was issued for is one of the tenant's."""
        ticket = self.tickets.issue(tenant, token_digest)
        with self._tickets_lock:
            self._tenant_by_ticket[ticket] = tenant
            self._tenant_by_ticket.move_to_end(ticket)
            while len(self._tenant_by_ticket) > MAX_TICKET_TENANTS:
                self._tenant_by_ticket.popitem(last=False)
        return ticket

    def session(self, sid: bytes, tenant: str) -> Session | None:
        """The open session ``sid`` of ``tenant`` (None when unknown, closed or another tenant's)."""
        return self.sessions.find(sid, tenant)

    def using(self, session: Session):
        """Context manager lending the session's socket to one transfer."""
        return self.sessions.using(session)

    def drop(self, sid: bytes) -> None:
        self.sessions.drop(sid)

    @property
    def session_count(self) -> int:
        return len(self.sessions)

    def stats(self) -> dict:
        open_sessions, counts = self.sessions.counted()
        return {"sessions": open_sessions, "greetings_pending": len(self._greetings),
                **{f"sessions_{k}": v for k, v in counts.items()}, **self.counts}

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._wake_writer.send(b"x")
        self._thread.join(5.0)
        self._listener.close()
        for greeting in self._greetings.values():
            greeting.sock.close()
        self._greetings.clear()
        self.sessions.close_all()
        self._poller.close()
        self._wake_reader.close()
        self._wake_writer.close()

    # -- the I/O thread ----------------------------------------------------------------------------

    def _serve(self) -> None:
        idle_tick = min(1.0, self.sessions.idle_s / 4)
        next_idle_check = time.monotonic() + idle_tick
        listener_fd, wake_fd = self._listener.fileno(), self._wake_reader.fileno()
        swept = self.tickets.generation
        while not self._closed.is_set():
            now = time.monotonic()
            oldest = next(iter(self._greetings.values()), None)
            wake_at = min(next_idle_check, now + REVOKE_WITHIN_S)
            if oldest is not None:
                wake_at = min(wake_at, oldest.deadline)
            try:
                events = self._poller.poll(max(0.0, wake_at - now))
            except (OSError, ValueError):
                return   # closed under us
            for fd, mask in events:
                try:
                    if fd == wake_fd:
                        return
                    if fd == listener_fd:
                        self._accept()
                    elif fd in self._greetings:
                        self._advance_greeting(fd)
                    else:
                        self.sessions.on_readable(fd, mask)
                except Exception:  # noqa: BLE001 - one bad connection must not stop the side channel
                    log.exception("side channel: handling a connection failed")
            if swept != self.tickets.generation:
                swept = self.tickets.generation
                self.sessions.revoke(self.tickets.admits)
            now = time.monotonic()
            self._expire_greetings(now)
            if now >= next_idle_check:
                self.sessions.expire_idle(now)
                next_idle_check = now + idle_tick

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except BlockingIOError:
                return
            except OSError as e:   # e.g. out of descriptors: back off instead of spinning on a ready listener
                log.warning("side channel: accept failed: %s", e)
                time.sleep(0.05)
                return
            conn.setblocking(False)
            if len(self._greetings) >= self.max_pending_greetings:
                self._end_greeting(next(iter(self._greetings)), "greetings_pushed_out")
            self._poller.register(conn.fileno(), _WATCH_GREETING)
            self._greetings[conn.fileno()] = _Greeting(conn, time.monotonic() + self.greeting_deadline_s)

    def _advance_greeting(self, fd: int) -> None:
        greeting = self._greetings[fd]
        try:
            chunk = greeting.sock.recv(GREETING_BYTES - len(greeting.received))
        except BlockingIOError:
            return
        except OSError:
            chunk = b""
        if not chunk:
            self._end_greeting(fd, "greetings_abandoned")
            return
        greeting.received += chunk
        if len(greeting.received) < GREETING_BYTES:
            return
        tenant = self._tenant_of(greeting.received)
        if tenant is None:
            self._end_greeting(fd, "greetings_refused")
            return
        sock = self._end_greeting(fd, None, close=False)
        self._open_session(sock, tenant, greeting.received[len(MAGIC):])

    def _open_session(self, sock: socket.socket, tenant: str, ticket: bytes) -> None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(True)   # handlers use blocking I/O; the stall watchdog bounds it
        sid = self.sessions.open(sock, tenant, ticket)
        if sid is None:
            sock.close()
            return
        try:
            sock.sendall(sid)    # 16 bytes into an empty send buffer: never blocks
        except OSError:
            self.sessions.drop(sid)

    def _tenant_of(self, greeting: bytes) -> str | None:
        if not hmac.compare_digest(greeting[:len(MAGIC)], MAGIC):
            return None
        ticket = greeting[len(MAGIC):]
        with self._tickets_lock:
            tenant = self._tenant_by_ticket.get(ticket)
        return tenant if tenant is not None and self.tickets.admits(ticket, tenant) else None

    def _expire_greetings(self, now: float) -> None:
        while self._greetings:
            fd, greeting = next(iter(self._greetings.items()))
            if greeting.deadline > now:
                return
            self._end_greeting(fd, "greetings_timed_out")

    def _end_greeting(self, fd: int, reason: str | None, close: bool = True) -> socket.socket:
        greeting = self._greetings.pop(fd)
        with contextlib.suppress(OSError, ValueError):
            self._poller.unregister(fd)
        if close:
            greeting.sock.close()
        if reason:
            self.counts[reason] += 1
        return greeting.sock
