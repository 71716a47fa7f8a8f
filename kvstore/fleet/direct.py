"""Direct fetch: the blocks of a P/D hand-off, copied from the fleet member that produced them.

A decode engine's connector knows from its hand-off params which fleet node's daemon prefilled the
prompt, and names that node on the lookups it makes while it waits (``LookupRequest.producer``).
Without the name this daemon finds the blocks only once the producer's publisher has flushed them
to the directory, and then through a route and a checksums read in Redis. With it, the daemon asks
the member at once: one ``PeerChecksums`` call for the blocks it misses, then one get of those
the member holds (in batches of ``fetch_batch``), and keeps each block whose bytes match the
checksum the member signed for it. No Redis read per block or per lookup: the namespace's
membership is read at most once per ``refresh_s``, and once per ``MISS_REFRESH_S`` while it lacks
the node named (a producer that has just joined the namespace is found within that).

Threat model. The node id comes from a client's request body, so it is untrusted. What a client
that can look blocks up here can make this daemon do with it:

* Call a node. The address and the node run called come only from this namespace's verified live
  membership (node entries signed under the fleet secret, of runs no tombstone revokes:
  ``Directory.members``), never from the client. A node id that is not a live member, that is
  this daemon, or that is no node id at all gets no call (counted as ``direct_refused_unknown``,
  ``_self``, ``_malformed``), and the lookup goes on as it would without it. Naming ids that are
  not members costs at most one membership read per namespace per ``MISS_REFRESH_S``.
* Fetch blocks. Only the blocks of hashes the client looked up in its own namespace, and only
  from a member of the fleet: that member's own bytes for those hashes, which the directory path
  would fetch from it too once it published them.

Why the bytes kept are trustworthy without the directory. The member proves it is the node run
its signed entry names before anything it answers is kept (``peer_proof``), and it signs each
checksum under the fleet key, bound to the namespace and the block hash, exactly as its directory
record is signed. A checksum that does not verify, and a block whose bytes do not match its
checksum (corrupted in transit, or changed by anyone on the way), is not stored: counted
(``direct_bad_mac``, ``direct_checksum_mismatch``), and the run stops there, a miss. A member
that fails a call is skipped for ``skip_failed_s`` (``direct_failures``, or ``direct_unproven``
when it did not prove itself). Nothing here ever raises to the lookup.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvstore.fleet.directory import Directory
from kvstore.fleet.peer_proof import PeerUnproven
from kvstore.fleet.peers import PeerClients, stored_payloads, verified_run
from kvstore.fleet.records import CHECKSUM_BYTES
from kvstore.proto import kvstore_pb2 as pb
from kvstore.store import Store

log = logging.getLogger("kvstore.fleet")

#: the counters of direct fetches, both ends (the callee's ``checksums_served``), in ``kvstore stats``
#: (``fleet.counters``) from the start, at 0 until they happen
COUNTERS = ("checksums_served", "direct_fetches", "direct_blocks", "direct_misses", "direct_failures", "direct_unproven",
            "direct_bad_mac", "direct_checksum_mismatch", "direct_refused_malformed", "direct_refused_self",
            "direct_refused_unknown", "direct_skipped_failed", "direct_directory_errors")
MAX_NODE_ID = 256            # longer is no node id (fleet.node_id is a host name or like it)
MISS_REFRESH_S = 0.1         # how stale a membership view lacking the named node may be
_MAX_NAMESPACES = 1024       # membership views kept


def well_formed_node_id(node_id) -> bool:
    """Whether ``node_id`` could name a fleet node: printable, no spaces or braces, bounded."""
    return isinstance(node_id, str) and 0 < len(node_id) <= MAX_NODE_ID and node_id.isprintable() \
        and not any(c in node_id for c in " {}")


class DirectFetcher:
    """Copies the leading blocks of a lookup from the member that a hand-off names."""

    def __init__(self, store: Store, directory: Directory, clients: PeerClients, node_id: str, *,
                 fetch_batch: int, refresh_s: float, skip_failed_s: float, counters: dict[str, int]) -> None:
        self.store = store
        self.directory = directory
        self.clients = clients
        self.node_id = node_id
        self.fetch_batch = fetch_batch
        self.refresh_s = refresh_s
        self.skip_failed_s = skip_failed_s
        self.counters = counters
        self._members: dict[bytes, tuple[float, dict[str, tuple[str, int]]]] = {}   # ns -> (read at, view)
        self._suspects: dict[str, float] = {}     # node id -> until when it is skipped

    def fetch(self, namespace_id: bytes, hashes: Sequence[bytes], parent: bytes | None, producer: str) -> int:
        """Copy the leading ``hashes`` that member ``producer`` holds into the store; returns how
        many leading blocks were stored (0 when ``producer`` is refused, fails or holds none)."""
        member = self._member(namespace_id, producer)
        if member is None or not hashes:
            return 0
        address, epoch = member
        stored = 0
        try:
            client = self.clients.get(address, self.store, namespace_id, (producer, epoch))
            for i in range(0, len(hashes), self.fetch_batch):
                batch = list(hashes[i:i + self.fetch_batch])
                got = self._fetch_batch(client, namespace_id, batch, parent, producer)
                stored += got
                if got < len(batch):
                    break
                parent = batch[-1]
        except Exception as e:  # noqa: BLE001 - a broken member is a miss, never an error to the lookup
            self.counters["direct_unproven" if isinstance(e, PeerUnproven) else "direct_failures"] += 1
            self._suspects[producer] = time.monotonic() + self.skip_failed_s
            log.info("fleet: direct fetch from %s at %s failed: %s", producer, address, e)
        if stored:
            self.counters["direct_fetches"] += 1
            self.counters["direct_blocks"] += stored
        return stored

    def _fetch_batch(self, client, ns: bytes, batch: list[bytes], parent: bytes | None, producer: str) -> int:
        """One ``PeerChecksums`` and one get (side channel or gRPC: ``peers.grpc_client_factory``)
        of the leading blocks the member vouches for; the verified leading run stored. Returns its
        length."""
        signed = list(client.call("PeerChecksums", pb.PeerChecksumsRequest(namespace_id=ns, hashes=batch)).signed)
        sums: list[int] = []
        for h, value in zip(batch, signed):
            if not value:
                break
            if not self.directory.signer.checksum_verifies(ns, h, value):
                self.counters["direct_bad_mac"] += 1
                log.warning("fleet: %s sent a checksum for block %s that does not verify; nothing after it "
                            "is fetched", producer, h.hex())
                break
            sums.append(int.from_bytes(value[:CHECKSUM_BYTES], "little"))
        if not sums:
            self.counters["direct_misses"] += 1
            return 0
        run = verified_run(batch, stored_payloads(client, ns, batch[:len(sums)]), sums)
        if run.stop == "miss":
            self.counters["direct_misses"] += 1
        elif run.stop == "mismatch":
            self.counters["direct_checksum_mismatch"] += 1
            log.warning("fleet: block %s from %s does not match the checksum it signed; not stored",
                        batch[len(run.hashes)].hex(), producer)
        if run.hashes:
            self.store.put(ns, run.hashes, run.payloads, parent=parent, codecs=run.codecs)
        return len(run.hashes)

    def _member(self, ns: bytes, node_id) -> tuple[str, int] | None:
        """``(address, epoch)`` of ``node_id`` as a live member of namespace ``ns``; None (counted)
        when it is no node id, this node, skipped after a failure, or not a member."""
        if not well_formed_node_id(node_id):
            self.counters["direct_refused_malformed"] += 1
            return None
        if node_id == self.node_id:
            self.counters["direct_refused_self"] += 1
            return None
        if self._suspects.get(node_id, 0.0) > time.monotonic():
            self.counters["direct_skipped_failed"] += 1
            return None
        try:
            member = self._view(ns, node_id).get(node_id)
        except Exception as e:  # noqa: BLE001 - no membership (Redis down): the directory path decides
            self.counters["direct_directory_errors"] += 1
            log.debug("fleet: membership unavailable for a direct fetch: %s", e)
            return None
        if member is None:
            self.counters["direct_refused_unknown"] += 1
        return member

    def _view(self, ns: bytes, wanted: str) -> dict[str, tuple[str, int]]:
        """Node id -> (address, epoch) of the namespace's verified live members, read again once
        older than ``refresh_s``, or than ``MISS_REFRESH_S`` when it lacks ``wanted``."""
        now = time.monotonic()
        cached = self._members.get(ns)
        if cached is not None:
            age = now - cached[0]
            if age < MISS_REFRESH_S or age < self.refresh_s and wanted in cached[1]:
                return cached[1]
        view = {node_id: (address, epoch) for node_id, address, epoch in self.directory.members(ns).values()}
        if len(self._members) >= _MAX_NAMESPACES and ns not in self._members:
            self._members.clear()
        self._members[ns] = (now, view)
        return view
