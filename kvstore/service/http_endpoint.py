"""The daemon's HTTP port: Prometheus ``/metrics`` and, for routers that speak HTTP rather than
gRPC, ``POST /v1/route``: the Route RPC's answer as JSON, for block hashes in hex or token ids
hashed here with ``kvstore.keys.ChainHasher`` (docs/operations.md, "HTTP route endpoint for
routers"). The same handler runs as for the RPC, so the same authorisation; errors are JSON
``{"error", "field", "kind"}`` with the HTTP status of the gRPC one, and every failure, a malformed
or hostile request included, is answered with a status code.

Slow or hostile clients cannot stop it. Connections are served by ``h11`` (HTTP/1.1 parsing, no
I/O of its own) on one asyncio loop, so a held connection costs a socket and a little memory,
never a thread. A request must arrive whole within ``REQUEST_DEADLINE_S`` and its answer be taken
within ``WRITE_DEADLINE_S``; headers, bodies and JSON nesting are bounded before anything is
parsed; a client holding ``MAX_PER_CLIENT``
connections (or anyone, when all ``MAX_CONNECTIONS`` are open) has its connection that has waited
longest for a request pushed out, so idle connections delay no one else's answer; at most
``MAX_CONCURRENT`` requests are answered at once, on ``BUDGET.http`` threads (503 beyond).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import socket
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor

import h11
import numpy as np
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import ChainHasher
from kvstore.proto import kvstore_pb2 as pb
from kvstore.service.rpc_base import PlainContext
from kvstore.threads import BUDGET

log = logging.getLogger("kvstore.service.http")

MAX_BODY_BYTES = 1 << 20
MAX_HEADER_BYTES = 16 << 10
MAX_JSON_DEPTH = 8
REQUEST_DEADLINE_S = 10.0
WRITE_DEADLINE_S = 10.0
MAX_PER_CLIENT = 64
MAX_CONNECTIONS = 1024
MAX_CONCURRENT = 32
ROUTE_PATH = "/v1/route"

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
               "FAILED_PRECONDITION": 409, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503}
_REASONS = {400: "Bad Request", 408: "Request Timeout", 413: "Content Too Large", 503: "Service Unavailable"}
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')


class RouteOverHttp:
    """The Route RPC for a JSON body (see the module docstring); ``servicer`` answers it."""

    def __init__(self, servicer) -> None:
        self.servicer = servicer

    def __call__(self, body: dict, authorization: str) -> dict:
        context = PlainContext(metadata=(("authorization", authorization),) if authorization else ())
        try:
            namespace_id = bytes.fromhex(str(body.get("namespace_id", "")))
        except ValueError:
            raise InvalidArgument("namespace_id", "must be the namespace id in hex") from None
        ns = self.servicer.caller_namespace(context, namespace_id)
        hashes = self._hashes(body, ns.layout.block_tokens)
        answer = self.servicer.Route(pb.RouteRequest(namespace_id=ns.id, hashes=hashes), context)
        return {"namespace_id": ns.id.hex(), "block_tokens": ns.layout.block_tokens,
                "nodes": [{"node_id": n.node_id, "address": n.address, "blocks": n.blocks, "tokens": n.tokens,
                           "memory_blocks": n.memory_blocks, "disk_blocks": n.disk_blocks} for n in answer.nodes]}

    @staticmethod
    def _hashes(body: dict, block_tokens: int) -> list[bytes]:
        if "hashes" in body:
            hashes = body["hashes"]
            if not isinstance(hashes, list):
                raise InvalidArgument("hashes", "must be a list of hex strings")
            try:
                return [bytes.fromhex(h) for h in hashes]
            except (TypeError, ValueError):
                raise InvalidArgument("hashes", "every hash must be a hex string") from None
        tokens = body.get("token_ids")
        if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 2**32 for t in tokens):
            raise InvalidArgument("token_ids", "give hashes, or token_ids as a list of integers in [0, 2**32)")
        seed = body.get("hash_seed", 0)
        if not isinstance(seed, int):
            raise InvalidArgument("hash_seed", "must be an integer")
        return ChainHasher(str(body.get("hash_algorithm", "xxh3_128")), seed).chain(tokens, block_tokens)


def json_depth(body: bytes) -> int:
    """How deep arrays and objects nest in ``body`` (strings skipped), in C-speed passes: a
    recursive parser must never meet a body that would exhaust its stack."""
    if b"[" not in body and b"{" not in body:
        return 0
    codes = np.frombuffer(_JSON_STRING.sub(b'""', body), dtype=np.uint8)
    steps = (np.isin(codes, (ord("["), ord("{"))).astype(np.int32)
             - np.isin(codes, (ord("]"), ord("}"))).astype(np.int32))
    return int(np.cumsum(steps).max(initial=0))


class _Refused(Exception):
    """A request answered with ``status`` and closed, before any handler saw it."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class _Conn:
    __slots__ = ("peer", "writer", "waiting")

    def __init__(self, peer: str, writer: asyncio.StreamWriter) -> None:
        self.peer, self.writer, self.waiting = peer, writer, True


class HttpEndpoint:
    """``/metrics`` from ``registry`` and ``POST /v1/route`` answered by ``route`` (module docstring)."""

    def __init__(self, registry, route: RouteOverHttp) -> None:
        self.registry = registry
        self.route = route
        self._conns: OrderedDict[_Conn, None] = OrderedDict()   # least recently waiting first
        self._per_client: dict[str, int] = {}
        self._answering = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._answers = ThreadPoolExecutor(BUDGET.http, thread_name_prefix="kvstore-http")

    def serve(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (0: any free port; raises ``OSError`` when taken) and serve
        from a thread of its own; returns the port."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host.strip("[]"), port))
            sock.listen(256)
            sock.setblocking(False)
        except OSError:
            sock.close()
            raise
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="kvstore-http", daemon=True)
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._connection, sock=sock, limit=MAX_HEADER_BYTES), self._loop).result()
        return sock.getsockname()[1]

    def close(self) -> None:
        if self._loop is None:
            return
        loop, self._loop = self._loop, None

        async def shut() -> None:
            self._server.close()
            for conn in list(self._conns):
                conn.writer.transport.abort()
        asyncio.run_coroutine_threadsafe(shut(), loop).result(5)
        loop.call_soon_threadsafe(loop.stop)
        self._thread.join(5)
        self._answers.shutdown(wait=False, cancel_futures=True)

    # -- connections (all on the loop) ----------------------------------------------------------

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = str((writer.get_extra_info("peername") or ("?",))[0])
        if not self._admit(peer):
            return await self._refuse(writer, 503, "every connection is answering a request")
        conn = _Conn(peer, writer)
        self._conns[conn] = None
        self._per_client[peer] = self._per_client.get(peer, 0) + 1
        try:
            await self._serve(conn, reader)
        except (ConnectionError, OSError):
            pass   # gone, or pushed out
        finally:
            self._conns.pop(conn, None)
            self._per_client[peer] -= 1
            if not self._per_client[peer]:
                del self._per_client[peer]
            writer.transport.abort()

    def _admit(self, peer: str) -> bool:
        """Make room for one more connection from ``peer``: push out its own connection that has
        waited longest for a request when it holds ``MAX_PER_CLIENT``, anyone's when all
        ``MAX_CONNECTIONS`` are open. False when every candidate is busy answering."""
        for full, mine in ((self._per_client.get(peer, 0) >= MAX_PER_CLIENT, True),
                           (len(self._conns) >= MAX_CONNECTIONS, False)):
            if not full:
                continue
            victim = next((c for c in self._conns if c.waiting and (c.peer == peer or not mine)), None)
            if victim is None:
                return False
            self._conns.pop(victim)
            victim.writer.transport.abort()
        return True

    async def _serve(self, conn: _Conn, reader: asyncio.StreamReader) -> None:
        http = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEADER_BYTES)
        while True:
            conn.waiting = True
            if conn in self._conns:
                self._conns.move_to_end(conn)
            try:
                async with asyncio.timeout(REQUEST_DEADLINE_S):
                    request, body = await self._read_request(http, reader)
            except TimeoutError:
                return await self._refuse(conn.writer, 408,
                                          f"the request did not arrive whole within {REQUEST_DEADLINE_S:g} s")
            except _Refused as e:
                return await self._refuse(conn.writer, e.status, str(e))
            except h11.RemoteProtocolError as e:
                return await self._refuse(conn.writer, e.error_status_hint, f"malformed request: {e}")
            if request is None:
                return   # the client closed between requests
            conn.waiting = False
            status, content_type, answer = await self._answer(request, body)
            data = http.send(h11.Response(status_code=status, headers=[
                ("content-type", content_type), ("content-length", str(len(answer)))]))
            data += http.send(h11.Data(data=answer)) + http.send(h11.EndOfMessage())
            conn.writer.write(data)
            async with asyncio.timeout(WRITE_DEADLINE_S):
                await conn.writer.drain()
            if http.our_state is not h11.DONE or http.their_state is not h11.DONE:
                return
            http.start_next_cycle()

    @staticmethod
    async def _read_request(http: h11.Connection, reader: asyncio.StreamReader):
        """``(h11.Request, body)``, or ``(None, b"")`` when the client closed before a request."""
        request, body = None, bytearray()
        while True:
            event = http.next_event()
            if event is h11.NEED_DATA:
                http.receive_data(await reader.read(1 << 16))
            elif isinstance(event, h11.Request):
                request = event
                declared = dict(event.headers).get(b"content-length", b"0")
                if declared.isdigit() and int(declared) > MAX_BODY_BYTES:
                    raise _Refused(413, f"body over {MAX_BODY_BYTES} bytes")
            elif isinstance(event, h11.Data):
                body += event.data
                if len(body) > MAX_BODY_BYTES:
                    raise _Refused(413, f"body over {MAX_BODY_BYTES} bytes")
            elif isinstance(event, h11.EndOfMessage):
                return request, bytes(body)
            elif isinstance(event, h11.ConnectionClosed):
                return None, b""

    @staticmethod
    async def _refuse(writer: asyncio.StreamWriter, status: int, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        writer.write(f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\ncontent-type: application/json\r\n"
                     f"content-length: {len(body)}\r\nconnection: close\r\n\r\n".encode() + body)
        try:
            async with asyncio.timeout(1.0):
                await writer.drain()
        except (TimeoutError, ConnectionError, OSError):
            pass
        writer.transport.abort()

    async def _answer(self, request: h11.Request, body: bytes) -> tuple[int, str, bytes]:
        if self._answering >= MAX_CONCURRENT:
            return _json(503, {"error": f"{MAX_CONCURRENT} requests are being answered; retry"})
        self._answering += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._answers, self._respond, request, body)
        finally:
            self._answering -= 1

    def _respond(self, request: h11.Request, body: bytes) -> tuple[int, str, bytes]:
        """The answer to one whole request (on an answer thread)."""
        path = request.target.decode("latin-1").split("?", 1)[0]
        if request.method == b"GET" and path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest(self.registry)
        if request.method != b"POST" or path != ROUTE_PATH:
            return _json(404, {"error": f"no such path; GET /metrics or POST {ROUTE_PATH} "
                                        "(served when the daemon runs)"})
        if json_depth(body) > MAX_JSON_DEPTH:
            return _json(400, {"error": f"body: JSON nested deeper than {MAX_JSON_DEPTH} levels"})
        try:
            parsed = json.loads(body or b"{}")
            if not isinstance(parsed, dict):
                raise ValueError("not an object")
        except (ValueError, RecursionError) as e:
            return _json(400, {"error": f"body: not a JSON object ({str(e)[:200]})"})
        authorization = dict(request.headers).get(b"authorization", b"").decode("latin-1")
        try:
            return _json(200, self.route(parsed, authorization))
        except KVStoreError as e:
            return _json(HTTP_STATUS.get(e.grpc_status, 500),
                         {"error": str(e), "field": getattr(e, "field", None), "kind": type(e).__name__})
        except Exception as e:  # noqa: BLE001 - an answer with a status, never a dead connection
            log.error("http route failed: %s", type(e).__name__, exc_info=log.isEnabledFor(logging.DEBUG))
            return _json(500, {"error": f"internal error: {type(e).__name__}"})


def _json(status: int, payload: dict) -> tuple[int, str, bytes]:
    return status, "application/json", json.dumps(payload).encode()
