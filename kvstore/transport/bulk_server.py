"""Daemon end of the bulk side channel: greeted connections become sessions that RPC handlers borrow.

A connection's greeting (``MAGIC + ticket``, ``transport.bulk``) is read under the bounds of
``socket_server`` on connections not greeted yet; a ticket the current tokens do not admit opens
nothing. A session answers only RPCs of the tenant whose ticket opened it: another tenant's
session id is answered like an unknown one.

A greeted connection leaves the base's connections for the session table (``_sessions``, guarded
by ``_lock``, which RPC handlers' threads and the server's thread share). Handlers borrow a
session's socket for one transfer at a time (``using``); between transfers it is armed, one-shot,
in the server's epoll set, so the moment the client goes away (EOF or reset) the server's thread
closes it: no thread per session, and no session outliving its client. A socket is never watched
while a handler uses it: ``using`` counts the session busy first, the server's thread ignores busy
sessions, and the socket is re-armed only when the last user is done. A session also ends after
``SESSION_IDLE_S`` idle (a client that vanished without a FIN, or sent stray bytes); when
``MAX_SESSIONS`` are open, an idle session of the tenant holding the most makes room for a new
client (its least recently used one; that client's ``BulkChannel.alive`` then reports the loss,
and it reconnects): a tenant that opens sessions by the thousand pushes out its own, never those
of a tenant holding fewer; and the sessions of a revoked token close within a tick
(``socket_server.TICK_S``).
"""

from __future__ import annotations

import contextlib
import hmac
import secrets
import select
import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Iterator

from kvstore.transport.bulk import GREETING_BYTES, MAGIC, SESSION_ID_BYTES, TICKET_BYTES
from kvstore.transport.socket_server import Connection, SocketServer
from kvstore.transport.tickets import TokenBook

SESSION_IDLE_S = 300.0         # a session unused this long is closed (its client reconnects on next use)
MAX_SESSIONS = 1024            # open sessions; then an idle one of the largest holder makes room for a new one
MAX_TICKET_TENANTS = 4096      # tickets remembered (bounded by the configured tokens)
_WATCH_IDLE = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT
_GONE = select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP


class Session:
    """One side-channel connection and the tenant whose Handshake ticket opened it."""

    def __init__(self, sid: bytes, sock: socket.socket, tenant: str, ticket: bytes) -> None:
        self.sid, self.sock, self.tenant = sid, sock, tenant
        self.ticket = ticket           # what opened it: checked again when the tokens change
        self.lock = threading.Lock()   # one transfer at a time on the socket
        self.users = 0                 # handlers holding or waiting for ``lock`` (guarded by the server's lock)
        self.last_used = time.monotonic()
        self.closed = False


class BulkServer(SocketServer):
    """Daemon side: accepts side-channel connections and lends their sockets to RPC handlers."""

    def __init__(self, host: str, *, idle_s: float = SESSION_IDLE_S, tokens: TokenBook | None = None,
                 max_sessions: int = MAX_SESSIONS) -> None:
        super().__init__("side-channel", host=host, max_read=GREETING_BYTES, tokens=tokens,
                         ticket_bytes=TICKET_BYTES, remember_tickets=MAX_TICKET_TENANTS)
        self.idle_s, self.max_sessions = idle_s, max_sessions
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()   # least recently used first
        self._held: Counter[str] = Counter()   # open sessions per tenant
        self._by_fd: dict[int, Session] = {}
        self._lock = threading.Lock()
        self.session_counts = {"opened": 0, "closed_by_peer": 0, "idle_expired": 0, "evicted": 0,
                               "refused_full": 0, "dropped": 0, "revoked": 0}
        self.start()

    # -- what RPC handlers use ---------------------------------------------------------------------

    def session(self, sid: bytes, tenant: str) -> Session | None:
        """The open session ``sid`` of ``tenant`` (None when unknown, closed or another tenant's)."""
        with self._lock:
            session = self._sessions.get(sid)
        return session if session is not None and not session.closed and session.tenant == tenant else None

    @contextlib.contextmanager
    def using(self, session: Session) -> Iterator[socket.socket]:
        """Borrow the session's socket for one transfer (unwatched meanwhile); a session closed
        while waiting yields a closed socket, so the transfer fails with OSError."""
        with self._lock:
            session.users += 1
        try:
            with session.lock:
                yield session.sock
        finally:
            with self._lock:
                session.users -= 1
                session.last_used = time.monotonic()
                if not session.closed:
                    self._sessions.move_to_end(session.sid)
                    if session.users == 0:
                        self._arm(session)

    def drop(self, sid: bytes) -> None:
        """Close a session a handler found broken or stalled (wakes a handler blocked on it)."""
        with self._lock:
            if sid in self._sessions:
                self._close(self._sessions[sid], "dropped")

    @property
    def session_count(self) -> int:
        with self._lock:
            return len(self._sessions)

    def stats(self) -> dict:
        """Open sessions and the counters, read together: a session that has left the table has
        always been counted by then, so a reader never sees it gone and not yet counted."""
        with self._lock:
            open_sessions, counts = len(self._sessions), dict(self.session_counts)
        return {"sessions": open_sessions, "greetings_pending": self.pending,
                **{f"sessions_{k}": v for k, v in counts.items()},
                **{f"greetings_{k}": self.counts[reason] for k, reason in
                   (("timed_out", "timed_out"), ("pushed_out", "pushed_out"), ("abandoned", "closed"),
                    ("refused", "refused"))}}

    def close(self) -> None:
        super().close()
        with self._lock:
            for session in list(self._sessions.values()):
                self._close(session, None)

    # -- the server's thread -----------------------------------------------------------------------

    def received(self, fd: int, conn: Connection) -> None:
        if len(conn.buf) < GREETING_BYTES:
            return
        magic, ticket = bytes(conn.buf[:len(MAGIC)]), bytes(conn.buf[len(MAGIC):])
        well_formed = len(conn.buf) == GREETING_BYTES and hmac.compare_digest(magic, MAGIC)
        tenant = self.tickets.tenant_of(ticket) if well_formed else None
        if tenant is None:
            self.end(fd, "refused")
            return
        sock = self.hand_off(fd)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(True)   # handlers use blocking I/O; the stall watchdog bounds it
        with self._lock:
            if len(self._sessions) >= self.max_sessions and not self._evict_one_idle():
                self.session_counts["refused_full"] += 1
                sock.close()
                return
            session = Session(secrets.token_bytes(SESSION_ID_BYTES), sock, tenant, ticket)
            self._sessions[session.sid] = self._by_fd[fd] = session
            self._held[tenant] += 1
            self.poller.register(fd, _WATCH_IDLE)
            self.session_counts["opened"] += 1
        try:
            sock.sendall(session.sid)    # 16 bytes into an empty send buffer: never blocks
        except OSError:
            self.drop(session.sid)

    def watched(self, fd: int, events: int) -> None:
        """An idle session's socket turned readable: its client closed it, or sent bytes a handler
        is about to read."""
        with self._lock:
            session = self._by_fd.get(fd)
            if session is None or session.users:
                return      # a handler took it meanwhile; ``using`` re-arms it afterwards
            try:
                peeked = session.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                self._arm(session)
                return
            except OSError:
                peeked = b""
            if not peeked or events & _GONE:
                self._close(session, "closed_by_peer")
            else:  # bytes of a transfer whose RPC has not reached its handler yet: left unarmed
                session.last_used = time.monotonic()  # until it is done (or the idle bound ends it)

    def tick(self, now: float) -> None:
        with self._lock:
            for session in [s for s in self._sessions.values() if s.last_used < now - self.idle_s and not s.users]:
                self._close(session, "idle_expired")

    def revoked(self) -> None:
        with self._lock:
            for session in [s for s in self._sessions.values() if not self.tickets.admits(s.ticket, s.tenant)]:
                self._close(session, "revoked")

    # -- under self._lock --------------------------------------------------------------------------

    def _arm(self, session: Session) -> None:
        try:
            self.poller.modify(session.sock.fileno(), _WATCH_IDLE)
        except (OSError, ValueError):
            self._close(session, "dropped")

    def _evict_one_idle(self) -> bool:
        """Close the least recently used idle session of the tenant holding the most sessions
        that has one idle; False when every session is in use."""
        idle = [session for session in self._sessions.values() if not session.users]   # oldest first
        if not idle:
            return False
        held = self._held
        self._close(max(idle, key=lambda session: held[session.tenant]), "evicted")   # (max keeps the first)
        return True

    def _close(self, session: Session, reason: str | None) -> None:
        if session.closed:
            return
        session.closed = True
        if reason:
            self.session_counts[reason] += 1
        self._sessions.pop(session.sid, None)
        self._held[session.tenant] -= 1
        if not self._held[session.tenant]:
            del self._held[session.tenant]
        fd = session.sock.fileno()
        if fd >= 0 and self._by_fd.get(fd) is session:
            del self._by_fd[fd]
            with contextlib.suppress(OSError, ValueError):
                self.poller.unregister(fd)
        with contextlib.suppress(OSError):
            session.sock.shutdown(socket.SHUT_RDWR)  # wakes a handler blocked in recv (close alone does not)
        session.sock.close()
