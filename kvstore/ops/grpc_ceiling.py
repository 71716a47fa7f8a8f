"""The gRPC fallback's own ceiling: what grpcio itself moves here, with no work at either end.

kvstore's gRPC streams are judged against raw TCP, but they cannot beat the library they ride:
a plain ``grpc.aio`` server in a child process (as the daemon is) and a sync client (as the
Client is) moving bytes messages (no protobuf) of ``message_bytes``, one client-streaming call for
an upload (what a Put stream could reach) and one server-streaming call for a download (a Get).
Neither end copies a message into or out of anything, so a data path on gRPC stays below this.

    python -m kvstore.ops.grpc_ceiling SERVE MESSAGE_BYTES   # the server (prints its port)
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc

MAX_MESSAGE = 64 << 20
_OPTIONS = [("grpc.max_receive_message_length", MAX_MESSAGE), ("grpc.max_send_message_length", MAX_MESSAGE)]


async def _serve(message_bytes: int) -> None:
    payload = b"\x01" * message_bytes

    async def upload(messages, context) -> bytes:
        total = 0
        async for m in messages:
            total += len(m)
        return total.to_bytes(8, "little")

    async def download(request: bytes, context) -> None:
        for _ in range(int.from_bytes(request, "little")):
            await context.write(payload)

    handler = grpc.method_handlers_generic_handler("ceiling", {
        "Upload": grpc.stream_unary_rpc_method_handler(upload),
        "Download": grpc.unary_stream_rpc_method_handler(download)})
    server = grpc.aio.server(options=_OPTIONS)
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


class GrpcStreamPass:
    """``count`` messages of ``message_bytes`` per pass, up (``upload=True``) or down, through one
    grpc.aio server process started for this pass object. One pass = one call; returns seconds."""

    def __init__(self, message_bytes: int, count: int, upload: bool) -> None:
        self.message_bytes, self.count, self.upload = message_bytes, count, upload
        self.bytes = message_bytes * count
        self._proc = subprocess.Popen([sys.executable, "-m", "kvstore.ops.grpc_ceiling", "SERVE", str(message_bytes)],
                                      stdout=subprocess.PIPE, text=True)
        port = int(self._proc.stdout.readline())
        self._channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=_OPTIONS)
        self._upload = self._channel.stream_unary("/ceiling/Upload")
        self._download = self._channel.unary_stream("/ceiling/Download")
        self._message = b"\x02" * message_bytes

    def __call__(self) -> float:
        t = time.perf_counter()
        if self.upload:
            got = int.from_bytes(self._upload(iter([self._message] * self.count), timeout=300), "little")
        else:
            got = sum(len(m) for m in self._download(self.count.to_bytes(8, "little"), timeout=300))
        elapsed = time.perf_counter() - t
        if got != self.bytes:
            raise RuntimeError(f"gRPC ceiling moved {got} of {self.bytes} bytes")
        return elapsed

    def close(self) -> None:
        self._channel.close()
        self._proc.kill()
        self._proc.wait()


if __name__ == "__main__" and sys.argv[1:2] == ["SERVE"]:
    asyncio.run(_serve(int(sys.argv[2])))
