"""What every role of the KVStore service shares: the daemon's state and the caller's identity and namespace.

Every role (``servicer.py``) reaches the Store, the caller's tenant and namespace, the transports'
servers and the metrics only through this class, so who-may-see-what is decided in one place: the
caller's tenant is folded into every namespace it registers, and a namespace id of another tenant
is answered exactly like an unknown one.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable

from kvstore.buffers import SCRATCH_KEEP_BYTES, Scratch
from kvstore.threads import ThreadBudget
from kvstore.errors import InvalidArgument, LayoutMismatch, UnknownNamespace
from kvstore.keys import Namespace
from kvstore.proto import kvstore_pb2 as pb
from kvstore.service.auth import Authenticator
from kvstore.service.config import Settings
from kvstore.service.gc_pauses import GcPauses
from kvstore.service.metrics import Metrics
from kvstore.service.stalls import StallWatch
from kvstore.service.usage import NamespaceUsage
from kvstore.store import Store
from kvstore.transport.bulk_server import BulkServer
from kvstore.transport.local_lookup import LocalLookupServer
from kvstore.transport.segments import SegmentBroker
from kvstore.wire import CAPPED_KEY, SERVER_ID_KEY, UNSTAGED_KEY

PUT_RESULT = {"stored": pb.PUT_STORED, "exists": pb.PUT_EXISTS, "persisted": pb.PUT_PERSISTED}


class PlainContext:
    """A call's context outside gRPC (a lease call over the Unix socket, the HTTP route): the
    tenant a ticket proved (None: ``ServiceState.tenant_of`` resolves it from ``metadata``), the
    metadata the call carries, and the trailing metadata the method sets, sent back with the answer."""

    def __init__(self, tenant: str | None = None, metadata: tuple = ()) -> None:
        self.tenant = tenant
        self._metadata = metadata
        self.trailing: tuple = ()

    def invocation_metadata(self):
        return self._metadata

    def set_trailing_metadata(self, metadata) -> None:
        self.trailing = tuple(metadata)


class ServiceState:
    def __init__(self, store: Store, settings: Settings, *, auth: Authenticator, metrics: Metrics,
                 bulk: BulkServer | None, segments: SegmentBroker | None, threads: ThreadBudget) -> None:
        self.store = store
        self.threads = threads   # what every pool of the process is sized to (``kvstore stats``)
        self.auth = auth
        self.metrics = metrics
        self.shm_dir = settings.shm_dir
        self.chunk_bytes = settings.chunk_bytes
        self.max_message_bytes = settings.max_message_bytes
        self.bulk = bulk
        self.segments = segments   # hands tenant segments' descriptors out (auth on), else None
        self.local_lookups: LocalLookupServer | None = None   # same-host Lookup over a Unix socket (build_server)
        self.server_id = secrets.token_hex(8)
        self.fleet = None  # kvstore.fleet.Fleet in fleet mode (set by the daemon)
        self.gc_pauses = GcPauses()   # every collection stops every request: timed, shown in Stats and metrics
        #: set by the daemon (``reload.Reloader``): re-reads the configuration and applies it
        self.reloader: Callable[[], tuple[list[str], list[str]]] | None = None
        self.started = time.time()
        # one pre-touched, page-aligned payload buffer per worker thread, for bodies that run on one
        # thread from start to end (a gRPC stream's steps may hop threads: they own their buffers)
        self.scratch = Scratch(trim_above=SCRATCH_KEEP_BYTES, aligned=True, min_bytes=1 << 20)
        self.stalls = StallWatch(max(2 * settings.lease_seconds, 1.0))   # a caller idle this long is cut
        self.usage = NamespaceUsage()   # lookups per namespace: Stats, ListNamespaces, metrics

    def close_transports(self) -> None:
        """Close the socket servers beside gRPC: the side channel, the segment broker, the
        same-host lookup socket."""
        for server in (self.bulk, self.segments, self.local_lookups):
            if server is not None:
                server.close()

    def tenant_of(self, context, requested: str = "") -> str:
        """The caller's tenant, resolved once per call: with auth on, the token check hashes the
        token and compares it with every known one, and a side-channel RPC asks three times."""
        if not self.auth.enabled:
            return self.auth.tenant(context.invocation_metadata(), requested)
        tenant = getattr(context, "tenant", None)
        if tenant is None:
            tenant = context.tenant = self.auth.tenant(context.invocation_metadata())
        return tenant

    def caller_namespace(self, context, namespace_id: bytes, block_bytes: int = 0) -> Namespace:
        """The caller's namespace, or NOT_FOUND (also for another tenant's: no probing)."""
        return self.tenant_namespace(self.tenant_of(context), namespace_id, block_bytes)

    def tenant_namespace(self, tenant: str, namespace_id: bytes, block_bytes: int = 0,
                         any_tenant: bool = False) -> Namespace:
        """``tenant``'s namespace, or NOT_FOUND (also for another tenant's, unless ``any_tenant``:
        an admin's operator command)."""
        if len(namespace_id) != 16:
            raise InvalidArgument("namespace_id", f"must be 16 bytes (from RegisterNamespace), got {len(namespace_id)}")
        try:
            ns = self.store.namespace(bytes(namespace_id))
        except UnknownNamespace:
            raise UnknownNamespace(bytes(namespace_id)) from None
        if self.auth.enabled and not any_tenant and ns.tenant != tenant:
            raise UnknownNamespace(bytes(namespace_id))
        if block_bytes and block_bytes != ns.block_bytes:
            raise LayoutMismatch(f"block_bytes: the client expects {block_bytes}-byte blocks; namespace "
                                 f"{ns.id.hex()} has {ns.block_bytes}-byte blocks (layout differs)")
        return ns

    def identify(self, context, unstaged: bool = False, capped: bool = False) -> None:
        """Tell a same-host client which daemon run answered: its arena mapping is only valid
        for that run (a restarted daemon has a new arena; stale offsets would be wrong bytes).
        ``unstaged``: a load stopped at a block that *is* present but could not be staged in the
        arena right now (every slot pinned), so the client fetches it another way, not a miss.
        ``capped``: the load stopped at its tenant's lease budget (``leases``): once the client has
        released its other load leases, it may ask for the rest again."""
        meta = [(SERVER_ID_KEY, self.server_id)]
        if unstaged:
            meta.append((UNSTAGED_KEY, "1"))
        if capped:
            meta.append((CAPPED_KEY, "1"))
        context.set_trailing_metadata(tuple(meta))
