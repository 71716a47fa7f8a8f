"""Who is calling: bearer token -> tenant, and whether that tenant may see store-wide figures.

With no tokens configured every caller is trusted and may name its tenant in RegisterNamespace
(useful as a namespace partition on a private host). With tokens configured, a request without a
known ``authorization: Bearer <token>`` header is refused (UNAUTHENTICATED) and the token alone
decides the tenant: it is folded into every namespace the caller registers, and a namespace of
another tenant is answered exactly like an unknown one (NOT_FOUND), so tenants can neither read nor
probe each other's blocks.

Admins are tenants listed in ``admin_tenants``: the tokens of those tenants may read store-wide
Stats (every tenant's figures, the tiers' totals) and run operator commands on every namespace;
everyone else sees and touches only their own namespaces. No token ever appears in a message this module raises.

A fleet daemon's peers send no token: they prove they hold one (``kvstore.fleet.peer_proof``);
a ``KvsPeer`` proof names the tenant of the token it was made with.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from kvstore.errors import Unauthenticated


def authorization(metadata) -> str:
    """The call's ``authorization`` header ("" without one)."""
    for key, value in metadata or ():
        if key == "authorization":
            return value or ""
    return ""


class _Credentials:
    """One immutable set of tokens (as digests) and admins: what ``replace`` swaps whole."""

    def __init__(self, tokens: Mapping[str, str], admin_tenants: Iterable[str]) -> None:
        self.admin_tenants = frozenset(admin_tenants)
        self.digests = [(hashlib.sha256(t.encode()).digest(), tenant) for t, tenant in tokens.items()]
        self.by_tenant: dict[str, tuple[bytes, ...]] = {}
        for digest, tenant in self.digests:
            self.by_tenant[tenant] = self.by_tenant.get(tenant, ()) + (digest,)


class Authenticator:
    """Also the token book the same-host and side-channel tickets are checked against
    (``transport.tickets``): ``digests_of`` and ``generation``."""

    def __init__(self, tokens: Mapping[str, str] | None = None, admin_tenants: Iterable[str] = ()) -> None:
        self._credentials = _Credentials(dict(tokens or {}), admin_tenants)
        self.generation = 0   # changes with every ``replace``: holders of tickets check them again
        self.peers = None     # a fleet daemon's ``PeerVerifier``

    def replace(self, tokens: Mapping[str, str], admin_tenants: Iterable[str]) -> set[str]:
        """New tokens and admins from the next call on (reload), swapped in one assignment: a call
        sees the old set or the new one, never a mix. Returns the tenants that lost a token: what
        was issued for it is revoked (``transport.tickets``)."""
        old, new = self._credentials, _Credentials(dict(tokens), admin_tenants)
        self._credentials = new
        self.generation += 1
        return {tenant for tenant, digests in old.by_tenant.items()
                if not set(digests) <= set(new.by_tenant.get(tenant, ()))}

    def digests_of(self, tenant: str) -> tuple[bytes, ...]:
        """The digests of ``tenant``'s current tokens (``(b"",)`` without auth: tickets are then
        bound to the tenant alone)."""
        credentials = self._credentials
        if not credentials.digests:
            return (b"",)
        return credentials.by_tenant.get(tenant, ())

    def token_digest(self, metadata) -> bytes:
        """The digest of the caller's token (b"" without auth), for a ticket bound to it; raises
        ``Unauthenticated`` as ``tenant`` does."""
        return self._identify(metadata)[1]

    @property
    def enabled(self) -> bool:
        return bool(self._credentials.digests)

    def tenant(self, metadata, requested: str = "") -> str:
        """The caller's tenant from its metadata (``requested`` counts only without auth)."""
        return self._identify(metadata, requested)[0]

    def peer_proof(self, metadata) -> str | None:
        """The proof a fleet peer's call carries (``peers.scheme``), or None: not a peer's call."""
        scheme, _, proof = authorization(metadata).partition(" ")
        return proof if self.peers is not None and scheme == self.peers.scheme else None

    def _identify(self, metadata, requested: str = "") -> tuple[str, bytes]:
        credentials = self._credentials   # one snapshot for the whole check: reload may swap it
        if not credentials.digests:
            return requested, b""
        if (proof := self.peer_proof(metadata)) is not None:
            return self.peers.tenant(proof, credentials.digests)
        scheme, _, token = authorization(metadata).partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("authorization: missing bearer token")
        # Constant time: compare fixed-size digests against every known token, no early exit,
        # so timing reveals neither a token's bytes, its length, nor which one matched.
        offered = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for digest, tenant in credentials.digests:
            if hmac.compare_digest(digest, offered):
                found = tenant
        if found is None:
            raise Unauthenticated("authorization: unknown token")
        return found, offered

    def sees_store_wide(self, tenant: str) -> bool:
        """Whether an authenticated ``tenant`` may read store-wide figures and act on every
        namespace: always without auth (nothing tells callers apart), otherwise only the tenants
        listed in ``admin_tenants``."""
        credentials = self._credentials
        return not credentials.digests or tenant in credentials.admin_tenants
