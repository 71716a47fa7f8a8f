"""Blocks stored as they arrive: one put batch that a gRPC Put stream or a side-channel BulkPut
receives a piece at a time.

Both remote put paths store through here, so both hold the batch against its tenant's quota from
its start (``Store.quota_hold``), both refuse a client-encoded payload that is not an intact block
of the namespace by its place in the batch (``puts.check_encoded``), and both keep the blocks that
arrived before a failure, as if each had been stored on arrival.
"""

from __future__ import annotations

import contextlib

from kvstore.errors import InvalidArgument
from kvstore.service.rpc_base import PUT_RESULT, ServiceState
from kvstore.service.validation import check_hashes, check_parent
from kvstore.store.puts import check_encoded, payload_codecs


class ChainPut:
    """The put a Put stream's header or a BulkPut request asks for (namespace, hashes, parent,
    client-encoded payloads: ``puts.payload_codecs``), checked. Close it on every exit: that ends
    the quota hold."""

    def __init__(self, service: ServiceState, request, context) -> None:
        self.store = store = service.store
        self.ns = ns = service.caller_namespace(context, request.namespace_id, request.block_bytes)
        self.hashes = hashes = check_hashes(request.hashes)
        self.parent = check_parent(request.parent)
        self.codecs = payload_codecs(ns, request.codec, request.sizes, len(hashes))   # None: all raw
        #: each block's payload bytes, as the client sends them
        self.sizes = [ns.block_bytes] * len(hashes) if self.codecs is None else [int(n) for n in request.sizes]
        self.results: list[int] = []   # per block stored so far, in order
        self._hold = contextlib.ExitStack()
        self._hold.enter_context(store.quota_hold(ns.id, hashes))

    @property
    def next_parent(self) -> bytes | None:
        """The parent of the next block to store."""
        return self.hashes[len(self.results) - 1] if self.results else self.parent

    def put(self, blocks: list) -> None:
        """Store the batch's next ``blocks`` with one ``Store.put``."""
        a = len(self.results)
        for k, block in enumerate(blocks):
            if self.codecs is not None and self.codecs[a + k]:
                try:
                    check_encoded(self.ns, self.codecs[a + k], block, a + k)
                except InvalidArgument:
                    self.put(blocks[:k])
                    raise
        if blocks:
            b = a + len(blocks)
            self.stored(self.store.put(self.ns.id, self.hashes[a:b], blocks, parent=self.next_parent,
                                       codecs=None if self.codecs is None else self.codecs[a:b]))

    def stored(self, results: list[str]) -> None:
        """The results of the batch's next blocks, stored another way (arena slots the writer filled)."""
        self.results.extend(PUT_RESULT[r] for r in results)

    def close(self) -> None:
        self._hold.close()
