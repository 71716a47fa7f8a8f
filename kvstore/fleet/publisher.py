"""Mirroring the Store into the directory: a StoreListener plus one background thread.

The Store calls ``blocks_added`` / ``blocks_removed`` with its lock held, so the listener only
appends to a queue. The thread drains it: it pins each new block just long enough to checksum its
payload as stored — encoded when a tier codec encoded it, which is what the node serves to a peer
(zero-copy for the CPU arena, the recorded checksum for NVMe) — keeps a local mirror of what it
published, and sends the delta in batched Lua calls. If Redis fails or comes back empty (restart,
failover, flush), the node joins again under a fresh slot and republishes its mirror; the daemon
keeps serving locally meanwhile (``connected`` is False until Redis answers again).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Sequence

from kvstore.buffers import SCRATCH_KEEP_BYTES, Scratch
from redis.exceptions import ResponseError

from kvstore.fleet.checksums import payload_checksum
from kvstore.fleet.directory import Directory, DirectoryFull
from kvstore.fleet.records import pack_entry
from kvstore.store import Store, StoreListener

log = logging.getLogger("kvstore.fleet")

BROKEN_BACKOFF_MAX_S = 30.0   # the longest a broken namespace waits between repairs
_COALESCE_BELOW = 256   # queued events under which the thread waits flush_interval_s for more


class Publisher(StoreListener):
    """Keeps this node's entries in the directory equal to what its Store holds."""

    def __init__(self, store: Store, directory: Directory, node_id: str, advertise_addr: str, *,
                 heartbeat_s: float, ttl_s: float, flush_interval_s: float, sweep_every: int,
                 counters: dict[str, int], epoch: int = 0) -> None:
        self.store = store
        self.directory = directory
        self.node_id = node_id
        self.epoch = epoch   # this run of the node: signed into every entry, revoked on leave
        self.advertise_addr = advertise_addr
        self.heartbeat_s = heartbeat_s
        self.ttl_s = ttl_s
        self.flush_interval_s = flush_interval_s
        self.sweep_every = sweep_every
        self.counters = counters
        self.mirror: dict[bytes, dict[bytes, bytes]] = {}   # ns -> hash -> pack_entry: what we publish
        self.slots: dict[bytes, int] = {}                   # ns -> our slot in its directory
        # ns -> (when to try again, back-off s) for namespaces whose keys broke our commands
        self.broken: dict[bytes, tuple[float, float]] = {}
        self.connected = True   # until the thread fails to reach Redis
        self._events: collections.deque = collections.deque()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Event()
        self._resync = True                                 # (re)join and publish the whole mirror
        self._thread: threading.Thread | None = None
        self._scratch = Scratch(trim_above=SCRATCH_KEEP_BYTES)   # copies of blocks outside the arena

    # -- StoreListener (called with the store lock held: enqueue only) ---------------------------

    def blocks_added(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        self._events.append((True, namespace_id, list(block_hashes)))
        self._idle.clear()
        self._wake.set()

    def blocks_removed(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        self._events.append((False, namespace_id, list(block_hashes)))
        self._idle.clear()
        self._wake.set()

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        for ns, hashes in self.store.subscribe(self).items():
            self._events.append((True, ns, hashes))  # events that race this are re-checked on drain
        self._thread = threading.Thread(target=self._run, name="kvstore-fleet", daemon=True)
        self._thread.start()
        self._wake.set()

    def stop(self, unpublish: bool) -> None:
        """Stop the thread; with ``unpublish`` also withdraw this node's entries and revoke this
        run's epoch (an entry of it written back to the directory is then refused)."""
        self.store.unsubscribe(self)
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        if unpublish:
            try:
                for ns, slot in self.slots.items():
                    self.directory.leave(ns, slot, list(self.mirror.get(ns, ())), self.node_id, self.epoch,
                                         self.ttl_s)
            except Exception as e:  # noqa: BLE001 - Redis down at shutdown: the slot expires anyway
                log.info("fleet: could not withdraw entries at close (%s); they expire in %ss", e, self.ttl_s)

    def wait_published(self, timeout_s: float = 10.0) -> bool:
        """Block until every store event so far is in Redis (tests, graceful drains)."""
        self._wake.set()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self._idle.wait(timeout=0.05) and not self._events and not self._resync:
                return True
        return False

    # -- the background thread -------------------------------------------------------------------

    def _run(self) -> None:
        next_beat = 0.0
        backoff = 0.05
        while not self._stop.is_set():
            now = time.monotonic()
            self._wake.wait(timeout=max(0.0, min(next_beat - now, 1.0)))
            if self._stop.is_set():
                break
            if self._wake.is_set() and len(self._events) < _COALESCE_BELOW:
                time.sleep(self.flush_interval_s)  # let a burst coalesce into one pipeline
            self._wake.clear()
            delta = self._drain()
            try:
                if self._resync:
                    self._republish()
                elif delta:
                    self._push(delta)
                if time.monotonic() >= next_beat:
                    self._heartbeat()
                    next_beat = time.monotonic() + self.heartbeat_s
                self.connected = True
                backoff = 0.05
                if not self._events:
                    self._idle.set()
            except Exception as e:  # noqa: BLE001 - Redis down: keep serving, republish later
                if self.connected or self.counters["redis_errors"] == 0:
                    log.warning("fleet: directory unreachable (%s); serving locally, will republish", e)
                self.connected = False
                self._resync = True
                self.counters["redis_errors"] += 1
                self._stop.wait(backoff)
                backoff = min(backoff * 2, self.heartbeat_s)
                self._wake.set()

    def _drain(self) -> dict[bytes, dict[bytes, bytes | None]]:
        """Apply queued store events to the mirror; return what changed (None = withdrawn)."""
        delta: dict[bytes, dict[bytes, bytes | None]] = collections.defaultdict(dict)
        while self._events:
            added, ns, hashes = self._events.popleft()
            mine = self.mirror.setdefault(ns, {})
            for h in hashes:
                value = self._describe(ns, h) if added else None
                if value is None:
                    if mine.pop(h, None) is not None or not added:
                        delta[ns][h] = None
                else:
                    mine[h] = value
                    delta[ns][h] = value
        return delta

    def _describe(self, ns: bytes, h: bytes) -> bytes | None:
        """Checksum and tier of a block, read under a short pin; None if it is already gone."""
        with self.store.pinned(ns, h) as block:
            if block is None:
                return None
            try:
                checksum = payload_checksum(block, self._scratch.get)
                self.counters["checksummed"] += 1
                return pack_entry(checksum, block.tier)
            except Exception as e:  # noqa: BLE001 - a block we cannot read is not advertised
                self.counters["describe_failures"] += 1
                log.debug("fleet: cannot checksum block %s: %s", h.hex(), e)
                return None

    def _join(self, ns: bytes) -> int:
        slot = self.directory.join(ns, self.node_id, self.advertise_addr, self.ttl_s, self.epoch)
        self.slots[ns] = slot
        self.counters["joins"] += 1
        return slot

    def _push(self, delta: dict[bytes, dict[bytes, bytes | None]]) -> None:
        for ns, changes in delta.items():
            if ns in self.broken:
                continue   # republished whole once repaired
            try:
                slot = self.slots.get(ns)
                if slot is None:
                    slot = self._join(ns)
                self.counters["checksum_conflicts"] += self.directory.publish(ns, slot, changes)
            except (ResponseError, DirectoryFull) as e:
                self._namespace_broke(ns, e)
                continue
            self.counters["published"] += sum(1 for v in changes.values() if v is not None)
            self.counters["withdrawn"] += sum(1 for v in changes.values() if v is None)
        self.counters["pushes"] += 1

    def _namespace_broke(self, ns: bytes, error: Exception) -> None:
        """One namespace's keys refused our commands (a key of the wrong type, every slot taken by
        entries that do not verify): that namespace alone leaves the directory until the janitor
        has repaired it (``_retry_broken``); fleet mode stays on for every other namespace."""
        self.counters["namespace_errors"] += 1
        self.slots.pop(ns, None)
        _, backoff = self.broken.get(ns, (0.0, 0.0))
        backoff = min(max(2 * backoff, self.heartbeat_s), BROKEN_BACKOFF_MAX_S)
        if ns not in self.broken:
            log.warning("fleet: namespace %s left the directory (%s); repairing its keys", ns.hex(),
                        type(error).__name__)
        self.broken[ns] = (time.monotonic() + backoff, backoff)

    def _retry_broken(self) -> None:
        """The janitor for the namespaces that broke: repair their keys and publish them again."""
        now = time.monotonic()
        for ns in [ns for ns, (at, _) in self.broken.items() if at <= now]:
            try:
                self.directory.repair(ns)
                self._republish([ns], repaired=True)
            except (ResponseError, DirectoryFull) as e:
                self._namespace_broke(ns, e)
                continue
            del self.broken[ns]
            self.counters["namespaces_repaired"] += 1
            log.info("fleet: namespace %s is back in the directory", ns.hex())

    def _republish(self, namespaces: Sequence[bytes] | None = None, repaired: bool = False) -> None:
        """Join under a fresh slot and publish the whole mirror (first start, Redis restarted or
        unreachable for a while: what Redis holds for the old slot may be stale or gone)."""
        for ns in list(self.mirror) if namespaces is None else namespaces:
            if ns in self.broken and not repaired:
                continue
            try:
                slot = self._join(ns)
                self.counters["checksum_conflicts"] += self.directory.publish(ns, slot, dict(self.mirror[ns]))
            except (ResponseError, DirectoryFull) as e:
                if repaired:
                    raise
                self._namespace_broke(ns, e)
        self._resync = False
        self.counters["republishes"] += 1

    def _heartbeat(self) -> None:
        """Refresh our slots; a slot that vanished (Redis restarted, flushed, or we were presumed
        dead) means joining again and republishing. Every ``sweep_every`` beats, sweep dead slots."""
        beats = list(self.slots.items())
        if not beats:
            self.directory.redis.ping()   # nothing published yet: still notice a dead Redis
            self._retry_broken()
            return
        alive = self.directory.heartbeat(beats, self.node_id, self.advertise_addr, self.ttl_s, self.epoch)
        for (ns, _), ok in zip(beats, alive):
            if isinstance(ok, ResponseError):
                self._namespace_broke(ns, ok)
        lost = [ns for (ns, _), ok in zip(beats, alive) if ok is False]
        if lost:
            self.counters["slots_lost"] += len(lost)
            log.info("fleet: directory lost our entries for %d namespace(s); republishing", len(lost))
            self._republish(lost)
        self.counters["heartbeats"] += 1
        self._retry_broken()
        if self.counters["heartbeats"] % self.sweep_every == 0:
            for ns, _ in beats:
                if ns in self.slots:
                    try:
                        self.counters["swept_entries"] += self.directory.sweep(ns, grace_s=self.ttl_s)
                    except ResponseError as e:
                        self._namespace_broke(ns, e)
