"""The gRPC streams that carry block bytes: Put (a client stream) and Get (a server stream).

Both are written as steps for the call bridge (``calls.py``) rather than loops over a blocking
iterator: ``Put`` opens a ``PutSink`` that is fed one message at a time, and ``Get`` is a generator
of response messages. The steps of one stream may run on different threads, so a stream owns its
buffers.
"""

from __future__ import annotations

import contextlib

import numpy as np

from kvstore.errors import InvalidArgument
from kvstore.proto import kvstore_pb2 as pb
from kvstore.service.block_reads import asked, pinned_runs
from kvstore.service.block_writes import ChainPut
from kvstore.service.rpc_base import ServiceState
from kvstore.transport import chunks


def _own_buffer(nbytes: int) -> np.ndarray:
    return np.empty(nbytes, dtype=np.uint8)


class PutSink:
    """One Put stream on the daemon: the header checked and the batch opened (``ChainPut``) with
    the first message, each block stored as soon as its bytes are in, the answer at the end.
    Call ``close`` on every exit (``finish`` does): it releases the quota hold."""

    def __init__(self, service: ServiceState, first: chunks.PutPiece | None, context) -> None:
        if first is None or first.header is None:
            raise InvalidArgument("header", "the first message of a Put stream must carry the header")
        self.service = service
        self.chain = chain = ChainPut(service, first.header, context)
        try:
            self.expected = sum(chain.sizes)
            block_bytes = chain.ns.block_bytes
            # gathers a block split across messages; allocated untouched, so aligned streams never fault it in
            self.splitter = chunks.BlockSplitter(block_bytes, _own_buffer(block_bytes),
                                                 None if chain.codecs is None else chain.sizes)
            self.received = 0
            self._store(first)
        except BaseException:
            self.close()
            raise

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
                                          f"{len(self.chain.hashes)} blocks add up to")
        run: list[np.ndarray] = []
        for _, block, gathered in self.splitter.feed(message.data):
            run.append(block)
            if gathered:   # its buffer gathers the next block
                self.chain.put(run)
                run = []
        self.chain.put(run)

    def finish(self) -> pb.PutResponse:
        self.close()
        if self.received < self.expected:
            raise InvalidArgument("data", f"the stream ended after {self.received} of {self.expected} bytes; "
                                          f"{len(self.chain.results)} of {len(self.chain.hashes)} blocks were stored")
        self.service.metrics.moved("in", "grpc", self.received)
        return pb.PutResponse(results=self.chain.results)

    def close(self) -> None:
        self.chain.close()


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
        blocks = asked(service, request, context)
        chunk = request.chunk_bytes or service.chunk_bytes
        chunk = max(4096, min(chunk, service.max_message_bytes - 4096))
        sent = first = 0
        # copied out of the pinned arena as the client takes them, small blocks sharing messages; a
        # block whose pin ran out meanwhile ends the stream with an error (the client trusts none of it)
        with contextlib.closing(pinned_runs(service.store, blocks, _own_buffer)) as runs:
            for run in runs:
                sent += sum(v.nbytes for block in run.blocks if block is not None for v in block[0])
                yield from chunks.run_messages(first, run.blocks, chunk)
                first += len(run.blocks)
                if not context.is_active():
                    return
        service.metrics.moved("out", "grpc", sent)
