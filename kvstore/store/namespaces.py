"""The namespace registry: which layouts this store serves, persisted as ``namespaces.json`` beside
the durable tier so a restarted daemon still knows the namespaces of the blocks it recovers.

The file is replaced atomically (write, fsync, rename, fsync the directory): a crash leaves the
old registry or the new one, never a torn file. Without a durable tier the registry lives in RAM.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

from kvstore.errors import InvalidArgument, TierIOError, UnknownNamespace
from kvstore.keys import Namespace, check_block_hash
from kvstore.wire import MAX_BATCH

FILE_NAME = "namespaces.json"


class NamespaceRegistry:
    def __init__(self, directory: str | None) -> None:
        """``directory``: the durable tier's, or None for a registry that is not persisted."""
        self.path = os.path.join(directory, FILE_NAME) if directory is not None else None
        self._namespaces: dict[bytes, Namespace] = {}
        if self.path and os.path.exists(self.path):
            with open(self.path) as f:
                for d in json.load(f):
                    ns = Namespace.from_dict(d)
                    self._namespaces[ns.id] = ns

    def add(self, ns: Namespace) -> None:
        """Register ``ns`` (idempotent) and persist the registry; on failure nothing changes and
        ``TierIOError`` is raised. Caller holds the store lock."""
        if ns.id in self._namespaces:
            return
        self._namespaces[ns.id] = ns
        try:
            self._save()
        except OSError as e:
            del self._namespaces[ns.id]
            raise TierIOError(f"cannot persist namespace registry: {e.strerror}") from e

    def get(self, namespace_id: bytes) -> Namespace:
        try:
            return self._namespaces[namespace_id]
        except KeyError:
            raise UnknownNamespace(namespace_id) from None

    def find(self, namespace_id: bytes) -> Namespace | None:
        return self._namespaces.get(namespace_id)

    def all(self) -> list[Namespace]:
        return list(self._namespaces.values())

    def __len__(self) -> int:
        return len(self._namespaces)

    def check_batch(self, namespace_id: bytes, hashes: Sequence[bytes]) -> Namespace:
        """The namespace a request names, after checking its batch of hashes."""
        ns = self.get(namespace_id)
        if len(hashes) > MAX_BATCH:
            raise InvalidArgument("hashes", f"{len(hashes)} blocks in one call; at most {MAX_BATCH}")
        for h in hashes:
            check_block_hash(h)
        return ns

    def _save(self) -> None:
        if not self.path:
            return
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump([ns.to_dict() for ns in self._namespaces.values()], f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(tmp, self.path)
        dfd = os.open(os.path.dirname(self.path), os.O_RDONLY)  # the rename itself must survive a crash
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
