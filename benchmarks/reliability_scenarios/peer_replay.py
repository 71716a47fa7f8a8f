"""Trust scenario of issue 35, attack 7: a departed fleet node's signed entry, written back to the
directory by someone who can write Redis, with a real gRPC server of theirs on the node's port.

Per round: node d1 (auth on, the peer token is tenant t's token) stores blocks and publishes them;
the attacker saves d1's signed entry and its blocks' signed checksums; d1 stops cleanly; the thief
binds d1's port, the saved values are written back (``tombstone kept``), or written back and d1's
tombstone deleted too (``tombstone deleted``). A victim daemon then misses on those blocks. The
counts: calls the thief got, secrets in what it got, blocks the victim kept from it, the thief's
captured proofs replayed byte for byte to an honest daemon and refused, and the honest node still
serving the victim. A private redis-server; every daemon a real ``kvstore serve``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import textwrap
import time

import grpc

from kvstore import Namespace
from kvstore.fleet import Directory
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.forging_peer import ForgingPeer, replay

from .common import KiB, Unsupported, hashes, is_exact, layout, payload

PEER_TOKEN = "reliability-peer-token-of-tenant-t"
SECRET = "reliability-fleet-secret-0123456789"
BLOCK = 16 * KiB


def _node(workdir: str, redis_url: str, prefix: str, node_id: str):
    os.makedirs(workdir, exist_ok=True)
    config = os.path.join(workdir, "kvstore.yaml")
    with open(config, "w") as f:
        f.write(textwrap.dedent(f"""
            cpu_bytes: 16MiB
            cpu_slot_bytes: 16KiB
            nvme_bytes: 0
            shm_dir: {workdir}
            bulk_channel: false
            tokens:
              {PEER_TOKEN}: t
            admin_tenants: [t]
            fleet:
              enabled: true
              redis_url: {redis_url}
              node_id: {node_id}
              key_prefix: {prefix}
              heartbeat_s: 0.2
              ttl_s: 30
              peer_timeout_s: 2.0
              peer_token: {PEER_TOKEN}
        """))
    return start_local_daemon(workdir, "--config", config, cpu_bytes="16MiB", nvme_bytes="0",
                              env={"KVSTORE_FLEET__SECRET": SECRET}, client_kwargs={"token": PEER_TOKEN})


def _wait(cond, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return False


def peer_replay(workdir: str, rounds: int = 3) -> dict:
    if shutil.which("redis-server") is None:
        raise Unsupported("redis-server is not installed")
    import redis

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        redis_port = s.getsockname()[1]
    server = subprocess.Popen(["redis-server", "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    r = redis.Redis.from_url(redis_url)
    _wait(lambda: _pings(r))
    prefix = "replay"
    ns = Namespace(layout(BLOCK, "reliability/peer-replay"), tenant="t")
    directory = Directory(redis_url, prefix, secret=SECRET)
    nodes_key, holders_key = directory.nodes_key(ns.id), directory.holders_key(ns.id)
    out: dict = {"rounds": rounds, "modes": {}}
    started = []
    try:
        victim = _node(os.path.join(workdir, "victim"), redis_url, prefix, "victim")
        honest = _node(os.path.join(workdir, "honest"), redis_url, prefix, "honest")
        started += [victim, honest]
        cv, ch = victim.client(transport="grpc"), honest.client(transport="grpc")
        cv.register_namespace(ns)
        ch.register_namespace(ns)
        for mode in ("tombstone kept", "tombstone deleted"):
            m = {"thief_calls": 0, "secrets_seen": 0, "blocks_kept_from_thief": 0, "proofs_replayed": 0,
                 "replays_refused": 0, "honest_blocks_fetched": 0, "blocks_asked": 0}
            for i in range(rounds):
                seed = 1000 * (mode == "tombstone deleted") + i
                hs = hashes(4, seed=900 + seed)
                blocks = [payload(h, BLOCK) for h in hs]
                d1 = _node(os.path.join(workdir, f"d1-{seed}"), redis_url, prefix, f"d1-{seed}")
                started.append(d1)
                with d1.client(transport="grpc") as c1:
                    c1.register_namespace(ns)
                    c1.put(ns.id, hs, blocks)
                    _wait(lambda: directory.entries(ns.id, f"d1-{seed}") == len(hs))
                saved_nodes = r.hgetall(nodes_key)
                saved_holders = dict(zip(hs, r.hmget(holders_key, hs)))
                address = f"127.0.0.1:{d1.port}"
                d1.stop()
                thief = ForgingPeer({h: b.tobytes() for h, b in zip(hs, blocks)}, ns.id, BLOCK, address)
                try:
                    for field, value in saved_nodes.items():
                        r.hset(nodes_key, field, value)
                    for h, value in saved_holders.items():
                        if value is not None:
                            r.hset(holders_key, h, value)
                    if mode == "tombstone deleted":
                        r.delete(directory.revoked_key(ns.id))
                    got = cv.get(ns.id, hs) if cv.lookup(ns.id, hs).num_hit else []
                    m["blocks_asked"] += len(hs)
                    m["blocks_kept_from_thief"] += sum(g is not None and is_exact(h, g, BLOCK)
                                                       for h, g in zip(hs, got))
                    m["thief_calls"] += len(thief.calls)
                    m["secrets_seen"] += sum(PEER_TOKEN in str(meta) or SECRET in str(meta)
                                             for _, meta, _ in thief.calls)
                    with grpc.insecure_channel(f"127.0.0.1:{honest.port}") as channel:
                        for method, meta, request in thief.calls:
                            m["proofs_replayed"] += 1
                            m["replays_refused"] += replay(channel, method, meta, request) == \
                                grpc.StatusCode.UNAUTHENTICATED
                finally:
                    thief.stop()
                ch.put(ns.id, hs, blocks)
                _wait(lambda: any(x.node_id == "honest" and x.blocks == len(hs) for x in directory.route(ns.id, hs)))
                if cv.lookup(ns.id, hs).num_hit == len(hs):
                    m["honest_blocks_fetched"] += sum(is_exact(h, g, BLOCK) for h, g in zip(hs, cv.get(ns.id, hs)))
                d1.kill()
            counters = cv.stats()["fleet"]["counters"]
            m["victim_counters"] = {k: counters.get(k, 0) for k in ("rejected_revoked", "peer_unproven",
                                                                      "peer_errors", "fetched_blocks")}
            m["honest_peer_proofs_refused"] = ch.stats()["fleet"]["counters"].get("peer_proofs_refused", 0)
            out["modes"][mode] = m
        cv.close()
        ch.close()
        out["ok"] = all(m["secrets_seen"] == 0 and m["blocks_kept_from_thief"] == 0
                        and m["replays_refused"] == m["proofs_replayed"]
                        and m["honest_blocks_fetched"] == m["blocks_asked"] for m in out["modes"].values()) \
            and out["modes"]["tombstone kept"]["thief_calls"] == 0 \
            and out["modes"]["tombstone deleted"]["thief_calls"] > 0
    finally:
        for d in started:
            d.kill()
        server.kill()
        server.wait()
    return out


def _pings(r) -> bool:
    try:
        return bool(r.ping())
    except Exception:  # noqa: BLE001 - not up yet
        return False
