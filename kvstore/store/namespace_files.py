"""Where registered namespaces live on disk: one small file per namespace, so registering one
writes and fsyncs a few hundred bytes instead of rewriting the whole registry.

Layout, beside the durable tier's blocks::

    <durable dir>/namespaces/            0700 (``claim_private_dir``: refused if loose or foreign)
        <namespace id hex>.json          0600, one namespace's ``to_dict()``

A file is written as ``<name>.tmp`` (``replace_file``: ``O_EXCL|O_NOFOLLOW``, so a planted symlink
is never written through), fsynced, renamed into place, and the directory fsynced: a crash
leaves the namespace registered or not, never a torn file. Loading opens each file with
``open_regular`` (a FIFO, symlink or device is skipped without being opened through or waited on)
and drops files that do not parse or whose name is not their namespace's id; both are counted.
"""

from __future__ import annotations

import json
import logging
import os

from kvstore.keys import Namespace
from kvstore.tiers.private_files import (NotRegularFile, claim_private_dir, fsync_dir, open_regular, replace_file,
                                         unlink_quietly)

log = logging.getLogger("kvstore.store.namespace_files")

DIR_NAME = "namespaces"
SUFFIX = ".json"
MAX_FILE_BYTES = 64 << 10   # a namespace is a few hundred bytes; anything bigger is not ours


class NamespaceFiles:
    """The per-namespace files under ``<directory>/namespaces``."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, DIR_NAME)
        claim_private_dir(self.path, "namespace registry")
        self.skipped_not_regular = 0   # FIFOs, symlinks, ... named like a namespace file
        self.dropped_damaged = 0       # unparseable, or not named after its namespace's id

    def file_path(self, namespace_id: bytes) -> str:
        return os.path.join(self.path, namespace_id.hex() + SUFFIX)

    def load(self) -> list[Namespace]:
        """Every namespace on disk. A ``.tmp`` file is a save a crash cut short: removed."""
        out = []
        for name in os.listdir(self.path):
            path = os.path.join(self.path, name)
            if name.endswith(".tmp"):
                unlink_quietly(path)   # that registration never completed
                continue
            if not name.endswith(SUFFIX):
                continue
            ns = self._read_one(path)
            if ns is not None and ns.id.hex() + SUFFIX != name:
                self.dropped_damaged += 1
                log.warning("namespace registry: %s does not hold the namespace it is named after; ignored", path)
                ns = None
            if ns is not None:
                out.append(ns)
        return out

    def save(self, ns: Namespace) -> None:
        """Persist one namespace durably (OSError on failure, nothing left behind)."""
        replace_file(self.file_path(ns.id), lambda fd: os.write(fd, json.dumps(ns.to_dict(), sort_keys=True).encode()))
        fsync_dir(self.path)

    def remove(self, namespace_id: bytes) -> None:
        """Forget one namespace durably (``kvstore ns drop``); absent is fine."""
        try:
            os.unlink(self.file_path(namespace_id))
        except FileNotFoundError:
            return
        fsync_dir(self.path)

    def _read_one(self, path: str) -> Namespace | None:
        data = self._read_regular(path)
        if data is None:
            return None
        try:
            return Namespace.from_dict(json.loads(data))
        except (ValueError, KeyError, TypeError):
            self.dropped_damaged += 1
            log.warning("namespace registry: %s is damaged; ignored", path)
            return None

    def _read_regular(self, path: str) -> bytes | None:
        """The bytes of a regular file, or None (counted) for anything else or one over ``MAX_FILE_BYTES``."""
        try:
            fd = open_regular(path)
        except NotRegularFile as e:
            self.skipped_not_regular += 1
            log.warning("namespace registry: skipped %s: it is a %s, not a regular file", path, e.kind)
            return None
        except FileNotFoundError:
            return None
        try:
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        except OSError:
            self.dropped_damaged += 1
            return None
        if len(data) > MAX_FILE_BYTES:
            self.dropped_damaged += 1
            return None
        return data
