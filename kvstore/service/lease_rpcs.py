"""Same-host zero-copy RPCs: leases on arena slots that a client fills or reads in place.

PrepareStore/PrepareLoad pin slots of the shared CPU arena under a store lease and answer where
they are; the client copies through its own mapping of the arena and then completes (or aborts)
the lease. The id a client sees is not the store's: ``ClientLeases`` hands out random public ids
bound to the tenant that prepared them, so a stale or hostile client cannot name another client's
lease (store ids count up from 1 in every daemon run).

A same-host client makes these calls over the daemon's Unix socket when it can
(``transport.local_calls``): ``local_call`` runs the same methods for it, as its greeting's tenant.
"""

from __future__ import annotations

import secrets
import threading
import time

from kvstore.errors import LeaseExpired
from kvstore.proto import kvstore_pb2 as pb
from kvstore.service.calls import status_of
from kvstore.service.block_reads import accepted_codecs
from kvstore.service.rpc_base import PUT_RESULT, PlainContext, ServiceState
from kvstore.service.validation import check_hashes, check_parent, lenient, well_formed
from kvstore.transport.local_calls import LEASE_METHODS, REQUESTS, CallFailed

_PARSE = {method: lenient(message) for method, message in REQUESTS.items()}


class ClientLeases:
    """Public lease id -> (tenant, until, store lease id)."""

    def __init__(self) -> None:
        self._owner: dict[int, tuple[str, float, int]] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._owner)

    def issue(self, store_lease_id: int, tenant: str, lease_seconds: float) -> int:
        with self._lock:
            public = secrets.randbits(63) or 1
            while public in self._owner:
                public = secrets.randbits(63) or 1
            self._owner[public] = (tenant, time.monotonic() + lease_seconds + 1, store_lease_id)
        return public

    def redeem(self, public_id: int, tenant: str) -> int:
        """The store's lease id behind ``public_id``, once, and only for the tenant it was issued to."""
        with self._lock:
            owner = self._owner.get(public_id)
            if owner is not None and owner[0] == tenant:
                del self._owner[public_id]
                return owner[2]
        raise LeaseExpired(f"lease_id: lease {public_id} is unknown or expired")

    def prune(self) -> None:
        now = time.monotonic()
        with self._lock:
            for lid in [k for k, (_, until, _) in self._owner.items() if until < now]:
                del self._owner[lid]


class LeaseRpcs:
    """The same-host lease RPCs, for ``service``; ``client_leases`` are the leases it handed out."""
    RPCS = LEASE_METHODS

    def __init__(self, service: ServiceState) -> None:
        self.service = service
        self.store = service.store
        self.client_leases = ClientLeases()

    def _store_lease(self, context, public_id: int) -> int:
        return self.client_leases.redeem(public_id, self.service.tenant_of(context))

    def _public_lease(self, store_lease_id: int, context) -> int:
        tenant = self.service.tenant_of(context)
        return self.client_leases.issue(store_lease_id, tenant, self.store.config.lease_seconds)

    def _lease_response(self, lease, public_id: int, present_none: bool, size: int) -> pb.LeaseResponse:
        """Where each block's slots are, as the parallel arrays of a ``BlockTable``, each repeated
        field extended once from a list (no message per block or extent); a load lease also says what
        each block holds (codec, bytes). Segment generations only with tenant segments (else all 0)."""
        resp = pb.LeaseResponse(lease_id=public_id, expires_in=self.store.config.lease_seconds)
        table, extents = resp.table, lease.extents
        table.SetInParent()
        flat = [piece for ext in extents if ext for piece in ext]
        table.extent_counts.extend([len(ext) if ext else 0 for ext in extents])
        offsets, lengths = zip(*flat) if flat else ((), ())
        table.offsets.extend(offsets)
        table.lengths.extend(lengths)
        arena = self.store.shared_arena()
        if arena is not None and arena.segmented:
            table.generations.extend([arena.generation_at(off) for off in offsets])
        if any(lease.codecs):
            table.codecs.extend(lease.codecs)
        table.sizes.extend(lease.sizes or [size] * len(extents))
        if present_none and any(ext is None for ext in extents):
            table.present.extend([ext is None for ext in extents])
        return resp

    def PrepareStore(self, request, context):
        """With auth on, a lease's slots lie in segments of the caller's tenant only (the store
        places each tenant's blocks in its own segments, and a segment that changes tenant gets
        fresh memory), so completing a store one never wrote publishes only zeros or the
        tenant's own earlier bytes, never another tenant's."""
        ns = self.service.caller_namespace(context, request.namespace_id, request.block_bytes)
        hashes = check_hashes(request.hashes)
        parent = check_parent(request.parent)
        with self.store.quota_hold(ns.id, hashes):
            lease = self.store.leases.prepare_store(ns.id, hashes, parent)
        slots = sum(ext is not None for ext in lease.extents)
        self.service.metrics.moved("in", "shm", ns.block_bytes * slots)   # slots to fill
        self.service.identify(context)
        return self._lease_response(lease, self._public_lease(lease.id, context), True, ns.block_bytes)

    def CompleteStore(self, request, context):
        results = self.store.leases.complete_store(self._store_lease(context, request.lease_id), request.codec,
                                            list(request.sizes))
        return pb.PutResponse(results=[PUT_RESULT[r] for r in results])

    def AbortStore(self, request, context):
        self.store.leases.abort_store(self._store_lease(context, request.lease_id))
        return pb.Empty()

    def PrepareLoad(self, request, context):
        ns = self.service.caller_namespace(context, request.namespace_id, request.block_bytes)
        hashes = check_hashes(request.hashes)
        lease = self.store.leases.prepare_load(ns.id, hashes, accepted_codecs(self.store, request.accept_codecs))
        stop = len(lease.extents)
        leased_out = sum(lease.sizes) if lease.sizes else ns.block_bytes * stop
        self.service.metrics.moved("out", "shm", leased_out)
        self.service.identify(context, unstaged=stop < len(hashes) and self.store.contains(ns.id, [hashes[stop]])[0],
                              capped=lease.capped)
        return self._lease_response(lease, self._public_lease(lease.id, context), False, ns.block_bytes)

    def CompleteLoad(self, request, context):
        self.store.leases.complete_load(self._store_lease(context, request.lease_id))
        return pb.Empty()

    def local_call(self, tenant: str, method: str, request: bytes) -> tuple[bytes, tuple]:
        """One lease call of a same-host client (``transport.local_calls.CallServer``): the RPC's
        own method, checks and answer, as ``tenant``; its latency and errors are counted as the
        RPC's are. Raises ``CallFailed`` with the class the method raised."""
        started, code = time.perf_counter(), None
        context = PlainContext(tenant)
        try:
            response = getattr(self, method)(well_formed(_PARSE[method](request)), context)
            return response.SerializeToString(), context.trailing
        except Exception as e:  # noqa: BLE001 - every failure becomes an answer, never a lost call
            status, details, trailing = status_of(e, f"{method} over the Unix socket")
            code, told = status.name, dict(trailing)
            raise CallFailed(told.get("kvstore-error", ""), told.get("kvstore-field", ""), details) from None
        finally:
            self.service.metrics.observe(method, time.perf_counter() - started, code)

