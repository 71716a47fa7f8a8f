"""The daemon's lookup indexes (``transport.lookup_index``): one table per tenant, kept in step
with the store, created the first time one of the tenant's same-host clients asks for it.

With tokens configured each tenant's table holds only its own namespaces' blocks, so mapping it
tells a client nothing about another tenant's; without tokens every client may look up every
namespace anyway, and one table serves them all. Tables are bounded in number (``MAX_TABLES``): a
tenant past the bound gets no table and its lookups go over the socket.

A thread stamps every table each ``BEAT_S`` (its heartbeat), so clients stop trusting the tables of
a daemon that hangs. A new table starts ``LOADING`` (readers ask the daemon) and is filled from the
store's snapshot on a thread of its own, batch by batch under the store lock (``Store.replay``),
while live events already reach it: once filled it is exact.
"""

from __future__ import annotations

import logging
import threading

from kvstore.store import Store, StoreListener
from kvstore.transport.lookup_index import BEAT_S, LOADING, MIN_HASH_BYTES, IndexTable, key_of, keys_of, supported

log = logging.getLogger("kvstore.service.lookup_indexes")

MAX_TABLES = 64
REPLAY_BATCH = 512


class LookupIndexes(StoreListener):
    """Tables by tenant (``None``: the one table of a daemon without tokens). Store events arrive
    with the store lock held; ``self._lock`` (taken inside it, never around it) guards the tables."""

    def __init__(self, store: Store, per_tenant: bool, slots: int) -> None:
        self.store, self.per_tenant, self.slots = store, per_tenant, slots
        self.enabled = slots > 0 and supported()
        self._tables: dict[str | None, IndexTable] = {}
        self._route: dict[bytes, IndexTable | None] = {}   # namespace id -> its tenant's table
        self._lock = threading.Lock()
        self._closed = False
        self._stop = threading.Event()
        if self.enabled:
            store.subscribe(self)
            threading.Thread(target=self._beat, name="kvstore-lookup-beat", daemon=True).start()

    def _beat(self) -> None:
        while not self._stop.wait(BEAT_S):
            with self._lock:
                for table in self._tables.values():
                    table.beat()

    def descriptor_for(self, tenant: str) -> int | None:
        """A descriptor of ``tenant``'s table for one client (created on first use), or None."""
        if not self.enabled:
            return None
        owner = tenant if self.per_tenant else None
        with self._lock:
            if self._closed:
                return None
            table = self._tables.get(owner)
            if table is None:
                if len(self._tables) >= MAX_TABLES:
                    return None
                table = IndexTable(self.slots, self.store.tier_names())
                table.set_flag(LOADING, True)
                self._tables[owner] = table
                self._route.clear()
                threading.Thread(target=self._fill, args=(table,), name="kvstore-lookup-index",
                                 daemon=True).start()
            return table.descriptor()

    def _fill(self, table: IndexTable) -> None:
        try:
            for ns_id, hashes in self.store.held_blocks().items():
                with self._lock:
                    if self._table(ns_id) is not table:
                        continue
                for at in range(0, len(hashes), REPLAY_BATCH):
                    if self._closed:
                        return
                    self.store.replay(self, ns_id, hashes[at:at + REPLAY_BATCH])
            with self._lock:
                if not self._closed:
                    table.set_flag(LOADING, False)
        except Exception:  # noqa: BLE001 - the table stays LOADING: its readers ask the daemon
            log.exception("lookup index: filling the table failed")

    def _table(self, namespace_id: bytes) -> IndexTable | None:
        """The table ``namespace_id``'s blocks go to, if any. Caller holds ``self._lock``."""
        if not self._tables:
            return None
        try:
            return self._route[namespace_id]
        except KeyError:
            pass
        try:
            ns = self.store.namespace(namespace_id)
            table = self._tables.get(ns.tenant if self.per_tenant else None)
        except Exception:  # noqa: BLE001 - a namespace being dropped: nothing to index
            table = None
        self._route[namespace_id] = table
        return table

    # -- store events (store lock held; a block's "added" is followed by its "moved") -------------

    def block_moved(self, namespace_id: bytes, block_hash: bytes, fastest_tier: int) -> None:
        if len(block_hash) < MIN_HASH_BYTES:
            return
        with self._lock:
            table = self._table(namespace_id)
            if table is not None:
                table.put(key_of(namespace_id, block_hash), fastest_tier)

    def blocks_moved(self, namespace_id: bytes, block_hashes: list[bytes], fastest_tier: int) -> None:
        with self._lock:
            table = self._table(namespace_id)
            if table is not None:
                table.put_many(keys_of(namespace_id, block_hashes), fastest_tier)

    def blocks_removed(self, namespace_id: bytes, block_hashes: list[bytes]) -> None:
        with self._lock:
            table = self._table(namespace_id)
            if table is not None:
                for h in block_hashes:
                    if len(h) >= MIN_HASH_BYTES:
                        table.remove(key_of(namespace_id, h))

    def revoke(self, tenants: set[str]) -> None:
        """Close the tables of ``tenants`` (flagged CLOSED: their readers ask the daemon); the
        next client of such a tenant with a good ticket gets a new table."""
        with self._lock:
            owners = tenants if self.per_tenant else {None}
            for owner in owners & self._tables.keys():
                self._tables.pop(owner).close()
            self._route.clear()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            self._closed = True
            tables, self._tables = list(self._tables.values()), {}
            self._route.clear()
            for table in tables:
                table.close()
        if self.enabled:
            self.store.unsubscribe(self)
