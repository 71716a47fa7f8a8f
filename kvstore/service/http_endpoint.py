"""The daemon's HTTP port: Prometheus ``/metrics`` and, for routers that speak HTTP rather than
gRPC (llm-d, production-stack, SGLang's router), the Route answer as JSON.

    POST /v1/route   {"namespace_id": "<32 hex>", "hashes": ["<hex>", ...]}
                  or {"namespace_id": "<32 hex>", "token_ids": [1, 2, ...],
                      "hash_algorithm": "xxh3_128", "hash_seed": 0}          (both optional)
    200 {"namespace_id": ..., "block_tokens": 16,
         "nodes": [{"node_id", "address", "blocks", "tokens", "memory_blocks", "disk_blocks"}, ...]}

Token ids are hashed here with ``kvstore.keys.ChainHasher`` and the namespace's block_tokens:
the algorithm and seed must be the ones the engine's connector uses. The answer is exactly the
Route RPC's (the same handler runs, so the same authorisation: with auth on, an
``Authorization: Bearer <token>`` header is required and another tenant's namespace is 404).
Errors are JSON ``{"error": ..., "field": ...}`` with the HTTP status of the gRPC one.

Bounds: bodies over ``MAX_BODY_BYTES`` are refused unread (413), a connection that sends
nothing for ``IDLE_S`` is closed, and at most ``MAX_CONCURRENT`` requests run at once (503
beyond), so this port cannot be used to pile up threads.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import ChainHasher
from kvstore.proto import kvstore_pb2 as pb

log = logging.getLogger("kvstore.service.http")

MAX_BODY_BYTES = 1 << 20
IDLE_S = 10.0
MAX_CONCURRENT = 32
ROUTE_PATH = "/v1/route"

HTTP_STATUS = {"INVALID_ARGUMENT": 400, "UNAUTHENTICATED": 401, "PERMISSION_DENIED": 403, "NOT_FOUND": 404,
               "FAILED_PRECONDITION": 409, "RESOURCE_EXHAUSTED": 429, "UNAVAILABLE": 503}


class _HeaderContext:
    """What the servicer reads of a call's context, from an HTTP request's headers."""

    def __init__(self, authorization: str) -> None:
        self._metadata = (("authorization", authorization),) if authorization else ()

    def invocation_metadata(self):
        return self._metadata


class RouteOverHttp:
    """The Route RPC for a JSON body (see the module docstring); ``servicer`` answers it."""

    def __init__(self, servicer) -> None:
        self.servicer = servicer

    def __call__(self, body: dict, authorization: str) -> dict:
        context = _HeaderContext(authorization)
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


class _Handler(BaseHTTPRequestHandler):
    server: "_Server"
    timeout = IDLE_S
    protocol_version = "HTTP/1.1"

    def log_message(self, format, *args):  # noqa: A002 - the stdlib's signature
        log.debug("http: " + format, *args)

    def do_GET(self):
        if self.path.split("?", 1)[0] != "/metrics":
            return self._json(404, {"error": f"no such path; GET /metrics or POST {ROUTE_PATH}"})
        body = generate_latest(self.server.registry)
        self._send(200, CONTENT_TYPE_LATEST, body)

    def do_POST(self):
        if self.path != ROUTE_PATH or self.server.route is None:
            return self._json(404, {"error": f"no such path; POST {ROUTE_PATH} (served when the daemon runs)"})
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            return self._json(411, {"error": "Content-Length is required"})
        if not 0 <= length <= MAX_BODY_BYTES:
            self.close_connection = True
            return self._json(413, {"error": f"body over {MAX_BODY_BYTES} bytes"})
        try:
            body = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(body, dict):
                raise ValueError("not an object")
        except ValueError as e:
            return self._json(400, {"error": f"body: not a JSON object ({e})"})
        try:
            answer = self.server.route(body, self.headers.get("Authorization", ""))
        except KVStoreError as e:
            return self._json(HTTP_STATUS.get(e.grpc_status, 500),
                              {"error": str(e), "field": getattr(e, "field", None), "kind": type(e).__name__})
        except Exception as e:  # noqa: BLE001 - an HTTP answer, not a dead handler thread
            log.exception("http route failed")
            return self._json(500, {"error": f"internal error: {type(e).__name__}"})
        self._json(200, answer)

    def _json(self, status: int, payload: dict) -> None:
        self._send(status, "application/json", json.dumps(payload).encode())

    def _send(self, status: int, content_type: str, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, address, registry, route) -> None:
        super().__init__(address, _Handler)
        self.registry = registry
        self.route = route
        self.slots = threading.BoundedSemaphore(MAX_CONCURRENT)

    def process_request(self, request, client_address):
        if not self.slots.acquire(blocking=False):
            try:
                request.sendall(b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
            except OSError:
                pass
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()


class _Server6(_Server):
    address_family = socket.AF_INET6


class HttpEndpoint:
    """``/metrics`` from ``registry`` and, with ``route``, ``POST /v1/route``; one thread per request."""

    def __init__(self, registry, route: RouteOverHttp | None = None) -> None:
        self.registry = registry
        self.route = route
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    def serve(self, host: str, port: int) -> int:
        server_class = _Server6 if ":" in host else _Server
        self._server = server_class((host.strip("[]"), port), self.registry, self.route)
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvstore-http", daemon=True)
        self._thread.start()
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
