"""Tickets: what admits a connection to a same-host service or the side channel as one tenant.

A Handshake authenticated with a token hands out tickets for the Unix-socket services, the
segment broker and the side channel. A ticket is an HMAC, under a secret of this daemon run and
service, of the tenant and of the digest of the token the Handshake presented, so it is bound to
that token: it admits only while the token is still one of the tenant's (``TokenBook``, the
daemon's authenticator), checked on every use. A reload that removes or changes a token revokes
every ticket issued for it; servers holding connections opened with one notice the book's
``generation`` change and close them. Without tokens a ticket is bound to the tenant alone.
A service whose greeting names no tenant (the side channel) finds it with ``tenant_of``, among the
last ``remember`` tickets issued.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import threading
from collections import OrderedDict
from collections.abc import Collection
from typing import Protocol


class TokenBook(Protocol):
    """The current tokens, as the daemon's authenticator keeps them."""

    generation: int   # changes whenever the tokens do

    def digests_of(self, tenant: str) -> Collection[bytes]: ...


class _NoTokens:
    generation = 0

    @staticmethod
    def digests_of(tenant: str) -> Collection[bytes]:
        return (b"",)


class Tickets:
    """Issues and checks one service's tickets (``size`` bytes of HMAC-SHA256)."""

    def __init__(self, purpose: str, book: TokenBook | None = None, size: int = 32, remember: int = 0) -> None:
        self._secret = secrets.token_bytes(32)
        self._purpose = purpose.encode() + b":"
        self.book = book or _NoTokens()
        self.size = size
        self.remember = remember
        self._issued: OrderedDict[bytes, str] = OrderedDict()   # ticket -> tenant, the last ``remember`` issued
        self._issued_lock = threading.Lock()                     # Handshake threads issue, a server's thread reads

    @property
    def generation(self) -> int:
        return self.book.generation

    def issue(self, tenant: str, token_digest: bytes) -> bytes:
        ticket = self._mac(tenant, token_digest)
        if self.remember:
            with self._issued_lock:
                self._issued[ticket] = tenant
                self._issued.move_to_end(ticket)
                while len(self._issued) > self.remember:
                    self._issued.popitem(last=False)
        return ticket

    def tenant_of(self, ticket: bytes) -> str | None:
        """The tenant ``ticket`` admits now, if it is one of the last ``remember`` issued."""
        with self._issued_lock:
            tenant = self._issued.get(ticket)
        return tenant if tenant is not None and self.admits(ticket, tenant) else None

    def _mac(self, tenant: str, token_digest: bytes) -> bytes:
        name = tenant.encode("utf-8")
        message = self._purpose + len(name).to_bytes(2, "big") + name + token_digest
        return hmac.new(self._secret, message, hashlib.sha256).digest()[:self.size]

    def admits(self, ticket: bytes, tenant: str) -> bool:
        """Whether ``ticket`` was issued to ``tenant`` for one of its current tokens."""
        admitted = False
        for digest in self.book.digests_of(tenant):   # no early exit: timing tells nothing
            admitted |= hmac.compare_digest(ticket, self._mac(tenant, digest))
        return admitted
