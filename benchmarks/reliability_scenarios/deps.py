"""Scenario 7, dependencies down: the daemon killed while clients of every transport are
mid-request, and Redis killed under a fleet-publishing Store.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import threading
import time

from kvstore import Namespace
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.ops.local_daemon import start_local_daemon

from .common import KiB, MiB, Unsupported, hashes, is_exact, kill_and_reap, layout, payload


# -- 7. dependencies down --------------------------------------------------------------------------

def daemon_killed_mid_request(workdir: str, block_bytes: int = 4 * MiB, rounds: int = 1) -> dict:
    """kill -9 while clients of every transport are mid-request: each raises DaemonUnavailable within
    its deadline (never hangs); after a restart on the same port and directory the same Client
    objects work again and every byte they are served is right."""
    out: dict = {"rounds": rounds, "per_transport": {}}
    lay = layout(block_bytes, "reliability/midreq")
    hs = hashes(6, seed=71)
    nvme = os.path.join(workdir, "midreq-nvme")
    d = start_local_daemon(os.path.join(workdir, "midreq0"), "--write-through", "--cpu-slot-bytes", "1MiB", cpu_bytes="64MiB",
                     nvme_bytes="512MiB", nvme_path=nvme)
    port = d.port
    timeout_s = 3.0
    clients = {t: Client(d.address, transport=t, timeout_s=timeout_s) for t in ("shm", "bulk", "grpc")}
    try:
        ns = None
        for c in clients.values():
            ns = c.register_namespace(Namespace(lay))
        clients["grpc"].put(ns, hs, [payload(h, block_bytes) for h in hs])
        for r in range(rounds):
            results: dict = {}
            stop = threading.Event()

            def hammer(name: str, c: Client) -> None:
                res = {"calls": 0, "raised": None, "seconds_to_raise": None, "wrong": 0}
                while not stop.is_set():
                    try:
                        got = c.get(ns, hs)
                        res["calls"] += 1
                        res["wrong"] += sum(1 for h, g in zip(hs, got) if g is not None and not is_exact(h, g, block_bytes))
                    except KVStoreError as e:
                        res["raised"] = type(e).__name__
                        res["seconds_to_raise"] = round(time.monotonic() - killed_at[0], 3)
                        break
                results[name] = res

            killed_at = [0.0]
            ts = {n: threading.Thread(target=hammer, args=(n, c)) for n, c in clients.items()}
            for t in ts.values():
                t.start()
            time.sleep(1.0)
            killed_at[0] = time.monotonic()
            kill_and_reap(d)
            for n, t in ts.items():
                t.join(timeout_s + 10)
                results[n]["hung"] = t.is_alive()
            stop.set()
            d = start_local_daemon(os.path.join(workdir, f"midreq{r + 1}"), "--write-through", "--cpu-slot-bytes", "1MiB",
                             "--listen", f"127.0.0.1:{port}", cpu_bytes="64MiB", nvme_bytes="512MiB", nvme_path=nvme)
            for n, c in clients.items():
                t0 = time.monotonic()
                back, wrong, failures = None, 0, 0
                while time.monotonic() - t0 < 15:
                    try:
                        got = c.get(ns, hs)
                        wrong += sum(1 for h, g in zip(hs, got) if g is not None and not is_exact(h, g, block_bytes))
                        back = sum(g is not None for g in got)
                        break
                    except KVStoreError:
                        failures += 1
                        time.sleep(0.1)
                results[n].update({"reconnected_s": round(time.monotonic() - t0, 3), "hits_after_restart": back,
                                   "wrong_after_restart": wrong, "failed_calls_before_reconnect": failures,
                                   "transport_after": c.active_transport})
            for n, res in results.items():
                out["per_transport"].setdefault(n, []).append(res)
    finally:
        for c in clients.values():
            c.close()
        d.stop()
    out["client_timeout_s"] = timeout_s
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_down(workdir: str, block_bytes: int = 16 * KiB) -> dict:
    """Fleet publishing against a private redis-server that is killed and restarted: the Store keeps
    serving, the fleet reports no peers instead of raising, and republishes when Redis returns."""
    if shutil.which("redis-server") is None:
        raise Unsupported("redis-server is not installed")
    from kvstore.fleet import Fleet
    from kvstore.store import Store, StoreConfig
    from kvstore.tiers.cpu import CpuTier

    port = _free_port()

    def start_redis():
        return subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                 "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def wait_redis(up: bool = True) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                if up:
                    return
            except OSError:
                if not up:
                    return
            time.sleep(0.05)

    redis = start_redis()
    wait_redis()
    store = Store([CpuTier(8 * MiB, slot_bytes=block_bytes)], StoreConfig())
    fleet = None
    out: dict = {}
    try:
        fleet = Fleet(store, f"redis://127.0.0.1:{port}/0", "node-a", "127.0.0.1:1",
                      secret="reliability-fleet-secret").start()
        lay = layout(block_bytes, "reliability/fleet")
        ns = store.register_namespace(Namespace(lay))
        hs = hashes(8, seed=81)
        store.put(ns, hs[:4], [payload(h, block_bytes) for h in hs[:4]])
        out["published_before"] = fleet.wait_published(10)
        redis.kill()
        redis.wait()
        wait_redis(up=False)
        t0 = time.monotonic()
        errors = []
        try:
            store.put(ns, hs[4:], [payload(h, block_bytes) for h in hs[4:]])
            got = store.get(ns, hs)
            out["store_exact_while_down"] = sum(is_exact(h, g, block_bytes) for h, g in zip(hs, got))
            out["fleet_lookup_while_down"] = fleet.lookup(ns, hs, lease=False).num_hit
            out["fleet_route_while_down"] = str(fleet.route(ns, hs))[:200]
        except Exception as e:  # noqa: BLE001 - the point is to see whether anything raises
            errors.append(f"{type(e).__name__}: {e}")
        out["seconds_while_down"] = round(time.monotonic() - t0, 3)
        out["errors_while_down"] = errors
        redis = start_redis()
        wait_redis()
        out["republished_after_restart"] = fleet.wait_published(20)
        time.sleep(3)
        out["fleet_stats"] = {k: v for k, v in fleet.stats().items() if not isinstance(v, (dict, list))}
    finally:
        if fleet is not None:
            with contextlib.suppress(Exception):
                fleet.close(unpublish=False)
        store.close()
        redis.kill()
        redis.wait()
    return out
