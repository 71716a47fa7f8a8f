"""``kvstore pd-proxy``: one OpenAI endpoint in front of prefill and decode vLLM instances.

Each completion or chat request goes first to a prefill instance (``kv_role: kv_producer``) with
``max_tokens`` 1, no streaming and ``kv_transfer_params: {"do_remote_decode": true}``; its answer
carries ``kv_transfer_params`` naming the prompt blocks the prefill saves to kvstore
(connectors/vllm/handoff.py). The request then goes, unchanged but for those params, to a decode
instance (``kv_consumer``), which waits for exactly those blocks, loads them and generates; its
answer (streamed or not) is passed through to the client as it comes. Instances are taken in
turn (XpYd: any prefill with any decode; with a fleet, decode's daemon fetches from prefill's).

The command line is that of vLLM's disaggregation example proxies (``toy_proxy_server.py``):

    kvstore pd-proxy --port 8000 --prefiller-hosts 10.0.0.1 --prefiller-ports 8100 \\
                     --decoder-hosts 10.0.0.2 10.0.0.3 --decoder-ports 8200 8200

A prefill instance that fails or does not answer does not fail the request: decode then computes
the prompt itself (counted as ``prefill_failures``). ``GET /healthcheck`` (also ``/health``)
answers 200 while at least one prefill and one decode instance answer their ``/health``, else 503,
with the counters. ``GET /v1/models`` is a decode instance's.
"""

from __future__ import annotations

import argparse
import asyncio
import copy
import itertools
import logging
import sys
import uuid
from collections import Counter

logger = logging.getLogger("kvstore.pd_proxy")

#: what vLLM's P/D connectors expect in a prefill request (NIXL's keys; kvstore reads the first)
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
#: seconds the proxy keeps an idle connection to an instance open: below the 5 s keep-alive of
#: uvicorn (vLLM's and SGLang's servers), so that the proxy closes an idle connection before the
#: instance does, rather than send a request down one the instance is closing
KEEPALIVE_S = 2.0
#: hop-by-hop and length headers are the proxy's own to set
_DROP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding", "keep-alive"}


class Backends:
    """Instances of one kind (prefill or decode), taken in turn."""

    def __init__(self, kind: str, urls: list[str]) -> None:
        if not urls:
            raise ValueError(f"no {kind} instances")
        self.kind = kind
        self.urls = urls
        self._turn = itertools.cycle(urls)

    def next(self) -> str:
        return next(self._turn)


class PDProxy:
    def __init__(self, prefill: list[str], decode: list[str], timeout_s: float = 600.0) -> None:
        self.prefill = Backends("prefill", prefill)
        self.decode = Backends("decode", decode)
        self.timeout_s = timeout_s
        self.counters: Counter[str] = Counter()
        self._session = None

    # -- the app ---------------------------------------------------------------------------------

    def app(self):
        from aiohttp import web

        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/completions", self.handle_completion)
        app.router.add_post("/v1/chat/completions", self.handle_completion)
        app.router.add_get("/healthcheck", self.handle_health)
        app.router.add_get("/health", self.handle_health)
        app.router.add_get("/v1/models", self.handle_models)
        app.on_startup.append(self._start)
        app.on_cleanup.append(self._stop)
        return app

    async def _start(self, app) -> None:
        import aiohttp

        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=self.timeout_s),
                                              connector=aiohttp.TCPConnector(limit=1024, keepalive_timeout=KEEPALIVE_S))

    async def _stop(self, app) -> None:
        await self._session.close()

    # -- requests --------------------------------------------------------------------------------

    async def handle_completion(self, request):
        from aiohttp import web

        try:
            body = await request.json()
        except Exception:  # noqa: BLE001
            return web.json_response({"error": {"message": "the request body is not JSON", "type": "BadRequest"}},
                                     status=400)
        if not isinstance(body, dict):
            return web.json_response({"error": {"message": "the request body is not an object",
                                                "type": "BadRequest"}}, status=400)
        self.counters["requests"] += 1
        request_id = request.headers.get("X-Request-Id") or str(uuid.uuid4())
        headers = {"X-Request-Id": request_id}
        if "Authorization" in request.headers:
            headers["Authorization"] = request.headers["Authorization"]
        params = await self._prefill(request.path, body, headers)
        decode_body = dict(body)
        if params is not None:
            decode_body["kv_transfer_params"] = params
            self.counters["handoffs"] += 1
        else:
            decode_body.pop("kv_transfer_params", None)
        return await self._decode(request, request.path, decode_body, headers)

    async def _prefill(self, path: str, body: dict, headers: dict) -> dict | None:
        """Run the prompt on a prefill instance; the ``kv_transfer_params`` it answers (None when
        it failed: decode then computes the prompt)."""
        url = self.prefill.next()
        req = copy.deepcopy(body)
        req["kv_transfer_params"] = dict(PREFILL_PARAMS)
        req["stream"] = False
        req.pop("stream_options", None)
        req["max_tokens"] = 1
        if "max_completion_tokens" in req:
            req["max_completion_tokens"] = 1
        try:
            async with await self._post(url + path, req, headers) as resp:
                if resp.status != 200:
                    raise RuntimeError(f"HTTP {resp.status}: {(await resp.text())[:200]}")
                answer = await resp.json()
        except Exception as e:  # noqa: BLE001 - decode computes the prompt instead
            self.counters["prefill_failures"] += 1
            logger.warning("pd-proxy: prefill at %s failed (%s); decode computes the prompt", url, e)
            return None
        params = answer.get("kv_transfer_params") if isinstance(answer, dict) else None
        return params if isinstance(params, dict) else None

    async def _post(self, url: str, body: dict, headers: dict):
        """POST ``body`` to an instance; once more where an open connection failed before any
        answer (an instance closing a pooled connection as the request went down it answers
        nothing). An instance that refuses the connection is down: that failure is the caller's."""
        import aiohttp

        try:
            return await self._session.post(url, json=body, headers=headers)
        except aiohttp.ClientConnectorError:
            raise
        except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
            self.counters["resent"] += 1
            logger.info("pd-proxy: %s dropped the connection before answering (%s); sending again", url, e)
            return await self._session.post(url, json=body, headers=headers)

    async def _decode(self, request, path: str, body: dict, headers: dict):
        from aiohttp import web

        url = self.decode.next()
        try:
            upstream = await self._post(url + path, body, headers)
        except Exception as e:  # noqa: BLE001
            self.counters["decode_failures"] += 1
            logger.warning("pd-proxy: decode at %s failed: %s", url, e)
            return web.json_response({"error": {"message": f"decode instance failed: {type(e).__name__}",
                                                "type": "ServiceUnavailable"}}, status=503)
        async with upstream:
            out = web.StreamResponse(status=upstream.status,
                                     headers={k: v for k, v in upstream.headers.items()
                                              if k.lower() not in _DROP_HEADERS})
            await out.prepare(request)
            try:
                async for chunk in upstream.content.iter_any():
                    await out.write(chunk)
            except Exception as e:  # noqa: BLE001 - the client sees the stream end
                self.counters["decode_failures"] += 1
                logger.warning("pd-proxy: decode stream from %s broke: %s", url, e)
            await out.write_eof()
            return out

    async def handle_models(self, request):
        from aiohttp import web

        async with self._session.get(self.decode.next() + "/v1/models") as resp:
            return web.json_response(await resp.json(), status=resp.status)

    async def handle_health(self, request):
        from aiohttp import web

        async def live(url: str) -> bool:
            try:
                async with self._session.get(url + "/health", timeout=_short_timeout()) as resp:
                    return resp.status == 200
            except Exception:  # noqa: BLE001
                return False

        urls = self.prefill.urls + self.decode.urls
        up = await asyncio.gather(*(live(u) for u in urls))
        n = len(self.prefill.urls)
        prefill_up, decode_up = sum(up[:n]), sum(up[n:])
        ok = prefill_up > 0 and decode_up > 0
        return web.json_response({"status": "ok" if ok else "unavailable",
                                  "prefill_instances": len(self.prefill.urls), "prefill_up": prefill_up,
                                  "decode_instances": len(self.decode.urls), "decode_up": decode_up,
                                  "counters": dict(self.counters)}, status=200 if ok else 503)


def _short_timeout():
    import aiohttp

    return aiohttp.ClientTimeout(total=2.0)


def _urls(hosts: list[str], ports: list[int], kind: str) -> list[str]:
    if len(hosts) != len(ports):
        raise SystemExit(f"kvstore pd-proxy: {len(hosts)} {kind} hosts but {len(ports)} ports")
    return [f"http://{h}:{p}" for h, p in zip(hosts, ports)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvstore pd-proxy", description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--prefiller-hosts", "--prefiller-host", nargs="+", default=["localhost"])
    ap.add_argument("--prefiller-ports", "--prefiller-port", nargs="+", type=int, default=[8100])
    ap.add_argument("--decoder-hosts", "--decoder-host", nargs="+", default=["localhost"])
    ap.add_argument("--decoder-ports", "--decoder-port", nargs="+", type=int, default=[8200])
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds one upstream request may take")
    args = ap.parse_args(argv)
    try:
        from aiohttp import web
    except ModuleNotFoundError:
        print("kvstore pd-proxy needs aiohttp (pip install aiohttp)", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    proxy = PDProxy(_urls(args.prefiller_hosts, args.prefiller_ports, "prefiller"),
                    _urls(args.decoder_hosts, args.decoder_ports, "decoder"), args.timeout)
    web.run_app(proxy.app(), host=args.host, port=args.port, print=None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
