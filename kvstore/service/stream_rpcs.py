"""The gRPC streams that carry block bytes: Put (a client stream) and Get (a server stream).

Both are written as steps rather than loops over a blocking iterator: ``Put`` opens a
``PutSink`` that is fed one message at a time, and ``Get`` is a generator of response messages.
The call bridge (``calls.py``) receives and sends the messages on the event loop and runs each
step on a worker thread, so a client that stalls mid-stream costs no thread while it waits; the
steps of one stream may run on different threads, so a stream owns its buffers.
"""

from __future__ import annotations

import contextlib

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.proto import kvstore_pb2 as pb
from kvstore.service.block_reads import accepted_codecs, pinned_runs
from kvstore.service.rpc_base import PUT_RESULT, ServiceState
from kvstore.service.validation import check_hashes, check_parent, check_range
from kvstore.store.puts import check_encoded, payload_codecs
from kvstore.transport import chunks


def _own_buffer(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


class PutSink:
    """One Put stream on the daemon: the header checked and the batch held against the tenant's
    quota when it opens, each block stored as soon as its bytes are in, the answer at the end.
    Call ``close`` on every exit (``finish`` does): it releases the quota hold."""

    def __init__(self, service: ServiceState, first: chunks.PutPiece | None, context) -> None:
        if first is None or first.header is None:
            raise InvalidArgument("header", "the first message of a Put stream must carry the header")
        h = first.header
        self.service = service
        self.ns = service.caller_namespace(context, h.namespace_id, h.block_bytes)
        self.hashes = check_hashes(h.hashes)
        self.parent = check_parent(h.parent)
        # client-encoded payloads (codec, sizes): each is checked against the layout before it is stored
        self.codecs = payload_codecs(self.ns, h.codec, h.sizes, len(self.hashes))
        sizes = list(h.sizes) if self.codecs is not None else None
        self.expected = sum(sizes) if sizes is not None else len(self.hashes) * self.ns.block_bytes
        # gathers a block split across messages; allocated untouched, so aligned streams never fault it in
        self.splitter = chunks.BlockSplitter(self.ns.block_bytes, _own_buffer(self.ns.block_bytes), sizes)
        self.results: list[int] = []
        self.received = 0
        self._hold = contextlib.ExitStack()
        self._hold.enter_context(service.store.quota_hold(self.ns.id, self.hashes))
        self._store(first)

    def feed(self, message: chunks.PutPiece) -> None:
        if message.header is not None:
            raise InvalidArgument("header", "only the first message of a Put stream may carry a header")
        self._store(message)

    def _store(self, message: chunks.PutPiece) -> None:
        """Store the blocks this message completes: those it carries whole in one Store call,
        a block gathered across messages with the ones before it (its buffer is reused next)."""
        self.received += len(message.data)
        if self.received > self.expected:
            raise InvalidArgument("data", f"the stream carries more than the {self.expected} bytes its "
                                          f"{len(self.hashes)} blocks add up to")
        run: list[np.ndarray] = []
        for i, block, gathered in self.splitter.feed(message.data):
            if self.codecs is not None and self.codecs[i]:
                try:
                    check_encoded(self.ns, self.codecs[i], block, i)
                except InvalidArgument:
                    self._put_run(run)   # the blocks before it stay, as if each was stored on arrival
                    raise
            run.append(block)
            if gathered:
                self._put_run(run)
                run = []
        self._put_run(run)

    def _put_run(self, blocks: list[np.ndarray]) -> None:
        if not blocks:
            return
        a = len(self.results)
        b = a + len(blocks)
        results = self.service.store.put(self.ns.id, self.hashes[a:b], blocks,
                                      parent=self.parent if a == 0 else self.hashes[a - 1],
                                      codecs=None if self.codecs is None else self.codecs[a:b])
        self.results.extend(PUT_RESULT[r] for r in results)

    def finish(self) -> pb.PutResponse:
        self.close()
        if self.received < self.expected:
            raise InvalidArgument("data", f"the stream ended after {self.received} of {self.expected} bytes; "
                                          f"{len(self.results)} of {len(self.hashes)} blocks were stored")
        self.service.moved("in", "grpc", self.received)
        return pb.PutResponse(results=self.results)

    def close(self) -> None:
        self._hold.close()


class StreamRpcs:
    """The service's streams, Put and Get, for ``service``."""
    RPCS = ("Put", "Get")

    def __init__(self, service: ServiceState) -> None:
        self.service = service

    def Put(self, first, context) -> PutSink:
        """Open a Put stream with its first message (None: the stream ended before any)."""
        return PutSink(self.service, first, context)

    def Get(self, request, context):
        service = self.service
        ns = service.caller_namespace(context, request.namespace_id, request.block_bytes)
        hashes = check_hashes(request.hashes)
        chunk = request.chunk_bytes or service.chunk_bytes
        chunk = max(4096, min(chunk, service.max_message_bytes - 4096))
        accept = accepted_codecs(service.store, request.accept_codecs)
        byte_range = check_range(request.range_offset, request.range_bytes, ns.block_bytes)
        sent = first = 0
        # Chunks are copied out of the pinned arena as the client takes them, small blocks sharing
        # messages; a block whose pin ran out meanwhile ends the stream with an error (the client
        # then trusts none of it).
        with contextlib.closing(pinned_runs(service.store, ns, hashes, _own_buffer, accept, byte_range)) as runs:
            for run in runs:
                sent += sum(v.nbytes for block in run.blocks if block is not None for v in block[0])
                yield from chunks.run_messages(first, run.blocks, chunk)
                first += len(run.blocks)
                if not context.is_active():
                    return
        service.moved("out", "grpc", sent)
