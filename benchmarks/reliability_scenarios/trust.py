"""Trust scenarios of issue 35: slow HTTP clients against the metrics/route port, and a reload
that revokes a token on every transport.

``http_slowloris``: a fleet daemon's ``/metrics`` and ``/v1/route`` timed with nobody else
connected, then while a separate process holds N connections that each send one header byte a
second (slow_http_client.py); the figures are p50 / p99 / max of each, both phases in one run.

``revocation``: a two-tenant daemon; per transport, a client of tenant A works, A's token is
removed by SIGHUP, and the scenario counts the calls A's client makes before one is refused
(1 = the very next call), and what A's old tickets still open (lookup, lease and broker sockets,
the side channel).
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import time
import uuid

import grpc
import numpy as np

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.errors import KVStoreError, Unauthenticated
from kvstore.ops.http_probe import timed_request
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.transport import local_lookup, segments
from kvstore.transport.bulk import BulkChannel
from kvstore.transport.socket_server import greeting

from reliability_scenarios.common import Unsupported

SLOW_CLIENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "slow_http_client.py")
LAYOUT = KVLayout(model="reliability/trust", num_layers=1, num_kv_heads=1, head_dim=16, dtype="float16",
                  block_tokens=16)


def _summary(samples: list[tuple[int, float]]) -> dict:
    ms = sorted(s * 1000 for _, s in samples)
    return {"n": len(ms), "p50_ms": round(statistics.median(ms), 2), "p99_ms": round(ms[int(0.99 * (len(ms) - 1))], 2),
            "max_ms": round(ms[-1], 2), "statuses": sorted({st for st, _ in samples})}


def _probe(port: int, route: bytes, seconds: float) -> dict:
    metrics, routes = [], []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        metrics.append(timed_request(port, "GET", "/metrics"))
        routes.append(timed_request(port, "POST", "/v1/route", route))
        time.sleep(0.05)
    return {"metrics": _summary(metrics), "route": _summary(routes)}


def http_slowloris(workdir: str, clients: int = 100, held_s: float = 14.0,
                   redis_url: str = "redis://127.0.0.1:6379/0") -> dict:
    import redis

    try:
        redis.Redis.from_url(redis_url, socket_timeout=2).ping()
    except Exception as e:  # noqa: BLE001 - any failure: no fleet here
        raise Unsupported(f"fleet mode needs Redis at {redis_url}: {e}") from None
    os.makedirs(workdir, exist_ok=True)
    config = os.path.join(workdir, "kv.yaml")
    with open(config, "w") as f:
        f.write(textwrap.dedent(f"""
            fleet:
              enabled: true
              redis_url: {redis_url}
              key_prefix: kvsrel-{uuid.uuid4().hex[:12]}
              secret: reliability-fleet-secret-0123456789
            """))
    d = start_local_daemon(workdir, "--config", config, "--metrics-port", "0", cpu_bytes="16MiB", nvme_bytes="64MiB")
    try:
        with d.client() as c:
            ns = c.register_namespace(Namespace(LAYOUT))
            hashes = ChainHasher().chain(list(range(64)), 16)
            c.put(ns, hashes, [np.zeros(LAYOUT.block_bytes, np.uint8)] * 4)
        route = json.dumps({"namespace_id": ns.hex(), "token_ids": list(range(64))}).encode()
        quiet = _probe(d.metrics_port, route, held_s - 4)
        attacker = subprocess.Popen([sys.executable, SLOW_CLIENT, str(d.metrics_port), str(clients), str(held_s)],
                                    stdout=subprocess.PIPE, text=True)
        try:
            assert attacker.stdout.readline().strip() == "ready"
            held = _probe(d.metrics_port, route, held_s - 4)
            outcome = json.loads(attacker.stdout.readline())
        finally:
            attacker.kill()
            attacker.wait()
        return {"slow_clients": clients, "held_s": held_s, "quiet": quiet, "held": held,
                "slow_connections_let_go": outcome["closed"], "slow_connections_still_open": outcome["open"],
                "load_avg": os.getloadavg()[0],
                "ok": (held["metrics"]["statuses"] == [200] and held["route"]["statuses"] == [200]
                       and held["metrics"]["p99_ms"] < 100 and held["route"]["p99_ms"] < 100 and outcome["open"] == 0)}
    finally:
        d.stop()


def _write_tokens(path: str, tokens: str) -> None:
    with open(path, "w") as f:
        f.write(f"tokens: {tokens}\nadmin_tenants: [ops]\n")


def _reload(d, config: str, tokens: str) -> float:
    before = d.log().count("reload: applied")
    _write_tokens(config, tokens)
    t0 = time.monotonic()
    os.kill(d.pid, signal.SIGHUP)
    while d.log().count("reload: applied") == before:
        if time.monotonic() - t0 > 10:
            raise TimeoutError("reload not applied")
        time.sleep(0.01)
    return time.monotonic() - t0


def _greeted_answer(path: str, ticket: bytes, tenant: str, ns: bytes, hashes) -> bool:
    """Whether a lookup over a new connection greeted with ``ticket`` is answered."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(5)
        s.connect(path)
        try:
            s.sendall(greeting(local_lookup.MAGIC, ticket, tenant) + local_lookup.encode_lookup(ns, hashes, local_lookup.LOOKUP))
            local_lookup.recv_frame(s)
            return True
        except OSError:
            return False


def revocation(workdir: str) -> dict:
    out: dict = {"per_transport": {}}
    hashes = ChainHasher().chain(list(range(16 * 8)), 16)
    blocks = [np.full(LAYOUT.block_bytes, i, np.uint8) for i in range(8)]
    for transport in ("shm", "bulk", "grpc"):
        wd = os.path.join(workdir, transport)
        os.makedirs(wd, exist_ok=True)
        config = os.path.join(wd, "kv.yaml")
        _write_tokens(config, "{a-token: a, b-token: b, ops-token: ops}")
        d = start_local_daemon(wd, "--config", config, "--shm-dir", wd, cpu_bytes="16MiB", nvme_bytes="64MiB")
        try:
            with d.client(token="a-token", transport=transport) as a, d.client(token="b-token", transport=transport) as b:
                ns = a.register_namespace(Namespace(LAYOUT))
                ns_b = b.register_namespace(Namespace(LAYOUT))
                a.put(ns, hashes[:4], blocks[:4])
                b.put(ns_b, hashes[:4], blocks[:4])
                a.lookup(ns, hashes[:4])
                with grpc.insecure_channel(d.address) as channel:
                    hs = pb_grpc.KVStoreStub(channel).Handshake(pb.HandshakeRequest(nonce=secrets.token_bytes(16)),
                                                                metadata=[("authorization", "Bearer a-token")])
                reload_s = _reload(d, config, "{b-token: b, ops-token: ops}")
                calls, refused_with = 0, None
                for call in (lambda: a.get(ns, hashes[:4]), lambda: a.put(ns, hashes[4:], blocks[4:], parent=hashes[3]),
                             lambda: a.lookup(ns, hashes[:4]), lambda: a.exists(ns, hashes[:4])) * 3:
                    calls += 1
                    try:
                        call()
                    except KVStoreError as e:
                        refused_with = type(e).__name__
                        break
                every = []
                for call in (lambda: a.get(ns, hashes[:4]), lambda: a.put(ns, hashes[4:], blocks[4:], parent=hashes[3]),
                             lambda: a.lookup(ns, hashes[:4]), lambda: a.exists(ns, hashes[:4])):
                    try:
                        call()
                        every.append("answered")
                    except Unauthenticated:
                        every.append("Unauthenticated")
                    except KVStoreError as e:
                        every.append(type(e).__name__)
                old_tickets = {}
                if hs.lookup_socket:
                    old_tickets["lookup_socket"] = "answered" if _greeted_answer(
                        hs.lookup_socket, hs.lookup_ticket, "a", ns, hashes[:4]) else "refused"
                if hs.segment_socket:
                    try:
                        segments.ask(hs.segment_socket, hs.segment_ticket, "a", [])
                        old_tickets["segment_broker"] = "answered"
                    except PermissionError:
                        old_tickets["segment_broker"] = "refused"
                try:
                    BulkChannel("127.0.0.1", hs.bulk_port, hs.bulk_ticket, 2.0).sock.close()
                    old_tickets["side_channel"] = "session opened"
                except OSError:
                    old_tickets["side_channel"] = "refused"
                b_ok = b.get(ns_b, hashes[:4]) == [x.tobytes() for x in blocks[:4]]
            out["per_transport"][transport] = {"reload_applied_s": round(reload_s, 3),
                                               "calls_until_refused": calls, "refused_with": refused_with,
                                               "get_put_lookup_exists_after": every, "old_tickets": old_tickets,
                                               "other_tenant_served": b_ok}
        finally:
            d.stop()
    per = out["per_transport"].values()
    out["ok"] = all(p["calls_until_refused"] == 1 and p["refused_with"] == "Unauthenticated"
                    and set(p["get_put_lookup_exists_after"]) == {"Unauthenticated"}
                    and "answered" not in p["old_tickets"].values() and "session opened" not in p["old_tickets"].values()
                    and p["other_tenant_served"] for p in per)
    return out
