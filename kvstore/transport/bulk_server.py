"""Daemon end of the bulk side channel: a ``socket_server.SocketServer`` whose one thread greets
connections and watches the sessions they become.

A connection must send its greeting (``MAGIC + ticket``, see ``kvstore.transport.bulk``) within
``GREETING_DEADLINE_S``; at most ``MAX_PENDING_GREETINGS`` wait at once (a new one pushes out the
least recently active, so a flood of silent connections delays a real client's greeting by no
more than its round trip). A greeting whose ticket the current tokens admit becomes a session
(``kvstore.transport.bulk_sessions``), handed off to the session table: closed when its client
goes, after ``SESSION_IDLE_S`` idle, or least-recently-used first when ``MAX_SESSIONS`` are open.
RPC handlers borrow sessions' sockets; the server's thread watches them while idle.

Tickets bind sessions to tenants: Handshake hands a caller ``ticket_for(its tenant, its token's
digest)`` (``transport.tickets``), and the session a ticket opens answers only RPCs of that
tenant. A ticket whose token a reload removed or changed opens nothing, and the sessions it
opened are closed within a tick (``socket_server.TICK_S``).
"""

from __future__ import annotations

import hmac
import socket

from kvstore.transport.bulk import GREETING_BYTES, MAGIC, TICKET_BYTES
from kvstore.transport.bulk_sessions import Session, SessionTable
from kvstore.transport.socket_server import Connection, SocketServer
from kvstore.transport.tickets import TokenBook

GREETING_DEADLINE_S = 2.0      # a connection must send its greeting within this long of being accepted
MAX_PENDING_GREETINGS = 64     # connections accepted and not yet greeted, at most
SESSION_IDLE_S = 300.0         # a session unused this long is closed (its client reconnects on next use)
MAX_SESSIONS = 1024            # open sessions; the least recently used idle one makes room for a new one
MAX_TICKET_TENANTS = 4096      # tickets remembered (bounded by the configured tokens)


class BulkServer(SocketServer):
    """Daemon side: accepts side-channel connections and lends their sockets to RPC handlers."""

    def __init__(self, host: str, *, idle_s: float = SESSION_IDLE_S, greeting_deadline_s: float = GREETING_DEADLINE_S,
                 max_pending_greetings: int = MAX_PENDING_GREETINGS, max_sessions: int = MAX_SESSIONS,
                 tokens: TokenBook | None = None) -> None:
        super().__init__("side-channel", host=host, first_deadline_s=greeting_deadline_s,
                         max_pending=max_pending_greetings, max_read=GREETING_BYTES, tokens=tokens,
                         ticket_bytes=TICKET_BYTES, remember_tickets=MAX_TICKET_TENANTS)
        self.sessions = SessionTable(self.poller, max_sessions, idle_s)
        self.start()

    # -- what RPC handlers use ---------------------------------------------------------------------

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
        return {"sessions": open_sessions, "greetings_pending": self.pending,
                **{f"sessions_{k}": v for k, v in counts.items()},
                **{f"greetings_{k}": self.counts[reason] for k, reason in
                   (("timed_out", "timed_out"), ("pushed_out", "pushed_out"), ("abandoned", "closed"),
                    ("refused", "refused"))}}

    def close(self) -> None:
        super().close()
        self.sessions.close_all()

    # -- the server's thread -----------------------------------------------------------------------

    def received(self, fd: int, conn: Connection) -> None:
        if len(conn.buf) < GREETING_BYTES:
            return
        greeting = bytes(conn.buf)
        tenant = self.tickets.tenant_of(greeting[len(MAGIC):]) if len(greeting) == GREETING_BYTES \
            and hmac.compare_digest(greeting[:len(MAGIC)], MAGIC) else None
        if tenant is None:
            self.end(fd, "refused")
            return
        sock = self.hand_off(fd)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setblocking(True)   # handlers use blocking I/O; the stall watchdog bounds it
        sid = self.sessions.open(sock, tenant, greeting[len(MAGIC):])
        if sid is None:
            sock.close()
            return
        try:
            sock.sendall(sid)    # 16 bytes into an empty send buffer: never blocks
        except OSError:
            self.sessions.drop(sid)

    def watched(self, fd: int, events: int) -> None:
        self.sessions.on_readable(fd, events)

    def tick(self, now: float) -> None:
        self.sessions.expire_idle(now)

    def revoked(self) -> None:
        self.sessions.revoke(self.tickets.admits)
