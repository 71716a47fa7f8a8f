"""Which transport data calls use, agreed with the daemon run that answered the Handshake.

``"auto"`` maps the daemon's arena when it is openable on this host (proved by a nonce the daemon
writes next to the arena and by the arena file's identity), else opens the raw-TCP side channel,
else streams gRPC chunks. The choice is per daemon *run*: it is dropped when the daemon becomes
unreachable or a lease answer comes from another run, and made again on the next data call.

Compressed transfer is agreed here too: the Handshake lists the codecs the daemon stores blocks
with, and a client that can decode them (``kvstore.codecs`` importable, ``compressed_transfer``
on) asks for blocks as stored (``accept_codecs``). A daemon without codecs costs no torch import.
"""

from __future__ import annotations

import secrets
import threading
import time

import grpc

from kvstore.client.lease_calls import LeaseCalls
from kvstore.client.rpc import RpcChannel
from kvstore.client.rpc_errors import DaemonRestarted, error_from_rpc
from kvstore.errors import DaemonUnavailable, InvalidArgument, KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.transport import chunks, shm
from kvstore.transport.bulk import BulkChannel
from kvstore.transport.local_calls import LocalCalls
from kvstore.transport.local_lookup import LocalLookup
from kvstore.transport.segments import SegmentMap
from kvstore.wire import PROTOCOL_VERSION, SERVER_ID_KEY

TRANSPORTS = ("auto", "shm", "bulk", "grpc")
#: back-off between attempts to connect the lookup socket again: first, most (seconds)
LOOKUP_BACKOFF_S = (0.05, 5.0)


class Negotiation:
    """The negotiated transport: a mapped arena (shm), a side channel (bulk), or neither (gRPC)."""

    def __init__(self, rpc: RpcChannel, transport: str, chunk_bytes: int | None,
                 compressed_transfer: bool = True, lookup_index: bool = True, local_leases: bool = True) -> None:
        if transport not in TRANSPORTS:
            raise InvalidArgument("transport", f"one of {TRANSPORTS}, got {transport!r}")
        self.rpc = rpc
        self.transport = transport
        self.chunk_bytes = chunk_bytes
        self.compressed_transfer = compressed_transfer
        self.lookup_index = lookup_index
        self.local_leases = local_leases
        self.accept_codecs: tuple[int, ...] = ()   # codecs of this daemon run that we decode ourselves
        self.server_id: str | None = None   # the daemon run whose arena / side channel we hold
        self.fleet_node = ""                 # the daemon's node id in its fleet ("" fleet mode off)
        self.arena: shm.ArenaMap | SegmentMap | None = None
        self.bulk: BulkChannel | None = None
        self.lookups: LocalLookup | None = None   # same-host Lookup over the daemon's Unix socket
        self._lookup_offer = None      # the Handshake that offered it: connected again from it when lost
        self._lookup_backoff = 0.0     # seconds to wait before the next attempt (0: at once)
        self._lookup_retry_at = 0.0
        self.leases = LeaseCalls(rpc)   # the shm path's lease RPCs: over that socket too when offered
        self._negotiated = False
        self._lock = threading.Lock()
        rpc.on_unreachable = self.reset

    @property
    def active(self) -> str:
        """What data calls use now: "shm", "bulk" or "grpc"."""
        self.ensure()
        return "shm" if self.arena is not None else "bulk" if self.bulk is not None else "grpc"

    def ensure(self) -> None:
        """Handshake with the daemon unless this run's transport is already agreed."""
        if self._negotiated:
            return
        nonce = secrets.token_bytes(16) if self.transport in ("auto", "shm") else b""  # no probe file otherwise
        hs = self.rpc.call("Handshake", pb.HandshakeRequest(nonce=nonce, client_version=PROTOCOL_VERSION))
        with self._lock:
            if self._negotiated:
                return
            self.server_id = hs.server_id
            self.fleet_node = hs.fleet_node
            if self.chunk_bytes is None:
                self.chunk_bytes = hs.chunk_bytes or chunks.DEFAULT_CHUNK_BYTES
            self.arena = self._map_arena(hs, nonce)
            self._lookup_offer = hs if hs.lookup_socket else None
            self._lookup_backoff = 0.0
            self.lookups = self._local_lookups(hs)
            self.leases.local = self._local_calls(hs) if self.arena is not None and self.local_leases else None
            self.accept_codecs = self._decodable(hs.stored_codecs)
            if self.arena is None and self.transport in ("auto", "bulk") and hs.bulk_port:
                try:
                    self.bulk = BulkChannel(self.rpc.host, hs.bulk_port, hs.bulk_ticket, self.rpc.timeout_s)
                except OSError:
                    self.bulk = None
            self._negotiated = True

    def _decodable(self, stored: list[int]) -> tuple[int, ...]:
        """The daemon's stored codecs this process can decode (without torch: zstd only)."""
        if not stored or not self.compressed_transfer:
            return ()
        try:
            from kvstore import codecs
        except ImportError:
            return ()
        known = set(codecs.CODEC_IDS.values())
        return tuple(c for c in stored if c in known and not codecs.unavailable(c))

    def live_bulk(self) -> BulkChannel | None:
        """The side channel for the next transfer. The daemon closes sessions that idle past its
        bound or that it evicts to make room; if this one is gone, renegotiate before using it."""
        bulk = self.bulk
        if bulk is not None and not bulk.alive():
            self.reset()
            self.ensure()
            bulk = self.bulk
        return bulk

    def _map_arena(self, hs, nonce: bytes) -> shm.ArenaMap | SegmentMap | None:
        arena = None
        if self.transport in ("auto", "shm") and hs.segment_socket:
            try:   # auth on: our tenant's segments, by descriptor; reaching the socket proves the host
                arena = SegmentMap(hs.segment_socket, hs.segment_ticket, hs.tenant, hs.segment_bytes,
                                   min(self.rpc.timeout_s, 2.0))
            except OSError:
                arena = None
        elif self.transport in ("auto", "shm") and hs.arena_path and shm.nonce_is_local(hs.probe_path, nonce):
            try:
                arena = shm.ArenaMap(hs.arena_path, hs.arena_bytes, hs.arena_dev, hs.arena_ino)
            except OSError:
                arena = None
        if self.transport == "shm" and arena is None:
            raise InvalidArgument("transport", "shm was requested but the daemon's arena is not "
                                               "reachable from this process (another host, or no CPU tier)")
        return arena

    def _local_lookups(self, hs) -> LocalLookup | None:
        if not hs.lookup_socket:
            return None
        try:
            return LocalLookup(hs.lookup_socket, hs.lookup_ticket, hs.tenant, min(self.rpc.timeout_s, 2.0),
                               use_index=self.lookup_index)
        except OSError:   # not on the daemon's host (or its socket is gone): lookups stay on gRPC
            return None

    def _local_calls(self, hs) -> LocalCalls | None:
        if not hs.lease_socket:
            return None
        try:
            return LocalCalls(hs.lease_socket, hs.lease_ticket, hs.tenant, self.rpc.timeout_s)
        except OSError:   # its socket is gone already: lease calls stay on gRPC
            return None

    def drop_local_lookups(self) -> None:
        """The lookup connection broke (the daemon let it go): ``local_lookups`` connects again."""
        with self._lock:
            if self.lookups is not None:
                self.lookups.close()
                self.lookups = None

    def local_lookups(self) -> LocalLookup | None:
        """The same-host lookup connection, connected again from the last Handshake's offer when
        the daemon let the old one go (pushed out, idle, revoked): at once the first time, then
        with back-off (``LOOKUP_BACKOFF_S``, doubling) while attempts fail; None meanwhile (the
        caller asks over gRPC)."""
        lookups = self.lookups
        if lookups is not None or self._lookup_offer is None or time.monotonic() < self._lookup_retry_at:
            return lookups
        with self._lock:
            if self.lookups is None and self._lookup_offer is not None:
                self.lookups = self._local_lookups(self._lookup_offer)
                if self.lookups is None:
                    self._lookup_backoff = min(max(2 * self._lookup_backoff, LOOKUP_BACKOFF_S[0]), LOOKUP_BACKOFF_S[1])
                    self._lookup_retry_at = time.monotonic() + self._lookup_backoff
                else:
                    self._lookup_backoff = 0.0
            return self.lookups

    def reset(self) -> None:
        """Forget the negotiated transport (the daemon may have restarted with a new arena)."""
        with self._lock:
            self._negotiated = False
            self._lookup_offer = None
            if self.lookups is not None:
                self.lookups.close()
                self.lookups = None
            self.leases.close()
            if self.arena is not None:
                self.arena.close()
                self.arena = None
            if self.bulk is not None:
                self.bulk.close()
                self.bulk = None

    def call_same_daemon(self, method: str, request):
        """A lease RPC whose answer holds arena offsets: valid only if the daemon run that answered
        is the one whose arena we mapped. A daemon restarted behind the same address (the channel
        reconnects silently) has a new arena; using its offsets in the old mapping would hand out
        wrong bytes, so that raises ``DaemonRestarted`` and the caller renegotiates. (Over the
        daemon's Unix socket the run that answers is the one that handed the socket out, and
        says so too.)"""
        resp, meta = self.leases.call(method, request)
        return self.same_daemon_answer(method, resp, meta)

    def start_same_daemon(self, method: str, request, wait: bool = False) -> "SameDaemonCall":
        """``call_same_daemon`` sent now and read later, so the daemon prepares the next lease
        while this client copies through the current one (``wait``: made at once, as
        ``LeaseCalls.start`` says)."""
        return SameDaemonCall(self, method, request, wait)

    def same_daemon_answer(self, method: str, resp, meta: dict):
        """``(resp, trailing metadata)`` of a lease RPC if the daemon run we mapped answered it."""
        answered_by = meta.get(SERVER_ID_KEY)
        if answered_by != self.server_id:
            release = "CompleteLoad" if method == "PrepareLoad" else "AbortStore"
            try:
                self.rpc.call(release, pb.LeaseRequest(lease_id=resp.lease_id))
            except KVStoreError:
                pass  # it expires on its own
            self.reset()
            raise DaemonRestarted(f"the daemon at {self.rpc.address} restarted (run {answered_by}, "
                                  f"mapped {self.server_id})")
        return resp, meta


class SameDaemonCall:
    """A lease RPC in flight (``Negotiation.start_same_daemon``). ``sent``: when it left, so no
    lease it answers with started earlier. ``result()`` answers as ``call_same_daemon`` does: an
    attempt that found the daemon unreachable is made again that way (with its retries)."""

    def __init__(self, negotiation: Negotiation, method: str, request, wait: bool = False) -> None:
        if negotiation.rpc.closed:
            raise DaemonUnavailable("client is closed")
        self._negotiation, self._method, self._request = negotiation, method, request
        self.sent = time.monotonic()
        self._future = negotiation.leases.start(method, request, wait)

    def result(self):
        try:
            resp = self._future.result()
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                self.sent = time.monotonic()
                return self._negotiation.call_same_daemon(self._method, self._request)
            raise self._negotiation.rpc.failed(error_from_rpc(e)) from None
        return self._negotiation.same_daemon_answer(self._method, resp, dict(self._future.trailing_metadata()))
