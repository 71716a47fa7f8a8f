"""Who is calling: bearer token -> tenant, and whether that tenant may see store-wide figures.

With no tokens configured every caller is trusted and may name its tenant in RegisterNamespace
(useful as a namespace partition on a private host). With tokens configured, a request without a
known ``authorization: Bearer <token>`` header is refused (UNAUTHENTICATED) and the token alone
decides the tenant: it is folded into every namespace the caller registers, and a namespace of
another tenant is answered exactly like an unknown one (NOT_FOUND), so tenants can neither read nor
probe each other's blocks.

Admins are tenants listed in ``admin_tenants``: the tokens of those tenants may read store-wide
Stats (every tenant's figures, the tiers' totals); everyone else sees only their own namespaces.
Byte quotas are enforced by the store (``kvstore.store.quotas``), where every write path passes.
No token ever appears in a message this module raises.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Iterable, Mapping

from kvstore.errors import Unauthenticated


class Authenticator:
    def __init__(self, tokens: Mapping[str, str] | None = None, admin_tenants: Iterable[str] = ()) -> None:
        self.tokens = dict(tokens or {})
        self.admin_tenants = frozenset(admin_tenants)
        self._digests = [(hashlib.sha256(t.encode()).digest(), tenant) for t, tenant in self.tokens.items()]

    @property
    def enabled(self) -> bool:
        return bool(self.tokens)

    def tenant(self, metadata, requested: str = "") -> str:
        """The caller's tenant from its metadata (``requested`` counts only without auth)."""
        if not self.enabled:
            return requested
        header = ""
        for key, value in metadata or ():
            if key == "authorization":
                header = value
                break
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token:
            raise Unauthenticated("authorization: missing bearer token")
        # Constant time: compare fixed-size digests against every known token, no early exit,
        # so timing reveals neither a token's bytes, its length, nor which one matched.
        offered = hashlib.sha256(token.strip().encode()).digest()
        found = None
        for digest, tenant in self._digests:
            if hmac.compare_digest(digest, offered):
                found = tenant
        if found is None:
            raise Unauthenticated("authorization: unknown token")
        return found

    def sees_store_wide(self, tenant: str) -> bool:
        """Whether an authenticated ``tenant`` may read store-wide figures: always without auth
        (nothing tells callers apart), otherwise only the tenants listed in ``admin_tenants``."""
        return not self.enabled or tenant in self.admin_tenants
