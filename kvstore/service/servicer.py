"""The KVStore service: the state every call shares (``rpc_base.ServiceState``) and the control
RPCs here; each other role is an object of its own, given this service: ``streams`` (Put and Get
over gRPC, ``stream_rpcs``), ``leases`` (same-host leases, ``lease_rpcs``), ``side_channel``
(BulkGet and BulkPut, ``bulk_rpcs``) and ``admin`` (operator commands, ``admin_rpcs``). ``rpc(name)``
is the method that answers each RPC.

Each handler validates every field, authorises, translates and calls the Store; it raises a
``KVStoreError`` for anything it refuses and never touches gRPC status itself: the call bridge
(``calls.py``) answers the error with its status. Stats shows a tenant only its own namespaces
unless its token is an admin's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from kvstore.errors import FleetModeOff, InvalidArgument, Unauthenticated
from kvstore.keys import Namespace
from kvstore.proto import kvstore_pb2 as pb
from kvstore.service.admin_rpcs import AdminRpcs
from kvstore.service.bulk_rpcs import BulkRpcs
from kvstore.service.config import Settings
from kvstore.service.lease_rpcs import LeaseRpcs
from kvstore.service.rpc_base import ServiceState
from kvstore.service.stream_rpcs import StreamRpcs
from kvstore.service.validation import check_hashes, check_string, layout_from_proto
from kvstore.store import Store
from kvstore.transport import shm
from kvstore.wire import MAX_LOOKUP_BATCH, MAX_LOOKUP_HASHES, PROTOCOL_VERSION

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["KVStore"].full_name


class KVStoreServicer(ServiceState):
    RPCS = ("Handshake", "RegisterNamespace", "Lookup", "LookupBatch", "Exists", "Delete", "Stats", "Route",
            "PeerChecksums")

    def __init__(self, store: Store, settings: Settings, **parts) -> None:
        super().__init__(store, settings, **parts)
        self.streams = StreamRpcs(self)
        self.leases = LeaseRpcs(self)
        self.side_channel = BulkRpcs(self)
        self.admin = AdminRpcs(self)
        self._rpcs = {name: getattr(role, name) for role in (self, self.streams, self.leases, self.side_channel,
                                                              self.admin) for name in role.RPCS}

    def rpc(self, name: str) -> Callable:
        """The method answering the KVStore RPC ``name``: this class's or its role's."""
        return self._rpcs[name]

    def _fleet(self):
        if self.fleet is None:
            raise FleetModeOff("fleet: fleet mode is off on this daemon (set fleet.enabled)")
        return self.fleet

    def Handshake(self, request, context):
        tenant = self.tenant_of(context)
        token = self.auth.token_digest(context.invocation_metadata())   # the tickets are bound to it
        if request.nonce and not 16 <= len(request.nonce) <= 64:
            raise InvalidArgument("nonce", f"must be 16..64 bytes, got {len(request.nonce)}")
        resp = pb.HandshakeResponse(server_version=PROTOCOL_VERSION, server_id=self.server_id,
                                    lease_seconds=self.store.config.lease_seconds,
                                    max_message_bytes=self.max_message_bytes, chunk_bytes=self.chunk_bytes,
                                    tenant=tenant, stored_codecs=self.store.stored_codecs(),
                                    fleet_node=self.fleet.node_id if self.fleet is not None else "")
        arena = self.store.shared_arena()
        if arena is not None and request.nonce:
            resp.arena_bytes = arena.nbytes
            if arena.segmented:   # auth on: this tenant's segments, by descriptor (``build_server`` made the broker)
                resp.segment_socket = self.segments.path
                resp.segment_ticket = self.segments.ticket_for(tenant, token)
                resp.segment_bytes = arena.segment_bytes
            else:
                resp.arena_dev, resp.arena_ino = arena.st_dev, arena.st_ino
                resp.arena_path = arena.path
                resp.probe_path = shm.write_probe(self.shm_dir, bytes(request.nonce))
        if self.bulk is not None:
            resp.bulk_port = self.bulk.port
            resp.bulk_ticket = self.bulk.ticket_for(tenant, token)  # opens sessions of this tenant only
        if self.local_lookups is not None and request.nonce:
            resp.lookup_socket = self.local_lookups.path
            resp.lookup_ticket = self.local_lookups.ticket_for(tenant, token)
            if arena is not None and self.local_lookups.takes_calls:
                resp.lease_socket = self.local_lookups.path
                resp.lease_ticket = self.local_lookups.ticket_for(tenant, token)
        return resp

    def local_lookup(self, tenant: str, namespace_id: bytes, hashes: list[bytes], lease: bool) -> tuple[int, list[str]]:
        """Lookup for a same-host client over the Unix socket (``transport.local_lookup``): the
        same checks and answer as the RPC, this daemon's own blocks only (in fleet mode a client
        asks here only for a ``local_only`` lookup: completing a run from peers is the RPC's)."""
        return self._look_up(self.store, self.tenant_namespace(tenant, namespace_id), hashes, lease)

    def _look_up(self, source, ns: Namespace, hashes, lease: bool, **hints) -> tuple[int, list[str]]:
        """``(hits, their tiers)`` from ``source`` (the store, or the fleet that completes a short
        local run from peers, with ``hints``: the producer a P/D hand-off names), counted in the
        namespace's usage."""
        hashes = check_hashes(hashes, allow_empty=True)
        if not hashes:
            return 0, []
        found = source.lookup(ns.id, hashes, lease=lease, **hints)
        self.usage.looked_up(ns.id, len(hashes), found.num_hit)
        return found.num_hit, list(found.tiers)

    def local_lookup_told(self, tenant: str, namespace_id: bytes, hit: list[bytes], asked: int, lease: bool) -> None:
        """A same-host client answered a lookup from its mapped index (``transport.lookup_index``):
        pin what it found, as the lookup would have, and count the lookup."""
        ns = self.tenant_namespace(tenant, namespace_id)
        hit = check_hashes(hit, allow_empty=True)
        found = self.store.lookup(ns.id, hit, lease=True).num_hit if hit and lease else len(hit)
        self.usage.looked_up(ns.id, max(asked, len(hit)), found)

    def RegisterNamespace(self, request, context):
        check_string(request.cache_salt, "cache_salt")
        check_string(request.tenant, "tenant")
        tenant = self.tenant_of(context, request.tenant)
        if not request.HasField("layout"):
            raise InvalidArgument("layout", "the KV layout descriptor is required")
        ns = Namespace(layout_from_proto(request.layout), tenant=tenant, cache_salt=request.cache_salt)
        ns_id = self.store.register_namespace(ns)
        return pb.RegisterNamespaceResponse(namespace_id=ns_id, block_bytes=ns.block_bytes, tenant=tenant)

    def Lookup(self, request, context) -> pb.LookupResponse:
        ns = self.caller_namespace(context, request.namespace_id)
        # in fleet mode a short local run is completed from peers (only Lookup fetches: no loops),
        # first from the member a P/D hand-off names (an untrusted hint: ``fleet.direct``), unless
        # the caller asks for this daemon's own blocks only
        if self.fleet is None or request.local_only:
            hits, tiers = self._look_up(self.store, ns, request.hashes, not request.no_lease)
        else:
            hits, tiers = self._look_up(self.fleet, ns, request.hashes, not request.no_lease,
                                        producer=request.producer)
        return pb.LookupResponse(num_hit=hits, tiers=tiers)

    def PeerChecksums(self, request, context):
        """A fleet peer's direct fetch: the signed checksums of the leading blocks held here
        (``Fleet.signed_checksums``). Answered to callers with an admitted peer proof only (the
        auth interceptor refuses a proof that does not verify before this runs)."""
        fleet = self._fleet()
        if self.auth.peer_proof(context.invocation_metadata()) is None:
            raise Unauthenticated("authorization: PeerChecksums is answered to fleet peers only (a peer proof)")
        ns = self.caller_namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes)
        return pb.PeerChecksumsResponse(signed=fleet.signed_checksums(ns.id, hashes))

    def Route(self, request, context):
        ns = self.caller_namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes, allow_empty=True)
        out = pb.RouteResponse()
        for r in self._fleet().route(ns.id, hashes):
            out.nodes.add(node_id=r.node_id, address=r.address, blocks=r.blocks, tokens=r.tokens or 0,
                          memory_blocks=r.tiers.get("memory", 0), disk_blocks=r.tiers.get("disk", 0))
        return out

    def LookupBatch(self, request, context):
        if len(request.requests) > MAX_LOOKUP_BATCH:
            raise InvalidArgument("requests",
                                  f"{len(request.requests)} lookups in one call; at most {MAX_LOOKUP_BATCH}")
        total = sum(len(r.hashes) for r in request.requests)  # before any hash becomes a Python object
        if total > MAX_LOOKUP_HASHES:
            raise InvalidArgument("chains", f"{total} hashes in one LookupBatch; at most {MAX_LOOKUP_HASHES} "
                                            "across all its chains")
        out = pb.LookupBatchResponse()
        for i, r in enumerate(request.requests):
            try:
                out.responses.append(self.Lookup(r, context))
            except InvalidArgument as e:
                raise InvalidArgument(f"requests[{i}].{e.field}", str(e).split(": ", 1)[-1]) from None
        return out

    def Exists(self, request, context):
        ns = self.caller_namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes, allow_empty=True)
        present = self.store.contains(ns.id, hashes) if hashes else []
        self.usage.looked_up(ns.id, len(hashes), sum(present))
        return pb.ExistsResponse(present=present)

    def Delete(self, request, context):
        ns = self.caller_namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes, allow_empty=True)
        return pb.DeleteResponse(deleted=self.store.delete(ns.id, hashes) if hashes else 0)

    def Stats(self, request, context):
        tenant = self.tenant_of(context)
        server = {"server_id": self.server_id, "uptime_s": round(time.time() - self.started, 3),
                  "tenant": tenant, "tenant_bytes": self.store.tenant_bytes(tenant)}
        if not self.auth.sees_store_wide(tenant):  # a tenant sees its own namespaces, nothing store-wide
            stats = dict(self.store.tenant_stats(tenant))
        else:
            stats = dict(self.store.stats())
            server.update(bulk_sessions=self.bulk.session_count if self.bulk else 0,
                          bulk_channel=self.bulk.stats() if self.bulk else {},
                          client_leases=len(self.leases.client_leases), open_streams=self.stalls.open_calls,
                          stalled_streams_cancelled=self.stalls.cancelled, threads=self.threads.as_dict(),
                          gc=self.gc_pauses.stats())
            if self.fleet is not None:
                stats["fleet"] = self.fleet.stats()
        stats.update(server=server, namespace_usage=self.admin.top_namespaces(context))   # `kvstore top` shows it
        return pb.StatsResponse(json=json.dumps(stats, sort_keys=True))

