"""Per-tenant byte quotas, enforced where blocks are reserved, so no path can bypass them.

Every byte a tenant occupies is *charged* the moment its block is reserved: a put's block before
its bytes arrive, a same-host writer's ``prepare_store`` slots until they are completed, aborted
or expire, a block fetched from a peer. It is released when the block leaves the store (deleted,
evicted, aborted). The charge is taken under the store lock, so concurrent writers of one tenant
can never together pass the quota.

A *hold* lets a caller that receives a batch block by block (a gRPC or side-channel stream) refuse
the whole batch up front instead of storing part of it: it counts against the quota from the
check until the batch ends. While a held batch is being stored its blocks are counted twice (held
and charged), so a concurrent batch of the same tenant near its quota may be refused early; the
quota itself is never exceeded.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from kvstore.errors import QuotaExceeded


class TenantQuotas:
    """Bytes charged and held per tenant, against ``limits`` (tenant -> bytes; absent: unlimited).
    Callers hold the store lock."""

    def __init__(self, limits: Mapping[str, int]) -> None:
        self.limits = dict(limits)
        self.charged: dict[str, int] = defaultdict(int)
        self._held: dict[str, int] = defaultdict(int)
        #: the tenant of each namespace whose blocks were charged (a namespace's tenant is part of
        #: its id, so it never changes): a block keeps only a flag (``Entry.charged``), and its
        #: charge is released here even after its namespace was dropped
        self._tenant_of: dict[bytes, str] = {}

    def charges(self, namespace_id: bytes, tenant: str) -> None:
        """Blocks of ``namespace_id`` are charged to ``tenant`` (``release_block`` finds it here)."""
        self._tenant_of[namespace_id] = tenant

    def release_block(self, namespace_id: bytes, nbytes: int) -> None:
        """Release a charged block's ``nbytes`` from the tenant ``charges`` named for its namespace."""
        self.charged[self._tenant_of[namespace_id]] -= nbytes

    def charge(self, tenant: str, nbytes: int) -> None:
        """Count ``nbytes`` more against ``tenant``, or raise ``QuotaExceeded`` and count nothing."""
        self._check(tenant, self.charged[tenant], nbytes)
        self.charged[tenant] += nbytes

    def restore(self, tenant: str, nbytes: int) -> None:
        """Count bytes that are already stored (warm restart), whatever the limit says now."""
        self.charged[tenant] += nbytes

    def release(self, tenant: str, nbytes: int) -> None:
        self.charged[tenant] -= nbytes

    def hold(self, tenant: str, nbytes: int) -> None:
        """Reserve ``nbytes`` for a batch about to arrive (see the module docstring); ``unhold``
        gives them back, whatever the limits are by then."""
        self._check(tenant, self.charged[tenant] + self._held[tenant], nbytes)
        self._held[tenant] += nbytes

    def unhold(self, tenant: str, nbytes: int) -> None:
        self._held[tenant] -= nbytes

    def _check(self, tenant: str, used: int, incoming: int) -> None:
        limit = self.limits.get(tenant)
        if limit is not None and used + incoming > limit:
            raise QuotaExceeded(f"quota: tenant {tenant!r} holds {used} bytes; storing {incoming} more would "
                                f"exceed its quota of {limit} bytes")
