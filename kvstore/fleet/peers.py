"""Peer fetch: filling a local miss from the peers the directory names, verifying every byte.

The daemon fetches, not the client: every engine gets it through one code path, the fetched copy
lands in the local Store where all local workers reuse it, clients need no Redis credentials, and a
peer's bytes are checked against the published checksum before a single byte is stored.

What is checked is what was published: a node publishes the checksum of each block's payload as
it stores it (encoded, with a tier codec), the peer serves that payload as stored to a fetcher
that asks for it (``Client.get_payloads``), and the fetcher keeps it as it is (``Store.put`` with
its codec id), so fleet fetch works, bit-exact, with every codec, and the fetched copy publishes
the same checksum again.

Whom we talk to. Addresses come only from node entries whose MAC verifies under the fleet secret
and whose run (epoch) no tombstone revokes (``Directory.route``). The peer token never goes out:
every call proves possession of the fleet key and the token for that node id and epoch, and the
peer proves the same back before any byte of its answer is kept (``peer_proof``), so whoever holds
a signed entry's address without the keys gets one-call proofs it cannot use anywhere else, and
gives nothing (``peer_unproven``). With ``peer_tls_ca`` the connection also proves the peer's name.
The checksums come only from holders values signed for that very block. Clients are kept in a
bounded LRU (``max_clients``), one per address and node run; an evicted client is closed.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Sequence

import xxhash

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.fleet.directory import Directory
from kvstore.fleet.peer_proof import PeerKeys, PeerProver, PeerUnproven
from kvstore.fleet.routing import NodeRoute
from kvstore.store import Store

log = logging.getLogger("kvstore.fleet")


def grpc_client_factory(token, timeout_s: float, tls_ca: str | None = None, *,
                        secret=None) -> Callable[[str, tuple[str, int]], object]:
    """Clients for peers: no retries, never shared memory; blocks over the peer's side channel
    (raw TCP: 2-3x gRPC's rate) when it offers one, else gRPC streams; with ``tls_ca``, TLS and
    gRPC only (the side channel is not encrypted). Each is for one node run ``(node id, epoch)``,
    every call proving possession of the fleet ``secret`` and the peer ``token`` (a str or a
    pydantic SecretStr) without sending either. Whatever transport carried them, a peer's bytes
    are kept only when they match a checksum signed under the fleet key (``PeerFetcher``,
    ``DirectFetcher``)."""
    keys = PeerKeys(secret, token)
    transport = "grpc" if tls_ca else "bulk"

    def make(address: str, callee: tuple[str, int]):
        from kvstore.client import Client
        return Client(url=address, token=None, timeout_s=timeout_s, transport=transport, retries=0, root_ca=tls_ca,
                      interceptors=(PeerProver(keys, *callee),))
    return make


class PeerClients:
    """At most ``max_clients`` open peer clients, least recently used evicted (and closed), each
    with the namespaces already registered on it."""

    def __init__(self, factory: Callable[[str, tuple[str, int]], object], max_clients: int = 64) -> None:
        if max_clients < 1:
            raise InvalidArgument("fleet.max_peer_clients", f"must be >= 1; got {max_clients}")
        self.factory = factory
        self.max_clients = max_clients
        self.evicted = 0
        self._clients: collections.OrderedDict[tuple, tuple[object, set[bytes]]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._clients)

    def get(self, address: str, store: Store, ns: bytes, callee: tuple[str, int] = ("", 0)):
        """A client for the peer at ``address`` that is node run ``callee`` ``(node id, epoch)``,
        with namespace ``ns`` registered there (the Client needs its layout)."""
        evicted = []
        key = (address, *callee)
        with self._lock:
            entry = self._clients.get(key)
            if entry is None:
                entry = (self.factory(address, callee), set())
                self._clients[key] = entry
                while len(self._clients) > self.max_clients:
                    _, (old, _) = self._clients.popitem(last=False)
                    self.evicted += 1
                    evicted.append(old)
            self._clients.move_to_end(key)
        for old in evicted:
            _close(old)
        # Outside the lock: a registration is a round trip to the peer (up to its timeout), and
        # one slow peer must not hold up fetches from every other (registering twice is harmless).
        client, registered = entry
        if ns not in registered and hasattr(client, "register_namespace"):
            got = client.register_namespace(store.namespace(ns))
            if got != ns:
                raise InvalidArgument("fleet.peer_token", f"peer {address} files this namespace under "
                                      "another tenant; give the fleet a token of the same tenant")
            registered.add(ns)
        return client

    def close(self) -> None:
        with self._lock:
            for client, _ in self._clients.values():
                _close(client)
            self._clients.clear()


def stored_payloads(client, ns: bytes, hashes: list[bytes]) -> list:
    """Per block ``(codec id, payload)`` as the peer stores it, or None for a miss. A peer client
    without ``get_payloads`` (an in-process stand-in) serves raw blocks."""
    if hasattr(client, "get_payloads"):
        return client.get_payloads(ns, hashes)
    return [None if data is None else (0, data) for data in client.get(ns, hashes)]


@dataclasses.dataclass
class VerifiedRun:
    """The leading blocks of a peer's answer whose bytes match the checksums they were vouched for
    with (what may be stored), and why the run stopped short: None (it did not), "miss" (a block
    or its checksum missing) or "mismatch" (bytes that do not match: never stored)."""

    hashes: list[bytes]
    payloads: list
    codecs: list[int]
    stop: str | None = None


def verified_run(hashes: Sequence[bytes], answers: Sequence, checksums: Sequence[int | None]) -> VerifiedRun:
    """The leading run of ``answers`` (``stored_payloads``' for ``hashes``) whose xxh3_64 equals its
    entry of ``checksums``; a peer is trusted with no byte it cannot match to a signed checksum."""
    run = VerifiedRun([], [], [])
    for h, answer, want in zip(hashes, answers, checksums):
        if answer is None or want is None:
            run.stop = "miss"
            break
        codec, data = answer
        if xxhash.xxh3_64_intdigest(data) != want:
            run.stop = "mismatch"
            break
        run.hashes.append(h)
        run.payloads.append(data)
        run.codecs.append(codec)
    return run


def _close(client) -> None:
    try:
        client.close()
    except Exception:  # noqa: BLE001 - a broken peer connection is not our error
        pass


class PeerFetcher:
    """Copies the leading blocks of a request from peers (or a shared Redis pool) into the Store."""

    def __init__(self, store: Store, directory: Directory, clients: PeerClients, node_id: str, *,
                 fetch_batch: int, skip_failed_s: float, counters: dict[str, int], shared_pool=None) -> None:
        self.store = store
        self.directory = directory
        self.clients = clients
        self.node_id = node_id
        self.fetch_batch = fetch_batch
        self.skip_failed_s = skip_failed_s
        self.counters = counters
        self.shared_pool = shared_pool            # a RedisTier shared by the fleet, or None
        self._suspects: dict[str, float] = {}     # node id -> until when we skip it

    def fetch(self, namespace_id: bytes, hashes: Sequence[bytes], parent: bytes | None = None) -> int:
        """Copy the leading blocks of ``hashes`` from peers into the local store; returns how many
        leading blocks are now local. A block whose bytes do not match the checksum its owner
        published is never stored (counted as ``peer_checksum_mismatch``); the run stops there."""
        hashes = list(hashes)
        got = self._fetch_from_pool(namespace_id, hashes, parent) if self.shared_pool is not None else 0
        if got == len(hashes):
            self.counters["fetched_blocks"] += got
            return got
        try:
            routes = self.directory.route(namespace_id, hashes)
        except Exception as e:  # noqa: BLE001
            self.counters["fetch_directory_errors"] += 1
            log.debug("fleet: directory unavailable for fetch: %s", e)
            return got
        now = time.monotonic()
        for r in routes:
            if r.node_id == self.node_id or r.blocks <= got or self._suspects.get(r.node_id, 0) > now:
                continue
            got += self._fetch_from(r, namespace_id, hashes[got:r.blocks], hashes[got - 1] if got else parent)
            if got == len(hashes):
                break
        self.counters["fetched_blocks"] += got
        if got:
            self.counters["fetches"] += 1
        return got

    def _fetch_from_pool(self, ns: bytes, hashes: list[bytes], parent: bytes | None) -> int:
        """The leading blocks found in the shared Redis pool (verified there), stored locally."""
        try:
            blocks = self.shared_pool.load(ns, hashes, with_codecs=True)  # as stored: encoded or raw
        except Exception as e:  # noqa: BLE001
            self.counters["pool_errors"] += 1
            log.debug("fleet: shared pool unavailable: %s", e)
            return 0
        run = 0
        while run < len(blocks) and blocks[run] is not None:
            run += 1
        if not run:
            return 0
        try:
            self.store.put(ns, hashes[:run], [b[1] for b in blocks[:run]], parent=parent,
                           codecs=[b[0] for b in blocks[:run]])
        except KVStoreError as e:
            self.counters["pool_errors"] += 1
            log.info("fleet: could not keep blocks from the shared pool: %s", e)
            return 0
        self.counters["pool_blocks"] += run
        return run

    def _fetch_from(self, route: NodeRoute, ns: bytes, want: list[bytes], parent: bytes | None) -> int:
        """Fetch ``want`` from one peer in batches, verifying each block; returns blocks stored."""
        stored = 0
        try:
            expected = self.directory.checksums(ns, route.slot, want)
            if not want or expected[0] is None:   # nothing it could send would be kept: do not call
                self.counters["peer_misses"] += 1
                return 0
            client = self.clients.get(route.address, self.store, ns, (route.node_id, route.epoch))
            for i in range(0, len(want), self.fetch_batch):
                batch = want[i:i + self.fetch_batch]
                run = verified_run(batch, stored_payloads(client, ns, batch), expected[i:i + len(batch)])
                if run.stop == "miss":
                    self.counters["peer_misses"] += 1
                elif run.stop == "mismatch":
                    self.counters["peer_checksum_mismatch"] += 1
                    log.warning("fleet: block %s from %s failed its published checksum; not stored",
                                batch[len(run.hashes)].hex(), route.node_id)
                if run.hashes:
                    self.store.put(ns, run.hashes, run.payloads, parent=want[i - 1] if i else parent,
                                   codecs=run.codecs)
                    stored += len(run.hashes)
                    parent = run.hashes[-1]
                if len(run.hashes) < len(batch):
                    break
        except Exception as e:  # noqa: BLE001 - a broken peer or directory is a miss, never a crash
            self.counters["peer_unproven" if isinstance(e, PeerUnproven) else "peer_errors"] += 1
            self._suspects[route.node_id] = time.monotonic() + self.skip_failed_s
            log.info("fleet: fetch from %s at %s failed: %s", route.node_id, route.address, e)
        return stored
