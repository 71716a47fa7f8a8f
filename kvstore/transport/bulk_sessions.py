"""The daemon's open side-channel sessions: bound to a tenant, watched while idle, bounded in number.

A session is one greeted TCP connection. RPC handlers borrow its socket for one transfer at a
time (``using``); between transfers the socket is armed, one-shot, in the server's epoll set, so
the moment the client goes away (EOF or reset) the server's I/O thread notices and closes it —
no thread per session, and no session outliving its client. A session also ends when it has been
idle for ``idle_s`` (a client that vanished without a FIN, or one that sent stray bytes) and, when
``max_sessions`` are open, the least recently used idle one makes room for a new client (that
client's ``BulkChannel.alive`` then reports the loss and it reconnects).

A socket is never watched while a handler uses it: ``using`` counts the session busy first, the
I/O thread ignores busy sessions, and the socket is re-armed only when the last user is done.
"""

from __future__ import annotations

import contextlib
import secrets
import select
import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

from kvstore.transport.bulk import SESSION_ID_BYTES

WATCH_IDLE = select.EPOLLIN | select.EPOLLRDHUP | select.EPOLLONESHOT
_GONE = select.EPOLLHUP | select.EPOLLERR | select.EPOLLRDHUP


class Session:
    """One side-channel connection and the tenant whose Handshake ticket opened it."""

    def __init__(self, sid: bytes, sock: socket.socket, tenant: str, ticket: bytes = b"") -> None:
        self.sid = sid
        self.sock = sock
        self.tenant = tenant
        self.ticket = ticket           # what opened it: checked again when the tokens change
        self.lock = threading.Lock()   # one transfer at a time on the socket
        self.users = 0                 # handlers holding or waiting for ``lock`` (guarded by the table)
        self.last_used = time.monotonic()
        self.closed = False


class SessionTable:
    """Open sessions by id, least recently used first; closes them when their client goes."""

    def __init__(self, poller: select.epoll, max_sessions: int, idle_s: float) -> None:
        self.max_sessions = max_sessions
        self.idle_s = idle_s
        self._poller = poller
        self._sessions: OrderedDict[bytes, Session] = OrderedDict()
        self._by_fd: dict[int, Session] = {}
        self._lock = threading.Lock()
        self.counts = {"opened": 0, "closed_by_peer": 0, "idle_expired": 0, "evicted": 0, "refused_full": 0,
                       "dropped": 0, "revoked": 0}

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def counted(self) -> tuple[int, dict[str, int]]:
        """The open sessions and the counters, read together: a session that has left the table
        has always been counted by then, so a reader never sees it gone and not yet counted."""
        with self._lock:
            return len(self._sessions), dict(self.counts)

    def open(self, sock: socket.socket, tenant: str, ticket: bytes = b"") -> bytes | None:
        """Register a greeted connection; its new session id, or None when every slot is busy."""
        with self._lock:
            if len(self._sessions) >= self.max_sessions and not self._evict_one_idle():
                self.counts["refused_full"] += 1
                return None
            sid = secrets.token_bytes(SESSION_ID_BYTES)
            session = Session(sid, sock, tenant, ticket)
            self._sessions[sid] = session
            self._by_fd[sock.fileno()] = session
            self._poller.register(sock.fileno(), WATCH_IDLE)
            self.counts["opened"] += 1
            return sid

    def find(self, sid: bytes, tenant: str) -> Session | None:
        """The open session ``sid`` if ``tenant`` opened it; another tenant's is answered like an
        unknown one, so session ids can be neither used nor probed across tenants."""
        with self._lock:
            session = self._sessions.get(sid)
        if session is None or session.closed or session.tenant != tenant:
            return None
        return session

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

    def on_readable(self, fd: int, events: int) -> bool:
        """The I/O thread saw ``fd`` ready; False if it is not a session's. An idle session that
        turned readable was closed by its client, or has bytes a handler is about to read."""
        with self._lock:
            session = self._by_fd.get(fd)
            if session is None:
                return False
            if session.users:
                return True      # a handler took it meanwhile; ``using`` re-arms it afterwards
            try:
                peeked = session.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
            except BlockingIOError:
                self._arm(session)
                return True
            except OSError:
                peeked = b""
            if not peeked or events & _GONE:
                self._close(session, "closed_by_peer")
            else:  # bytes of a transfer whose RPC has not reached its handler yet: left unarmed
                session.last_used = time.monotonic()  # until it is done (or the idle bound ends it)
            return True

    def expire_idle(self, now: float) -> None:
        cutoff = now - self.idle_s
        with self._lock:
            stale = [s for s in self._sessions.values() if s.last_used < cutoff and not s.users]
            for session in stale:
                self._close(session, "idle_expired")

    def drop(self, sid: bytes) -> None:
        """Close a session a handler found broken or stalled (wakes a handler blocked on it)."""
        with self._lock:
            session = self._sessions.get(sid)
            if session is not None:
                self._close(session, "dropped")

    def revoke(self, admits: Callable[[bytes, str], bool]) -> None:
        """Close every session whose ticket ``admits(ticket, tenant)`` no longer admits."""
        with self._lock:
            for session in [s for s in self._sessions.values() if not admits(s.ticket, s.tenant)]:
                self._close(session, "revoked")

    def close_all(self) -> None:
        with self._lock:
            for session in list(self._sessions.values()):
                self._close(session, None)

    # -- under self._lock --------------------------------------------------------------------------

    def _arm(self, session: Session) -> None:
        try:
            self._poller.modify(session.sock.fileno(), WATCH_IDLE)
        except (OSError, ValueError):
            self._close(session, "dropped")

    def _evict_one_idle(self) -> bool:
        for session in self._sessions.values():   # least recently used first
            if not session.users:
                self._close(session, "evicted")
                return True
        return False

    def _close(self, session: Session, reason: str | None) -> None:
        if session.closed:
            return
        session.closed = True
        if reason:
            self.counts[reason] += 1
        self._sessions.pop(session.sid, None)
        fd = session.sock.fileno()
        if fd >= 0 and self._by_fd.get(fd) is session:
            del self._by_fd[fd]
            with contextlib.suppress(OSError, ValueError):
                self._poller.unregister(fd)
        with contextlib.suppress(OSError):
            session.sock.shutdown(socket.SHUT_RDWR)  # wakes a handler blocked in recv (close alone does not)
        session.sock.close()
