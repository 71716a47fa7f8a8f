"""Where the blocks of a get land, and what every data path (shm, side channel, gRPC) checks.

A data path asks a block's sink for a host buffer to receive its ``size`` payload bytes
(``buffer``), then hands it back once the bytes are in and their codec id is known (``finish``).

* ``IntoBuffer`` fills the caller's destination. A raw block lands in it directly (host memory)
  or through a staging buffer (a torch tensor on a device). A block the daemon sent as stored
  (the client asked for it: ``accept_codecs``) lands in a scratch buffer and is decoded into the
  destination on the destination's device by ``kvstore.codecs.decode_block``, so only the
  compressed bytes cross the wire and, for a GPU tensor, the PCIe bus.
* ``KeepPayload`` keeps the payload as it came, with its codec id (a fleet peer stores it so).

Raw blocks are exactly a block long; an encoded payload is shorter, so a path that learns the
codec only at the end (the side channel) can still tell where to put the bytes from their size.
Payloads that cannot land in the destination itself land in a ``LandingPool`` buffer, reused
call after call: fresh memory costs a page fault per 4 KiB, slower here than the decode.
"""

from __future__ import annotations

import concurrent.futures
import threading

import numpy as np

from kvstore.buffers import writable_bytes
from kvstore.errors import CodecError, InvalidArgument
from kvstore.keys import KVLayout
from kvstore.proto import kvstore_pb2 as pb
from kvstore.wire import RAW_CODEC

_U8 = np.dtype(np.uint8)
_PUT_RESULT = {pb.PUT_STORED: "stored", pb.PUT_EXISTS: "exists", pb.PUT_PERSISTED: "persisted"}


def put_results(resp) -> list[str]:
    """Per block "stored", "exists" or "persisted", from any put answer."""
    return [_PUT_RESULT[r] for r in resp.results]


def _on_device(out) -> bool:
    return type(out).__module__.startswith("torch") and out.device.type != "cpu"


class LandingPool:
    """Host buffers that payloads land in before they are decoded or staged to a device, one per
    block of a call (every payload of a side-channel batch is in before its codecs are known),
    kept per thread and reused by the next call, up to ``keep_bytes`` per thread."""

    def __init__(self, keep_bytes: int = 128 << 20) -> None:
        self.keep_bytes = keep_bytes
        self._local = threading.local()

    def get(self, slot: int, size: int) -> np.ndarray:
        """Buffer ``slot`` of this thread's current call, at least ``size`` bytes."""
        kept: dict[int, np.ndarray] | None = getattr(self._local, "kept", None)
        if kept is None:
            kept = self._local.kept = {}
        buf = kept.get(slot)
        if buf is not None and buf.nbytes >= size:
            return buf[:size]
        buf = np.empty(size, dtype=np.uint8)
        held = sum(b.nbytes for s, b in kept.items() if s != slot)
        if held + size <= self.keep_bytes:
            kept[slot] = buf
        return buf


class IntoBuffer:
    """One caller buffer a get fills (``get_into``'s ``outs[i]``); ``pool`` lends the landing
    buffer of block ``index`` when the payload cannot land in the destination itself."""

    __slots__ = ("block_bytes", "layout", "index", "pool", "device_out", "host", "capacity", "_landing")

    def __init__(self, out, index: int, block_bytes: int, layout: KVLayout | None, pool: LandingPool) -> None:
        self.block_bytes = block_bytes
        self.layout = layout
        self.index = index
        self.pool = pool
        self.device_out = None
        self._landing: np.ndarray | None = None
        if type(out) is np.ndarray and out.dtype is _U8 and out.ndim == 1:   # the usual destination: one
            flags = out.flags                                                 # check, no copy, no view
            if flags.c_contiguous and flags.writeable and out.nbytes >= block_bytes:
                self.host = out
                self.capacity = out.nbytes
                return
        if type(out) is not np.ndarray and _on_device(out):
            import torch
            if not block_bytes or not out.is_contiguous():
                raise InvalidArgument(f"outs[{index}]", "a device tensor needs a registered namespace "
                                                        "and must be contiguous")
            self.device_out = out.reshape(-1).view(torch.uint8)
            nbytes = self.device_out.numel()
            self.host = None
        else:
            self.host = writable_bytes(out, f"outs[{index}]")
            nbytes = self.host.nbytes
        if block_bytes and nbytes < block_bytes:
            raise InvalidArgument(f"outs[{index}]", f"buffer of {nbytes} bytes; blocks are {block_bytes} bytes")
        self.capacity = nbytes      # the most bytes this block may bring (deadlines scale with it)

    def raw_destination(self, size: int) -> np.ndarray | None:
        """Where a raw block of ``size`` bytes lands when it lands in the caller's host buffer
        itself (nothing to stage or decode, so ``finish`` has nothing to do); else None."""
        host = self.host
        if host is not None and size == self.block_bytes and size <= host.nbytes:
            return host if size == host.nbytes else host[:size]
        return None

    def buffer(self, size: int) -> np.ndarray:
        """Host bytes to receive a ``size``-byte payload into."""
        if self.host is not None and (size == self.block_bytes or not self.block_bytes):
            if size > self.host.nbytes:
                raise InvalidArgument("outs", f"block of {size} bytes does not fit a {self.host.nbytes}-byte buffer")
            self._landing = self.host[:size]
        elif size > self.block_bytes:
            raise InvalidArgument("outs", f"block of {size} bytes does not fit a {self.block_bytes}-byte block")
        else:
            self._landing = self.pool.get(self.index, size)
        return self._landing

    def finish(self, size: int, codec: int) -> int:
        """The payload is in: put the block where the caller wants it; returns its size."""
        payload = self._landing
        if codec == RAW_CODEC:
            if self.block_bytes and size != self.block_bytes:
                raise CodecError(f"codec: raw block {self.index} arrived with {size} bytes; blocks are "
                                 f"{self.block_bytes}")
            if self.device_out is not None:
                import torch
                self.device_out[:size].copy_(torch.from_numpy(payload))
            return size
        if self.layout is None:
            raise CodecError(f"codec: block {self.index} arrived encoded (codec {codec}) for a namespace this "
                             "client did not register")
        from kvstore import codecs
        dst = self.device_out if self.device_out is not None else self.host
        codecs.decode_block(codec, payload, self.layout, out=dst[:self.block_bytes])
        return self.block_bytes


class EarlyDecode:
    """Decoding each block on a worker thread while the next one arrives, for the side channel,
    whose answer names the codecs only once every payload is in. A payload shorter than a block is
    taken to be encoded with the one codec this client accepted (with several, decoding waits for
    the answer); the guess is checked against the answer, and ``decode_block`` itself refuses a
    payload whose header names another codec. Without an ``executor`` (no core to spare: on two
    cores the receive and a same-host daemon's send take both, and measured, overlapping the
    decode there made gets ~5 % slower) every block is decoded once the answer is in."""

    def __init__(self, executor: concurrent.futures.Executor | None, block_bytes: int, accept) -> None:
        self.executor = executor
        self.block_bytes = block_bytes
        self.guess = accept[0] if len(accept) == 1 and executor is not None else None
        self._pending: dict[int, tuple[int, concurrent.futures.Future]] = {}

    def arrived(self, index: int, sink, size: int) -> None:
        if self.guess is not None and 0 < size < self.block_bytes:
            self._pending[index] = (self.guess, self.executor.submit(sink.finish, size, self.guess))

    def settle(self) -> None:
        """Wait until no decode is running (they write into the caller's buffers)."""
        concurrent.futures.wait([f for _, f in self._pending.values()])

    def finish(self, index: int, sink, size: int, codec: int) -> int:
        if index not in self._pending:
            return sink.finish(size, codec)
        guessed, done = self._pending[index]
        if guessed != codec:
            raise CodecError(f"codec: block {index} was decoded as codec {guessed}; the daemon says {codec}")
        return done.result()


class KeepPayload:
    """A block kept as the daemon sent it: ``codec`` and ``payload`` (stored bytes) once finished."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.capacity = block_bytes
        self.codec = RAW_CODEC
        self.payload: np.ndarray | None = None

    def buffer(self, size: int) -> np.ndarray:
        if self.block_bytes and size > self.block_bytes:
            raise InvalidArgument("outs", f"block of {size} bytes does not fit a {self.block_bytes}-byte block")
        self.payload = np.empty(size, dtype=np.uint8)
        return self.payload

    def finish(self, size: int, codec: int) -> int:
        self.codec = codec
        return size
