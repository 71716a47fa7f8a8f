"""The namespace registry: which layouts this store serves, persisted one file per namespace beside
the durable tier (``namespace_files``) so a restarted daemon still knows the namespaces of the
blocks it recovers. Without a durable tier the registry lives in RAM.

Registering is serialised by the registry's own lock, never the store's: the fsync of a new
namespace's file must not stall other tenants' gets. Readers (``get``, ``check_batch``) take no
lock at all; a namespace becomes visible to them only once its file is durable.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Sequence

from kvstore.errors import InvalidArgument, QuotaExceeded, TierIOError, UnknownNamespace
from kvstore.keys import MAX_HASH_BYTES, Namespace, check_block_hash
from kvstore.store.namespace_files import NamespaceFiles
from kvstore.wire import MAX_BATCH

_HASH_TYPES = {bytes, bytearray}   # what check_block_hash takes


class NamespaceRegistry:
    def __init__(self, directory: str | None, max_per_tenant: int | None = None) -> None:
        """``directory``: the durable tier's, or None for a registry that is not persisted.
        ``max_per_tenant``: how many namespaces one tenant may register (None: unbounded)."""
        self.files = NamespaceFiles(directory) if directory is not None else None
        self.max_per_tenant = max_per_tenant
        self._namespaces: dict[bytes, Namespace] = {}
        self._per_tenant: Counter[str] = Counter()
        self._register_lock = threading.Lock()
        for ns in self.files.load() if self.files is not None else ():
            self._insert(ns)

    def add(self, ns: Namespace) -> None:
        """Register ``ns`` (idempotent) and persist it; on failure nothing changes and
        ``TierIOError`` is raised. A tenant at ``max_per_tenant`` gets ``QuotaExceeded``."""
        if ns.id in self._namespaces:
            return
        with self._register_lock:
            if ns.id in self._namespaces:
                return
            if self.max_per_tenant is not None and self._per_tenant[ns.tenant] >= self.max_per_tenant:
                raise QuotaExceeded(f"namespaces: this tenant already has {self.max_per_tenant} namespaces, the "
                                    "most one tenant may register (max_namespaces_per_tenant)", field="namespaces")
            if self.files is not None:
                try:
                    self.files.save(ns)
                except OSError as e:
                    raise TierIOError(f"cannot persist namespace registry: {e.strerror or e}") from e
            self._insert(ns)

    def remove(self, namespace_id: bytes) -> Namespace | None:
        """Unregister a namespace and delete its file (``kvstore ns drop``); its blocks are the
        caller's to drop. Returns what was removed (None: it was not registered)."""
        with self._register_lock:
            ns = self._namespaces.get(namespace_id)
            if ns is None:
                return None
            if self.files is not None:  # the file first: a failure leaves memory and disk agreeing
                try:
                    self.files.remove(namespace_id)
                except OSError as e:
                    raise TierIOError(f"cannot remove namespace {namespace_id.hex()} from the registry: "
                                      f"{e.strerror or e}") from e
            del self._namespaces[namespace_id]
            self._per_tenant[ns.tenant] -= 1
            return ns

    def _insert(self, ns: Namespace) -> None:
        self._namespaces[ns.id] = ns
        self._per_tenant[ns.tenant] += 1

    def get(self, namespace_id: bytes) -> Namespace:
        try:
            return self._namespaces[namespace_id]
        except KeyError:
            raise UnknownNamespace(namespace_id) from None

    def find(self, namespace_id: bytes) -> Namespace | None:
        return self._namespaces.get(namespace_id)

    def all(self) -> list[Namespace]:
        return list(self._namespaces.values())

    def of_tenant(self, tenant: str) -> list[Namespace]:
        return [ns for ns in list(self._namespaces.values()) if ns.tenant == tenant]

    def __len__(self) -> int:
        return len(self._namespaces)

    def stats(self) -> dict[str, int]:
        files = self.files
        return {"namespace_files_skipped_not_regular": files.skipped_not_regular if files else 0,
                "namespace_files_dropped_damaged": files.dropped_damaged if files else 0}

    def check_batch(self, namespace_id: bytes, hashes: Sequence[bytes]) -> Namespace:
        """The namespace a request names, after checking its batch of hashes."""
        ns = self.get(namespace_id)
        if len(hashes) > MAX_BATCH:
            raise InvalidArgument("hashes", f"{len(hashes)} blocks in one call; at most {MAX_BATCH}")
        # the whole batch at C speed (types, then the shortest and longest); one by one only to
        # name what is wrong
        if hashes and not (set(map(type, hashes)) <= _HASH_TYPES
                           and min(map(len, hashes)) >= 1 and max(map(len, hashes)) <= MAX_HASH_BYTES):
            for h in hashes:
                check_block_hash(h)
        return ns
