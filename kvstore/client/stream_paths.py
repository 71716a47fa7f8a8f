"""Remote data paths: the raw-TCP side channel (``BulkPath``) and gRPC chunk streams (``GrpcPath``).

Both stream blocks back to back; they differ in where the bytes ride. The side channel moves them
over a plain socket into buffers the caller owns (gRPC carries only control); the chunk streams
carry them inside ~1 MiB protobuf messages, which is what a client behind a proxy can use. Gets
name the codecs this client decodes (``accept``); such blocks arrive as stored and their sinks
decode them (``delivery``).
"""

from __future__ import annotations

import concurrent.futures
import os
import time

import grpc
import numpy as np

from kvstore.client.delivery import EarlyDecode, put_results
from kvstore.client.negotiation import Negotiation
from kvstore.client.rpc_errors import error_from_rpc, is_session_error
from kvstore.errors import DaemonUnavailable, InvalidArgument, KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.transport import chunks
from kvstore.transport.bulk import BulkChannel

SLOW_LINK_BYTES_PER_S = 100e6   # deadline allowance per byte for data calls
#: decode side-channel blocks on a worker thread while the next arrive only with more cores than this
EARLY_DECODE_MIN_CORES = 3
SETTLE_S = 0.5                  # how long a broken transfer waits for its RPC to say why


def data_timeout(timeout_s: float, nbytes: int) -> float:
    """A data call's deadline: the control timeout plus time to move ``nbytes`` on a slow link."""
    return timeout_s + nbytes / SLOW_LINK_BYTES_PER_S


class BulkPath:
    """Puts and gets over the side channel; one transfer at a time per channel."""

    def __init__(self, negotiation: Negotiation) -> None:
        self.negotiation = negotiation
        self.rpc = negotiation.rpc
        self._decoder: concurrent.futures.ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._decoder is not None:
            self._decoder.shutdown(wait=True)
            self._decoder = None

    def _early_decode(self, block_bytes: int, accept) -> EarlyDecode:
        if self._decoder is None and accept and len(os.sched_getaffinity(0)) >= EARLY_DECODE_MIN_CORES:
            self._decoder = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="kvstore-decode")
        return EarlyDecode(self._decoder, block_bytes, accept)

    def _rpc_failed(self, e: grpc.RpcError):
        err = error_from_rpc(e)
        if is_session_error(err):
            self.negotiation.reset()
        return err

    def _side_channel_failed(self, fut, e: Exception) -> KVStoreError:
        """Why a transfer's session broke: the RPC's own refusal when it has one within
        ``SETTLE_S`` (a revoked token is refused, and its sessions closed, at once:
        ``Unauthenticated``), else ``DaemonUnavailable``."""
        try:
            fut.result(timeout=SETTLE_S)
        except grpc.RpcError as rpc_error:
            err = self._rpc_failed(rpc_error)
            if not isinstance(err, DaemonUnavailable):
                return err
        except Exception:  # noqa: BLE001 - not settled in time, or cancelled: the channel failed
            pass
        fut.cancel()
        return DaemonUnavailable(f"side channel failed: {e}")

    def put(self, bulk: BulkChannel, ns_id: bytes, hashes, arrays, parent, block_bytes: int,
            codec: int = 0) -> list[str]:
        """``codec``: ``arrays`` are payloads this client encoded (a block long: raw)."""
        req = pb.BulkRequest(namespace_id=ns_id, hashes=hashes, parent=parent or b"", block_bytes=block_bytes,
                             session=bulk.session, codec=codec, sizes=[a.nbytes for a in arrays] if codec else [])
        with bulk.lock:
            fut = self.rpc.future("BulkPut", req, data_timeout(self.rpc.timeout_s, sum(a.nbytes for a in arrays)))
            try:
                bulk.send_each(arrays)
                return put_results(fut.result())
            except grpc.RpcError as e:
                raise self._rpc_failed(e) from None
            except OSError as e:
                self.negotiation.reset()
                raise self._side_channel_failed(fut, e) from None

    def get(self, bulk: BulkChannel, ns_id: bytes, hashes, sinks, block_bytes: int, accept=(),
            byte_range: tuple[int, int] | None = None) -> list[int | None]:
        offset, length = byte_range or (0, 0)
        req = pb.BulkRequest(namespace_id=ns_id, hashes=hashes, block_bytes=block_bytes, session=bulk.session,
                             accept_codecs=accept, range_offset=offset, range_bytes=length)
        timeout = data_timeout(self.rpc.timeout_s, sum(s.capacity for s in sinks))
        sizes: list[int | None] = []
        early = self._early_decode(block_bytes, accept)
        try:
            with bulk.lock:
                fut = self.rpc.future("BulkGet", req, timeout)
                try:
                    bulk.wait_readable(fut, time.monotonic() + timeout)
                    size = bulk.read_size() if sinks else 0
                    last = len(sinks) - 1
                    for i, sink in enumerate(sinks):
                        if size is None:
                            fut.result()  # raises the daemon's error
                            raise DaemonUnavailable("side channel reported an error the RPC did not")
                        following = None   # the next frame's size, read with this block's bytes
                        if size:
                            buf = sink.buffer(size)
                            if i < last:
                                following = bulk.recv_into_and_size(buf)
                            else:
                                bulk.recv_into(buf)
                            early.arrived(i, sink, size)
                        elif i < last:
                            following = bulk.read_size()
                        sizes.append(size or None)
                        size = following
                    codecs = list(fut.result().codecs)
                except grpc.RpcError as e:
                    raise self._rpc_failed(e) from None
                except (OSError, TimeoutError, InvalidArgument) as e:
                    self.negotiation.reset()  # the socket is mid-frame: start a fresh one next time
                    if isinstance(e, InvalidArgument):
                        fut.cancel()
                        raise
                    raise self._side_channel_failed(fut, e) from None
        finally:
            early.settle()
        codecs += [0] * (len(sizes) - len(codecs))
        return [None if size is None else early.finish(i, sink, size, codec)
                for i, (sink, size, codec) in enumerate(zip(sinks, sizes, codecs))]


class GrpcPath:
    """Puts and gets as gRPC streams of chunks."""

    def __init__(self, negotiation: Negotiation) -> None:
        self.negotiation = negotiation
        self.rpc = negotiation.rpc

    def put(self, ns_id: bytes, hashes, arrays, parent, block_bytes: int, codec: int = 0) -> list[str]:
        """``codec``: ``arrays`` are payloads this client encoded (a block long: raw)."""
        header = pb.PutHeader(namespace_id=ns_id, hashes=hashes, parent=parent or b"", block_bytes=block_bytes,
                              codec=codec, sizes=[a.nbytes for a in arrays] if codec else [])
        chunk_bytes = self.negotiation.chunk_bytes
        resp = self.rpc.call("Put", None, data_timeout(self.rpc.timeout_s, sum(a.nbytes for a in arrays)),
                             stream_factory=lambda: chunks.put_messages(header, arrays, chunk_bytes))
        return put_results(resp)

    def get(self, ns_id: bytes, hashes, sinks, block_bytes: int, accept=(),
            byte_range: tuple[int, int] | None = None) -> list[int | None]:
        sizes: list[int | None] = [None] * len(hashes)
        offset, length = byte_range or (0, 0)
        req = pb.GetRequest(namespace_id=ns_id, hashes=hashes, block_bytes=block_bytes,
                            chunk_bytes=self.negotiation.chunk_bytes or 0, accept_codecs=accept,
                            range_offset=offset, range_bytes=length)
        stream = self.rpc.call("Get", req, data_timeout(self.rpc.timeout_s, sum(s.capacity for s in sinks)))
        landing: dict[int, np.ndarray] = {}
        try:
            for piece in stream:   # chunks.GetPiece: the data where it arrived, the rest parsed
                c = piece.chunk
                if not c.hit:
                    continue
                data = np.frombuffer(piece.data, dtype=np.uint8)
                if c.sizes:
                    self._unpack(c, data, sinks, sizes)
                    continue
                if c.index >= len(sinks):
                    raise InvalidArgument("index", f"the daemon sent block {c.index} of a {len(sinks)}-block get")
                if c.index not in landing:
                    landing[c.index] = sinks[c.index].buffer(c.size)
                dst = landing[c.index]
                end = c.offset + data.nbytes
                if end > dst.nbytes:
                    raise InvalidArgument("outs", f"chunk past the end of block {c.index}")
                dst[c.offset:end] = data
                if end >= c.size:
                    sizes[c.index] = sinks[c.index].finish(c.size, c.codec)
        except grpc.RpcError as e:
            raise self.rpc.failed(error_from_rpc(e)) from None
        except KVStoreError:
            stream.cancel()  # a refused block: stop the rest of the stream
            raise
        return sizes

    @staticmethod
    def _unpack(c, data: np.ndarray, sinks, sizes: list[int | None]) -> None:
        """A packed chunk (``c``, its ``data``): whole blocks ``c.index``, ``c.index + 1``, ...
        into their sinks."""
        n = len(c.sizes)
        if c.index + n > len(sinks):
            raise InvalidArgument("index", f"the daemon sent blocks {c.index}..{c.index + n - 1} of a "
                                           f"{len(sinks)}-block get")
        if sum(c.sizes) != data.nbytes or len(c.codecs) not in (0, n):
            raise InvalidArgument("sizes", f"a packed chunk of {data.nbytes} bytes names {n} blocks of "
                                           f"{sum(c.sizes)} bytes and {len(c.codecs)} codecs")
        at = 0
        for k, size in enumerate(c.sizes):
            i = c.index + k
            sinks[i].buffer(size)[:] = data[at:at + size]
            at += size
            sizes[i] = sinks[i].finish(size, c.codecs[k] if c.codecs else 0)
