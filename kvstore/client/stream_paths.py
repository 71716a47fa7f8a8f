"""Remote data paths: the raw-TCP side channel (``BulkPath``) and gRPC chunk streams (``GrpcPath``).

Both stream blocks back to back; they differ in where the bytes ride. The side channel moves them
over a plain socket into buffers the caller owns (gRPC carries only control); the chunk streams
carry them inside ~1 MiB protobuf messages, which is what a client behind a proxy can use.
"""

from __future__ import annotations

import time

import grpc
import numpy as np

from kvstore.client.delivery import put_results, require_fit, require_raw
from kvstore.client.negotiation import Negotiation
from kvstore.client.rpc_errors import error_from_rpc, is_session_error
from kvstore.errors import DaemonUnavailable, InvalidArgument, KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.transport import chunks
from kvstore.transport.bulk import BulkChannel

SLOW_LINK_BYTES_PER_S = 100e6   # deadline allowance per byte for data calls


def data_timeout(timeout_s: float, nbytes: int) -> float:
    """A data call's deadline: the control timeout plus time to move ``nbytes`` on a slow link."""
    return timeout_s + nbytes / SLOW_LINK_BYTES_PER_S


class BulkPath:
    """Puts and gets over the side channel; one transfer at a time per channel."""

    def __init__(self, negotiation: Negotiation) -> None:
        self.negotiation = negotiation
        self.rpc = negotiation.rpc

    def _rpc_failed(self, e: grpc.RpcError):
        err = error_from_rpc(e)
        if is_session_error(err):
            self.negotiation.reset()
        return err

    def put(self, bulk: BulkChannel, ns_id: bytes, hashes, arrays, parent, block_bytes: int) -> list[str]:
        req = pb.BulkRequest(namespace_id=ns_id, hashes=hashes, parent=parent or b"", block_bytes=block_bytes,
                             session=bulk.session)
        with bulk.lock:
            fut = self.rpc.future("BulkPut", req, data_timeout(self.rpc.timeout_s, block_bytes * len(arrays)))
            try:
                for a in arrays:
                    bulk.send(a)
                return put_results(fut.result())
            except grpc.RpcError as e:
                raise self._rpc_failed(e) from None
            except OSError as e:
                fut.cancel()
                self.negotiation.reset()
                raise DaemonUnavailable(f"side channel failed: {e}") from None

    def get(self, bulk: BulkChannel, ns_id: bytes, hashes, dsts, block_bytes: int) -> list[int | None]:
        req = pb.BulkRequest(namespace_id=ns_id, hashes=hashes, block_bytes=block_bytes, session=bulk.session)
        timeout = data_timeout(self.rpc.timeout_s, sum(d.nbytes for d in dsts))
        sizes: list[int | None] = []
        with bulk.lock:
            fut = self.rpc.future("BulkGet", req, timeout)
            try:
                bulk.wait_readable(fut, time.monotonic() + timeout)
                for dst in dsts:
                    size = bulk.read_size()
                    if size is None:
                        fut.result()  # raises the daemon's error
                        raise DaemonUnavailable("side channel reported an error the RPC did not")
                    require_fit(size, dst)
                    if size:
                        bulk.recv_into(dst[:size])
                    sizes.append(size or None)
                for i, codec in enumerate(fut.result().codecs):
                    require_raw(codec, i)
            except grpc.RpcError as e:
                raise self._rpc_failed(e) from None
            except (OSError, TimeoutError, InvalidArgument) as e:
                fut.cancel()
                self.negotiation.reset()  # the socket is mid-frame: start a fresh one next time
                if isinstance(e, InvalidArgument):
                    raise
                raise DaemonUnavailable(f"side channel failed: {e}") from None
        return sizes


class GrpcPath:
    """Puts and gets as gRPC streams of chunks."""

    def __init__(self, negotiation: Negotiation) -> None:
        self.negotiation = negotiation
        self.rpc = negotiation.rpc

    def put(self, ns_id: bytes, hashes, arrays, parent, block_bytes: int) -> list[str]:
        header = pb.PutHeader(namespace_id=ns_id, hashes=hashes, parent=parent or b"", block_bytes=block_bytes)
        chunk_bytes = self.negotiation.chunk_bytes
        resp = self.rpc.call("Put", None, data_timeout(self.rpc.timeout_s, block_bytes * len(arrays)),
                             stream_factory=lambda: chunks.put_messages(header, arrays, chunk_bytes))
        return put_results(resp)

    def get(self, ns_id: bytes, hashes, dsts, block_bytes: int) -> list[int | None]:
        sizes: list[int | None] = [None] * len(hashes)
        req = pb.GetRequest(namespace_id=ns_id, hashes=hashes, block_bytes=block_bytes,
                            chunk_bytes=self.negotiation.chunk_bytes or 0)
        stream = self.rpc.call("Get", req, data_timeout(self.rpc.timeout_s, sum(d.nbytes for d in dsts)))
        try:
            for c in stream:
                if not c.hit:
                    continue
                dst = dsts[c.index]
                require_raw(c.codec, c.index)
                require_fit(c.size, dst)
                dst[c.offset:c.offset + len(c.data)] = np.frombuffer(c.data, dtype=np.uint8)
                if c.offset + len(c.data) >= c.size:
                    sizes[c.index] = c.size
        except grpc.RpcError as e:
            raise self.rpc.failed(error_from_rpc(e)) from None
        except KVStoreError:
            stream.cancel()  # a refused block: stop the rest of the stream
            raise
        return sizes
