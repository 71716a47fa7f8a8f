"""``Fleet``: one daemon's membership in a fleet, composing the directory, the publisher, peer
fetch and routing behind the two calls the daemon makes (``lookup`` and ``route``)."""

from __future__ import annotations

import collections
import logging
import secrets
from collections.abc import Callable, Sequence

import numpy as np

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.fleet.checksums import payload_checksum
from kvstore.fleet.direct import COUNTERS as DIRECT_COUNTERS
from kvstore.fleet.direct import DirectFetcher
from kvstore.fleet.directory import Directory
from kvstore.fleet.peer_proof import PeerKeys, PeerVerifier
from kvstore.fleet.peers import PeerClients, PeerFetcher, grpc_client_factory
from kvstore.fleet.publisher import Publisher
from kvstore.fleet.records import CHECKSUM_BYTES
from kvstore.fleet.routing import NodeRoute
from kvstore.keys import ChainHasher
from kvstore.store import Lookup, Store

log = logging.getLogger("kvstore.fleet")


class Fleet:
    """One daemon's membership in a fleet. Construct from config, ``start()``, ``close()``.

    The daemon wires it in two places: ``store`` is the daemon's Store (the publisher subscribes
    to it), and the Lookup path calls ``fleet.lookup`` instead of ``store.lookup`` so a local miss
    is filled from a peer before the answer goes back. ``secret`` is the fleet secret every daemon
    of the fleet shares: directory values are signed with it and nothing unsigned is acted on.
    ``epoch`` (random per Fleet) names this run of the node: its entries are signed for it, peers
    prove themselves to it and it to them (``peer_verifier``, which the daemon's server uses), and
    ``close`` revokes it."""

    def __init__(self, store: Store, redis_url: str, node_id: str, advertise_addr: str, *,
                 key_prefix: str = "kvs", heartbeat_s: float = 2.0, ttl_s: float = 10.0,
                 flush_interval_s: float = 0.02, sweep_every: int = 10, peer_token: str | None = None,
                 peer_timeout_s: float = 2.0, peer_fetch: bool = True, fetch_batch: int = 64,
                 socket_timeout_s: float = 0.5, shared_pool=None, secret=None, peer_tls_ca: str | None = None,
                 max_peer_clients: int = 64,
                 client_factory: Callable[[str, tuple[str, int]], object] | None = None) -> None:
        if not node_id or any(c in node_id for c in " {}"):
            raise InvalidArgument("fleet.node_id", "must be non-empty, without spaces or braces")
        if not advertise_addr or " " in advertise_addr:
            raise InvalidArgument("fleet.advertise_addr", "must be a host:port peers can reach")
        if not 0 < heartbeat_s < ttl_s:
            raise InvalidArgument("fleet.ttl_s", f"must exceed heartbeat_s ({heartbeat_s}); got {ttl_s}")
        self.store = store
        self.node_id = node_id
        self.advertise_addr = advertise_addr
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self.peer_fetch_enabled = peer_fetch
        self.epoch = secrets.randbits(63)
        self.counters: dict[str, int] = collections.defaultdict(int)
        # a namespace's keys outlive the last heartbeat of the whole fleet by keep_s
        self.directory = Directory(redis_url, key_prefix, socket_timeout_s, keep_s=max(60.0, 10 * ttl_s),
                                   secret=secret, counters=self.counters)
        self.publisher = Publisher(store, self.directory, node_id, advertise_addr, heartbeat_s=heartbeat_s,
                                   ttl_s=ttl_s, flush_interval_s=flush_interval_s, sweep_every=sweep_every,
                                   counters=self.counters, epoch=self.epoch)
        self.peer_verifier = PeerVerifier(PeerKeys(secret), node_id, self.epoch)
        self.peers = PeerClients(client_factory or grpc_client_factory(peer_token, peer_timeout_s, peer_tls_ca,
                                                                       secret=secret),
                                 max_peer_clients)
        self.fetcher = PeerFetcher(store, self.directory, self.peers, node_id, fetch_batch=fetch_batch,
                                   skip_failed_s=heartbeat_s, counters=self.counters, shared_pool=shared_pool)
        self.direct = DirectFetcher(store, self.directory, self.peers, node_id, fetch_batch=fetch_batch,
                                    refresh_s=heartbeat_s, skip_failed_s=heartbeat_s, counters=self.counters)
        self._slots = self.publisher.slots   # ns -> our slot (the same dict; tests read it)

    @property
    def connected(self) -> bool:
        """False while the publisher cannot reach Redis (misses then skip the directory)."""
        return self.publisher.connected

    def start(self) -> "Fleet":
        self.publisher.start()
        return self

    def close(self, unpublish: bool = True) -> None:
        """Stop publishing; by default also withdraw this node's entries so peers stop routing here."""
        self.publisher.stop(unpublish)
        self.peers.close()
        self.directory.close()

    def wait_published(self, timeout_s: float = 10.0) -> bool:
        """Block until every store event so far is in Redis (tests, graceful drains)."""
        return self.publisher.wait_published(timeout_s)

    # -- routing ---------------------------------------------------------------------------------

    def route(self, namespace_id: bytes, hashes: Sequence[bytes] | None = None, *,
              token_ids: Sequence[int] | None = None, hasher: ChainHasher | None = None) -> list[NodeRoute]:
        """Per node, the leading blocks/tokens of this request it holds, longest first.
        Give block ``hashes`` or ``token_ids`` (hashed here with ``hasher``, default xxh3_128
        seed 0 — it must match what the engine's connector uses). Redis down -> []."""
        block_tokens = self._block_tokens(namespace_id)
        if hashes is None:
            if token_ids is None:
                raise InvalidArgument("hashes", "give block hashes or token_ids")
            if block_tokens is None:
                raise InvalidArgument("namespace_id", "unknown here; route by hashes or register it")
            hashes = (hasher or ChainHasher()).chain(token_ids, block_tokens)
        try:
            return self.directory.route(namespace_id, hashes, block_tokens)
        except KVStoreError:
            raise
        except Exception as e:  # noqa: BLE001 - the directory is advice: no answer, not an error
            self.counters["route_errors"] += 1
            log.debug("fleet: route failed: %s", e)
            return []

    def _block_tokens(self, namespace_id: bytes) -> int | None:
        try:
            return self.store.namespace(namespace_id).layout.block_tokens
        except KVStoreError:
            return None

    # -- peer fetch ------------------------------------------------------------------------------

    def lookup(self, namespace_id: bytes, hashes: Sequence[bytes], lease: bool = True, producer: str = "") -> Lookup:
        """``store.lookup``, but a local miss is first filled from peers (when fleet mode is on):
        from the member ``producer`` names directly (``DirectFetcher``: a P/D hand-off's producer,
        an untrusted hint), then what is still missing through the directory (``fetch``)."""
        result = self.store.lookup(namespace_id, hashes, lease=lease)
        if result.num_hit < len(hashes) and self.peer_fetch_enabled:
            first = result.num_hit
            got = self.direct.fetch(namespace_id, hashes[first:], hashes[first - 1] if first else None,
                                    producer) if producer else 0
            at = first + got
            if at < len(hashes):
                got += self.fetch(namespace_id, hashes[at:], parent=hashes[at - 1] if at else None)
            if got:
                result = self.store.lookup(namespace_id, hashes, lease=lease)
        return result

    def signed_checksums(self, namespace_id: bytes, hashes: Sequence[bytes]) -> list[bytes]:
        """What a peer's direct fetch checks this node's bytes against (``PeerChecksums``): for
        each leading block held here, the checksum of its payload as stored, signed for that very
        block as its directory record is; b"" from the first block not held on."""
        out: list[bytes] = []
        for h in hashes:
            try:
                with self.store.pinned(namespace_id, h) as block:
                    checksum = None if block is None else payload_checksum(block, _fresh_buffer)
            except Exception as e:  # noqa: BLE001 - a block that cannot be read is not vouched for
                log.debug("fleet: cannot checksum block %s for a peer: %s", h.hex(), e)
                checksum = None
            if checksum is None:
                break
            out.append(self.directory.signer.checksum_prefix(namespace_id, h,
                                                             checksum.to_bytes(CHECKSUM_BYTES, "little")))
        self.counters["checksums_served"] += len(out)
        return out + [b""] * (len(hashes) - len(out))

    def fetch(self, namespace_id: bytes, hashes: Sequence[bytes], parent: bytes | None = None) -> int:
        """Copy the leading blocks of ``hashes`` from peers into the local store (``PeerFetcher``);
        returns how many leading blocks are now local."""
        if not hashes:
            return 0
        if not self.connected:   # the publisher saw Redis fail: do not make every miss wait for it
            self.counters["fetch_skipped_disconnected"] += 1
            return 0
        return self.fetcher.fetch(namespace_id, hashes, parent)

    def stats(self) -> dict:
        mirror = self.publisher.mirror
        return {"node_id": self.node_id, "connected": self.connected, "namespaces": len(mirror),
                "published_blocks": sum(len(m) for m in mirror.values()), "peer_clients": len(self.peers),
                "counters": {**dict.fromkeys(DIRECT_COUNTERS, 0), **self.counters,
                             "peer_clients_evicted": self.peers.evicted,
                             "peer_proofs_refused": self.peer_verifier.refused}}


def _fresh_buffer(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)
