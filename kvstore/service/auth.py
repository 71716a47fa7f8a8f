"""Who is calling: bearer token -> tenant, and per-tenant byte quotas.

With no tokens configured every caller is trusted and may name its tenant in RegisterNamespace
(useful as a namespace partition on a private host). With tokens configured, a request without a
known ``authorization: Bearer <token>`` header is refused (UNAUTHENTICATED) and the token alone
decides the tenant: it is folded into every namespace the caller registers, and a namespace of
another tenant is answered exactly like an unknown one (NOT_FOUND), so tenants can neither read nor
probe each other's blocks.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping

from kvstore.errors import QuotaExceeded, Unauthenticated


class Authenticator:
    def __init__(self, tokens: Mapping[str, str] | None = None,
                 quotas: Mapping[str, int] | None = None) -> None:
        self.tokens = dict(tokens or {})
        self.quotas = dict(quotas or {})
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

    def check_quota(self, tenant: str, used_bytes: int, incoming_bytes: int) -> None:
        quota = self.quotas.get(tenant)
        if quota is not None and used_bytes + incoming_bytes > quota:
            raise QuotaExceeded(f"quota: tenant {tenant!r} holds {used_bytes} bytes; storing {incoming_bytes} "
                                f"more would exceed its quota of {quota} bytes")
