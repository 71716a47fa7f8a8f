"""The side channel's control RPCs: BulkGet and BulkPut, whose bytes ride a raw TCP session.

Each RPC is an ordinary authenticated, validated call naming a session of
``kvstore.transport.bulk``; its body runs on one worker thread from start to end, moving the
payload over that session's socket. A transfer that stalls is cut by the stall watch, which drops
the session (waking the thread blocked on the socket) and ends the call.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable

from kvstore.errors import InvalidArgument, StoreFull
from kvstore.proto import kvstore_pb2 as pb
from kvstore.service.block_reads import asked, pinned_runs
from kvstore.service.block_writes import ChainPut
from kvstore.service.rpc_base import ServiceState
from kvstore.transport import bulk as bulk_transport
from kvstore.wire import MAX_BATCH


#: a BulkPut stores small blocks a run at a time (into reserved arena slots, or one Store.put), so
#: the per-call work and lock rounds are shared among a run's blocks and a transfer cut short keeps
#: the runs that arrived whole; past 4 MiB a run saves no more CPU a block
RUN_BYTES = 4 << 20


def put_runs(sizes: list[int]) -> list[tuple[int, int]]:
    """``(start, stop)`` runs of consecutive blocks of at most ``RUN_BYTES`` each (a larger block
    alone)."""
    runs, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > RUN_BYTES:
            runs.append((start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        runs.append((start, len(sizes)))
    return runs


class BulkRpcs:
    """The side channel's control RPCs, for ``service`` (whose ``bulk`` server holds the sessions)."""
    RPCS = ("BulkGet", "BulkPut")

    def __init__(self, service: ServiceState) -> None:
        self.service = service
        self.store = service.store

    def _session(self, sid: bytes, context):
        """The caller's open session ``sid`` (another tenant's is answered like an unknown one)."""
        bulk = self.service.bulk
        session = bulk.session(sid, self.service.tenant_of(context)) if bulk is not None else None
        if session is None:
            raise InvalidArgument("session", "unknown side-channel session; reconnect or use the gRPC stream")
        return session

    @contextlib.contextmanager
    def _transfer(self, context, sid: bytes, session, on_failure: Callable):
        """The session's socket for one transfer, watched: a stalled transfer drops the session. A
        failed transfer runs ``on_failure(sock)`` to leave the socket in step for the next one;
        where the socket itself failed, the session is dropped."""
        bulk = self.service.bulk
        with self.service.stalls.watch(context.cancel, on_stall=lambda: bulk.drop(sid)) as progress, \
                bulk.using(session) as sock:
            try:
                yield progress, sock
            except OSError as e:
                bulk.drop(sid)
                raise InvalidArgument("session", f"side channel failed: {e}") from e
            except Exception:
                try:
                    on_failure(sock)
                except OSError:
                    bulk.drop(sid)
                raise

    def BulkGet(self, request, context):
        sid = bytes(request.session)
        session = self._session(sid, context)
        sizes, codecs = [], []
        with self._transfer(context, sid, session, bulk_transport.send_error) as (progress, sock):
            runs = pinned_runs(self.store, asked(self.service, request, context), self.service.scratch.get)
            with contextlib.closing(runs):  # unpin on any exit
                for run in progress.working_through(runs):   # staging from disk is ours
                    blocks = [(None, 0) if block is None else block for block in run.blocks]
                    sizes += bulk_transport.send_blocks(sock, [pieces for pieces, _ in blocks], progress.touch)
                    codecs += [codec for _, codec in blocks]
        self.service.metrics.moved("out", "bulk", sum(sizes))
        return pb.BulkGetResponse(sizes=sizes, codecs=codecs)

    def BulkPut(self, request, context):
        sid = bytes(request.session)
        session = self._session(sid, context)
        # What the client committed to send: its own idea of the block size times the count.
        if len(request.hashes) > MAX_BATCH or request.block_bytes > self.store.largest_block_bytes + (1 << 30):
            self.service.bulk.drop(sid)  # cannot drain an absurd amount: cut the channel
            raise InvalidArgument("block_bytes" if len(request.hashes) <= MAX_BATCH else "hashes",
                                  "request too large for the side channel")
        if request.codec and (len(request.sizes) != len(request.hashes)
                              or any(size > request.block_bytes for size in request.sizes)):
            self.service.bulk.drop(sid)  # what it sends cannot be told from these sizes: cut the channel
            raise InvalidArgument("sizes", f"{len(request.sizes)} payload sizes for {len(request.hashes)} blocks, "
                                           f"each at most block_bytes ({request.block_bytes}), are required "
                                           "with a codec")
        # client-encoded payloads: the socket carries their sizes' sum
        committed = sum(request.sizes) if request.codec else len(request.hashes) * request.block_bytes
        received = 0

        def drain(sock) -> None:   # what the client still sends of a refused put
            bulk_transport.drain(sock, committed - received, self.service.scratch.get(1 << 20))

        with self._transfer(context, sid, session, drain) as (progress, sock):
            if not request.block_bytes:
                raise InvalidArgument("block_bytes", "required on the side channel")
            with progress.working():   # the first use of a codec loads it
                chain = ChainPut(self.service, request, context)
            ns, hashes, sizes = chain.ns, chain.hashes, chain.sizes

            def receive(a: int, b: int) -> None:   # blocks a..b into the scratch buffer, then stored
                nonlocal received
                run_bytes = sum(sizes[a:b])   # received a run at a time; the stall watch sees each read
                buf = self.service.scratch.get(run_bytes)
                bulk_transport.recv_exact_into(sock, memoryview(buf[:run_bytes]), progress.touch)
                received += run_bytes
                payloads = [buf[at:at + n] for at, n in zip(itertools.accumulate(sizes[a:b], initial=0), sizes[a:b])]
                with progress.working():   # the daemon's time, not the caller's stall
                    chain.put(payloads)

            def receive_into_arena(a: int, b: int) -> bool:
                """Raw blocks a..b straight into CPU-arena slots reserved for them (no second
                copy), published together; False, nothing received, when the arena cannot
                take them without a slower tier (``receive`` then stores them as a put would)."""
                nonlocal received
                try:
                    with progress.working():
                        lease = self.store.leases.reserve_store(ns.id, hashes[a:b], chain.next_parent)
                except StoreFull:
                    return False
                try:
                    views = []
                    for extents in lease.extents:   # None: present already, its bytes read and dropped
                        views += (arena.views(extents) if extents is not None
                                  else [self.service.scratch.get(ns.block_bytes)[:ns.block_bytes]])
                    bulk_transport.recv_exact_into_each(sock, views, progress.touch)
                    received += (b - a) * ns.block_bytes
                except BaseException:
                    self.store.leases.cancel_store(lease)
                    raise
                with progress.working():
                    chain.stored(self.store.leases.finish_store(lease))
                return True

            with contextlib.closing(chain):
                arena = self.store.shared_arena() if chain.codecs is None and self.store.cpu_index == 0 else None
                for a, b in put_runs(sizes):
                    if arena is None or not receive_into_arena(a, b):
                        receive(a, b)
        self.service.metrics.moved("in", "bulk", received)
        return pb.PutResponse(results=chain.results)
