"""The operator RPCs: ListNamespaces, DropNamespace, Evict, Pin, Unpin, Prewarm and Reload.

Who may act on which namespaces is ``auth.py``'s to say; Reload changes the whole daemon, so it
is for admins only (PERMISSION_DENIED otherwise). The store does
the work (``Store.admin``); this module authorises, validates and translates, and logs every
change an operator makes (never a token).
"""

from __future__ import annotations

import logging

from kvstore.errors import PermissionDenied
from kvstore.keys import Namespace
from kvstore.proto import kvstore_pb2 as pb
from kvstore.service.rpc_base import ServiceState
from kvstore.service.validation import check_hashes, layout_to_proto

log = logging.getLogger("kvstore.service.admin")

#: namespaces listed in Stats' ``namespace_usage`` (what ``kvstore top`` shows)
TOP_NAMESPACES = 10


class AdminRpcs:
    """The operator RPCs, for ``service`` (its store, auth, caller identity and lookup counts)."""
    RPCS = ("ListNamespaces", "DropNamespace", "Evict", "Pin", "Unpin", "Prewarm", "Reload")

    def __init__(self, service: ServiceState) -> None:
        self.service = service
        self.store = service.store
        self.usage = service.usage

    # -- who may act on what ----------------------------------------------------------------------

    def _is_admin(self, context) -> tuple[str, bool]:
        tenant = self.service.tenant_of(context)
        return tenant, self.service.auth.sees_store_wide(tenant)

    def operated_namespace(self, context, namespace_id: bytes) -> Namespace:
        """The namespace an operator command names: any registered one for an admin, else the
        caller's own (another tenant's is NOT_FOUND)."""
        tenant, admin = self._is_admin(context)
        return self.service.tenant_namespace(tenant, namespace_id, any_tenant=admin)

    def visible_namespaces(self, context) -> list[Namespace]:
        tenant, admin = self._is_admin(context)
        namespaces = self.store.namespaces()
        return namespaces if admin else [ns for ns in namespaces if ns.tenant == tenant]

    # -- listing ----------------------------------------------------------------------------------

    def ListNamespaces(self, request, context):
        namespaces = self.visible_namespaces(context)
        footprints = self.store.admin.footprints(ns.id for ns in namespaces)
        usage = self.usage.snapshot()
        out = pb.ListNamespacesResponse()
        for ns in sorted(namespaces, key=lambda n: (-footprints[n.id].bytes, n.id)):
            fp, used = footprints[ns.id], usage.get(ns.id)
            info = out.namespaces.add(namespace_id=ns.id, tenant=ns.tenant, layout=layout_to_proto(ns.layout),
                                      cache_salt=ns.cache_salt, blocks=fp.blocks, bytes=fp.bytes,
                                      pinned_blocks=fp.pinned_blocks, pinned_bytes=fp.pinned_bytes)
            for tier, held in fp.tiers.items():
                info.tiers[tier].blocks, info.tiers[tier].bytes = held["blocks"], held["bytes"]
            if used is not None:
                info.lookup_blocks, info.lookup_hits, info.last_used = (used.lookup_blocks, used.lookup_hits,
                                                                        used.last_used)
        return out

    def top_namespaces(self, context, limit: int = TOP_NAMESPACES) -> list[dict]:
        """The caller's largest namespaces, cheaply (no walk over blocks): Stats' ``namespace_usage``."""
        rows, usage = [], self.usage.snapshot()
        for ns in self.visible_namespaces(context):
            held = self.store.namespace_bytes(ns.id)
            used = usage.get(ns.id)
            rows.append({"id": ns.id.hex(), "model": ns.layout.model, "tenant": ns.tenant, "bytes": held,
                         "blocks": held // max(ns.block_bytes, 1),
                         "hit_ratio": used.lookup_hits / used.lookup_blocks if used and used.lookup_blocks else None})
        return sorted(rows, key=lambda r: r["bytes"], reverse=True)[:limit]

    # -- changing what is stored ------------------------------------------------------------------

    def DropNamespace(self, request, context):
        ns = self.operated_namespace(context, request.namespace_id)
        freed = self.store.admin.drop_namespace(ns.id)
        self.usage.forget(ns.id)
        log.info("admin: namespace %s (model %r, tenant %r) dropped: %d blocks, %d bytes freed",
                 ns.id.hex(), ns.layout.model, ns.tenant, freed.blocks, freed.bytes)
        return pb.AdminResponse(blocks=freed.blocks, bytes=freed.bytes)

    def Evict(self, request, context):
        ns = self.operated_namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes, allow_empty=True)
        freed = self.store.admin.evict(ns.id, hashes or None)
        log.info("admin: evicted %d blocks (%d bytes) of namespace %s%s", freed.blocks, freed.bytes, ns.id.hex(),
                 f"; {freed.held} pinned blocks left in place" if freed.held else "")
        return pb.AdminResponse(blocks=freed.blocks, bytes=freed.bytes, skipped=freed.held)

    def Pin(self, request, context):
        ns = self.operated_namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes)
        done = self.store.admin.pins.pin(ns, hashes)
        log.info("admin: pinned %d blocks of namespace %s (tenant %r now pins %d bytes)", done.pinned,
                 ns.id.hex(), ns.tenant, done.tenant_pinned_bytes)
        return pb.AdminResponse(blocks=done.pinned, bytes=done.tenant_pinned_bytes, stored=done.stored,
                                warmed=done.warmed)

    def Unpin(self, request, context):
        ns = self.operated_namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes, allow_empty=True)
        done = self.store.admin.pins.unpin(ns.id, hashes or None)
        log.info("admin: unpinned %d blocks of namespace %s", done.pinned, ns.id.hex())
        return pb.AdminResponse(blocks=done.pinned, bytes=done.tenant_pinned_bytes)

    def Prewarm(self, request, context):
        """Copy a prefix's blocks into the CPU tier; in fleet mode the leading blocks missing here
        are fetched from peers (or the shared pool) first, verified as any peer fetch is."""
        ns = self.operated_namespace(context, request.namespace_id)
        hashes = check_hashes(request.hashes)
        fetched = 0
        fleet = self.service.fleet
        if fleet is not None:
            local = self.store.lookup(ns.id, hashes, lease=False).num_hit
            if local < len(hashes):
                fetched = max(0, fleet.fetch(ns.id, hashes[local:], parent=hashes[local - 1] if local else None))
        done = self.store.admin.prewarm(ns.id, hashes)
        log.info("admin: prewarm of namespace %s: %d blocks copied into the CPU tier, %d there already, %d missing, "
                 "%d fetched from peers", ns.id.hex(), done.warmed, done.already, done.missing, fetched)
        return pb.AdminResponse(blocks=done.warmed + done.already, warmed=done.warmed, stored=done.already,
                                skipped=done.missing + done.failed, fetched=fetched)

    def Reload(self, request, context):
        if not self._is_admin(context)[1]:
            raise PermissionDenied("reload: only tokens of admin_tenants may reload the daemon's configuration")
        applied, ignored = self.service.reloader()
        return pb.ReloadResponse(applied=applied, ignored=ignored)
