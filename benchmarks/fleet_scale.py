"""Fleet directory at scale, simulated in the real Redis (no block bytes move).

A fleet of ``--nodes`` daemons serves one model (one namespace: the worst case, every key in one
Redis Cluster slot). Conversations are prefix chains of 32..1024 blocks (512..16k tokens at 16
tokens per block) with Zipf popularity; each node holds leading runs of the chains it served, until
it holds ``--blocks-per-node`` blocks. Everything goes through the production code paths
(``Directory.publish`` for publishing, ``Directory.route`` for routing).

Measures: Redis memory per directory entry and per million blocks (INFO used_memory before/after,
and MEMORY USAGE of one node's hash), publish and withdraw rates (entries/s, one client thread),
route latency p50/p99 for realistic prompt lengths as the caller sees it and as Redis spends it
(INFO commandstats), the worst case (a 1024-block prompt cached on every node), heartbeat cost,
and from those, what breaks first. Every key is deleted afterwards.

    .venv/bin/python benchmarks/fleet_scale.py [--redis redis://127.0.0.1:6379/0] [--nodes 100] [--blocks-per-node 10000]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import uuid

import numpy as np
import xxhash

from kvstore.fleet import Directory, pack_entry
from kvstore.ops.machine import machine_facts
from kvstore.ops.report import machine_line

NS = xxhash.xxh3_128_digest(b"fleet-scale-namespace")
BLOCK_TOKENS = 16


def block_hash(chain: int, i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(4, "little"), seed=chain)


def pct(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q))


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def used_memory(r) -> int:
    return int(r.info("memory")["used_memory"])


def redis_usec(r, command: str) -> tuple[int, int]:
    """(calls, microseconds) Redis has spent on ``command`` so far (INFO commandstats)."""
    s = r.info("commandstats").get(f"cmdstat_{command}", {"calls": 0, "usec": 0})
    return int(s["calls"]), int(s["usec"])


def build_fleet(rng, nodes: int, blocks_per_node: int, chains: int):
    lengths = rng.integers(32, 1025, size=chains)
    popularity = 1.0 / np.arange(1, chains + 1) ** 1.1
    popularity /= popularity.sum()
    held: list[list[tuple[int, int]]] = []  # per node: (chain, leading blocks held)
    for _ in range(nodes):
        mine, total, seen = [], 0, set()
        while total < blocks_per_node:
            c = int(rng.choice(chains, p=popularity))
            if c in seen:
                continue
            seen.add(c)
            run = int(min(lengths[c], max(1, rng.integers(lengths[c] // 4, lengths[c] + 1)),
                          blocks_per_node - total))
            mine.append((c, run))
            total += run
        held.append(mine)
    return lengths, popularity, held


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--redis", default=os.environ.get("KVSTORE_FLEET_REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--own-redis", action="store_true",
                   help="start a private redis-server on a free loopback port (clean memory figures)")
    p.add_argument("--nodes", type=int, default=100)
    p.add_argument("--blocks-per-node", type=int, default=10_000)
    p.add_argument("--chains", type=int, default=3000)
    p.add_argument("--routes", type=int, default=1000)
    p.add_argument("--batch", type=int, default=1024, help="entries per publish pipeline (one flusher batch)")
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "fleet_scale"))
    args = p.parse_args(argv)

    server = None
    if args.own_redis:
        server, args.redis = start_private_redis()
    try:
        return run(args)
    finally:
        if server is not None:
            server.kill()
            server.wait()


def start_private_redis():
    import shutil
    import socket
    import subprocess

    import redis
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--bind", "127.0.0.1", "--port", str(port),
                             "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    for _ in range(200):
        try:
            redis.Redis(port=port).ping()
            return proc, f"redis://127.0.0.1:{port}/0"
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError("private redis-server did not start")


def run(args) -> int:
    prefix = f"kvsbench-{uuid.uuid4().hex[:8]}"
    d = Directory(args.redis, prefix, socket_timeout_s=30, secret=uuid.uuid4().hex)   # signs like a daemon
    r = d.redis
    rng = np.random.default_rng(7)
    results: dict = {"machine": machine_facts(), "redis_version": r.info("server")["redis_version"],
                     "load_average_at_start": [round(x, 2) for x in os.getloadavg()],
                     "niceness": os.nice(0), "private_redis": args.own_redis,
                     "config": {**vars(args), "block_tokens": BLOCK_TOKENS, "key_prefix": prefix}}
    try:
        lengths, popularity, held = build_fleet(rng, args.nodes, args.blocks_per_node, args.chains)
        entries = sum(run for mine in held for _, run in mine)
        hashes = {c: [block_hash(c, i) for i in range(int(lengths[c]))] for c in range(args.chains)}

        # -- publish -------------------------------------------------------------------------
        mem0 = used_memory(r)
        slots = [d.join(NS, f"node{n:03d}", f"10.0.{n // 250}.{n % 250}:7373", 600) for n in range(args.nodes)]
        pub_calls0, pub_usec0 = redis_usec(r, "evalsha")
        t0 = time.perf_counter()
        for n, mine in enumerate(held):
            batch: dict[bytes, bytes] = {}
            for c, run in mine:
                for h in hashes[c][:run]:
                    batch[h] = pack_entry(int.from_bytes(h[:8], "little"), "cpu" if rng.random() < 0.7 else "nvme")
                    if len(batch) >= args.batch:
                        d.publish(NS, slots[n], batch)
                        batch = {}
            if batch:
                d.publish(NS, slots[n], batch)
        publish_s = time.perf_counter() - t0
        pub_calls1, pub_usec1 = redis_usec(r, "evalsha")
        mem1 = used_memory(r)
        # ceiling: plain pipelined HSETs of as many fresh fields as the holders hash got, in Redis time
        scratch = f"{prefix}:{{ceiling}}:hset"
        hs0 = redis_usec(r, "hset")[1]
        sample = [block_hash(7_777_777, i) for i in range(100_000)]
        for i in range(0, len(sample), args.batch):
            pipe = r.pipeline(transaction=False)
            for h in sample[i:i + args.batch]:
                pipe.hset(scratch, h, h + h[:1])
            pipe.execute()
        hset_us = (redis_usec(r, "hset")[1] - hs0) / len(sample)
        r.unlink(scratch)
        holders = d.holders_key(NS)
        distinct = int(r.hlen(holders))
        usage = int(r.memory_usage(holders, samples=0))
        results["publish"] = {
            "entries": entries, "distinct_blocks": distinct, "seconds": round(publish_s, 2),
            "entries_per_s": round(entries / publish_s),
            "redis_us_per_entry": round((pub_usec1 - pub_usec0) / entries, 2),
            "ceiling_plain_hset_redis_us_per_field": round(hset_us, 2),
            "publish_over_plain_hset": round((pub_usec1 - pub_usec0) / entries / hset_us, 2),
            "redis_used_memory_delta_bytes": mem1 - mem0,
            "bytes_per_entry_info": round((mem1 - mem0) / entries, 1),
            "bytes_per_distinct_block_info": round((mem1 - mem0) / distinct, 1),
            "bytes_per_distinct_block_memory_usage": round(usage / distinct, 1),
            "mib_per_million_entries": round((mem1 - mem0) / entries * 1e6 / 2**20, 1),
            "mib_per_million_distinct_blocks": round((mem1 - mem0) / distinct * 1e6 / 2**20, 1),
            "holders_encoding": _text(r.object("encoding", holders)),
        }
        print(json.dumps(results["publish"]), flush=True)

        # -- route: realistic prompts (a popular conversation, whole or cut short) ----------------
        route = {}
        ceiling_key = f"{prefix}:{{ceiling}}:empty"   # a bare HMGET of the same hashes, no parsing work
        for label, cap in (("64 blocks (1k tokens)", 64), ("256 blocks (4k tokens)", 256),
                           ("1024 blocks (16k tokens)", 1024)):
            lat, cpu, holders, served, bare = [], [], [], [], []
            calls0, usec0 = redis_usec(r, "hmget")
            for _ in range(args.routes):
                c = int(rng.choice(args.chains, p=popularity))
                q = hashes[c][:cap]
                if len(q) < cap:  # extend with a fresh tail: the part nobody has computed yet
                    q = q + [block_hash(10**6 + c, i) for i in range(cap - len(q))]
                t, c0 = time.perf_counter(), time.thread_time()
                routes = d.route(NS, q, BLOCK_TOKENS)
                lat.append((time.perf_counter() - t) * 1e6)
                cpu.append((time.thread_time() - c0) * 1e6)
                t = time.perf_counter()   # the ceiling, interleaved so it sees the same load
                r.hmget(ceiling_key, q)
                bare.append((time.perf_counter() - t) * 1e6)
                holders.append(len(routes))
                served.append(routes[0].blocks if routes else 0)
            calls1, usec1 = redis_usec(r, "hmget")
            calls1 -= args.routes                      # the ceiling's HMGETs, on an empty key:
            route[label] = {"p50_us": round(pct(lat, 50)), "p99_us": round(pct(lat, 99)),
                            "max_us": round(max(lat)),
                            "redis_us_per_route_incl_ceiling": round((usec1 - usec0) / args.routes, 1),
                            "ceiling_hmget_p50_us": round(pct(bare, 50)), "ceiling_hmget_p99_us": round(pct(bare, 99)),
                            "route_over_ceiling_p50": round(pct(lat, 50) / pct(bare, 50), 2),
                            "route_over_ceiling_p99": round(pct(lat, 99) / pct(bare, 99), 2),
                            "client_cpu_us_p50": round(pct(cpu, 50)), "client_cpu_us_p99": round(pct(cpu, 99)),
                            "hmget_calls_per_route": round((calls1 - calls0) / args.routes, 2),
                            "mean_holders": round(statistics.mean(holders), 1),
                            "max_holders": max(holders),
                            "mean_best_blocks": round(statistics.mean(served), 1)}
            print(label, json.dumps(route[label]), flush=True)
        results["route"] = route

        # -- worst case: one 1024-block prompt cached in full on every node ------------------------
        hot = [block_hash(999_999, i) for i in range(1024)]
        for n in range(args.nodes):
            d.publish(NS, slots[n], {h: pack_entry(1, "cpu") for h in hot})
        lat, cpu = [], []
        calls0, usec0 = redis_usec(r, "hmget")
        for _ in range(50):
            t, c0 = time.perf_counter(), time.thread_time()
            routes = d.route(NS, hot, BLOCK_TOKENS)
            lat.append((time.perf_counter() - t) * 1e6)
            cpu.append((time.thread_time() - c0) * 1e6)
        calls1, usec1 = redis_usec(r, "hmget")
        assert len(routes) == args.nodes and routes[0].blocks == 1024
        results["route_worst_case"] = {"description": f"1024-block prompt held in full by all {args.nodes} nodes",
                                       "p50_us": round(pct(lat, 50)), "p99_us": round(pct(lat, 99)),
                                       "redis_us_per_route": round((usec1 - usec0) / 50, 1),
                                       "client_cpu_us_p50": round(pct(cpu, 50)), "client_cpu_us_p99": round(pct(cpu, 99))}
        print("worst", json.dumps(results["route_worst_case"]), flush=True)

        # -- heartbeat: every node refreshes its TTLs (what _heartbeat sends) -----------------------
        t = time.perf_counter()
        reps = 20
        for _ in range(reps):
            for n in range(args.nodes):
                assert d.heartbeat([(NS, slots[n])], f"node{n:03d}", f"10.0.{n // 250}.{n % 250}:7373", 600) == [True]
        results["heartbeat"] = {"fleet_round_ms": round((time.perf_counter() - t) / reps * 1e3, 2),
                                "calls_per_node_per_beat": 1}

        # -- withdraw (eviction churn) --------------------------------------------------------------
        victims = []
        for c, run in held[0]:
            victims.extend(hashes[c][:run])
        t = time.perf_counter()
        for i in range(0, len(victims), args.batch):
            d.publish(NS, slots[0], dict.fromkeys(victims[i:i + args.batch]))
        dt = time.perf_counter() - t
        results["withdraw"] = {"entries": len(victims), "entries_per_s": round(len(victims) / dt)}

        # -- janitor: node001 dies; one sweep clears its bits across the whole holders hash ----------
        r.hset(d.nodes_key(NS), str(slots[1]), "1 node001 x:1")
        sw_calls0, sw_usec0 = redis_usec(r, "evalsha")
        t = time.perf_counter()
        cleared = d.sweep(NS, grace_s=0)
        dt = time.perf_counter() - t
        sw_calls1, sw_usec1 = redis_usec(r, "evalsha")
        results["sweep"] = {"fields_scanned": distinct, "entries_cleared": cleared, "seconds": round(dt, 2),
                            "seconds_per_million_fields": round(dt / distinct * 1e6, 2),
                            "redis_us_per_field": round((sw_usec1 - sw_usec0) / distinct, 2)}

        # -- what breaks first ----------------------------------------------------------------------
        per_block = results["publish"]["bytes_per_distinct_block_info"]
        results["limits"] = {
            "distinct_blocks_in_2GiB": int(2 * 2**30 / per_block),
            "publish_entries_per_s_one_client": results["publish"]["entries_per_s"],
        }
    finally:
        keys = list(r.scan_iter(match=f"{prefix}:*", count=1000))
        for i in range(0, len(keys), 500):
            for k in keys[i:i + 500]:
                r.unlink(k)
        results["cleanup_keys_deleted"] = len(keys)
        results["redis_used_memory_after_cleanup"] = used_memory(r)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump(results, f, indent=2)
    write_markdown(results, args.out + ".md")
    print(f"wrote {args.out}.json and .md")
    return 0


def write_markdown(res: dict, path: str) -> None:
    m, pub = res["machine"], res["publish"]
    lines = [
        "# Fleet directory at scale (simulated, real Redis)",
        "",
        machine_line(m, load=(res["load_average_at_start"],)) + " (the machine is shared: absolute latencies are "
        f"inflated when it is busy; Redis' own time per call is the steadier figure); {m['time_utc']}. "
        f"Redis {res['redis_version']} on the same machine (loopback, "
        f"{'a private instance' if res['private_redis'] else 'the shared instance'}; benchmark and Redis at "
        f"niceness {res['niceness']}).",
        f"Fleet: {res['config']['nodes']} nodes x {res['config']['blocks_per_node']} blocks, one namespace, "
        f"{res['config']['chains']} Zipf-popular prefix chains of 32..1024 blocks ({BLOCK_TOKENS} tokens/block).",
        "Produced by `python benchmarks/fleet_scale.py`; one client thread; every key deleted afterwards.",
        "",
        "## Memory and publishing",
        "An *entry* is one (node, block) pair; a *distinct block* is one field of the holders hash (all its holders).",
        "",
        "| entries | distinct blocks | Redis memory delta | bytes/entry | bytes/distinct block (INFO / MEMORY USAGE) | MiB per million entries | MiB per million distinct blocks | publish entries/s | withdraw entries/s |",
        "|---|---|---|---|---|---|---|---|---|",
        f"| {pub['entries']:,} | {pub['distinct_blocks']:,} | {pub['redis_used_memory_delta_bytes'] / 2**20:.1f} MiB | "
        f"{pub['bytes_per_entry_info']} | {pub['bytes_per_distinct_block_info']} / {pub['bytes_per_distinct_block_memory_usage']} | "
        f"{pub['mib_per_million_entries']} | {pub['mib_per_million_distinct_blocks']} | {pub['entries_per_s']:,} | "
        f"{res['withdraw']['entries_per_s']:,} |",
        "",
        f"Redis time spent publishing: {pub['redis_us_per_entry']} us per entry (INFO commandstats), i.e. one Redis core "
        f"could absorb about {int(1e6 / max(pub['redis_us_per_entry'], 0.01)):,} entries/s from the whole fleet. "
        f"Ceiling: a plain pipelined HSET of a fresh field cost {pub['ceiling_plain_hset_redis_us_per_field']} us "
        f"of Redis time in the same run; publishing costs {pub['publish_over_plain_hset']}x that.",
        "",
        "## Route latency",
        "Wall time as the caller sees it (p50/p99/max); the caller's own CPU time (redis-py + parsing + bit math); "
        "the ceiling: a bare redis-py HMGET of the same hashes (on an empty key, so no reply data), interleaved "
        "with the routes so that both see the same machine load; the ratio route / ceiling; and Redis' own time "
        "in HMGET per route (INFO commandstats; the ceiling's HMGET included, the worst case has none).",
        "",
        "| prompt | wall p50 / p99 / max us | client CPU p50 / p99 us | ceiling HMGET p50 / p99 us | route / ceiling p50, p99 | Redis HMGET us per route | mean nodes returned | max nodes | mean best prefix (blocks) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for label, v in res["route"].items():
        lines.append(f"| {label} | {v['p50_us']} / {v['p99_us']} / {v['max_us']} | "
                     f"{v['client_cpu_us_p50']} / {v['client_cpu_us_p99']} | "
                     f"{v['ceiling_hmget_p50_us']} / {v['ceiling_hmget_p99_us']} | "
                     f"{v['route_over_ceiling_p50']}, {v['route_over_ceiling_p99']} | "
                     f"{v['redis_us_per_route_incl_ceiling']} | {v['mean_holders']} | {v['max_holders']} | {v['mean_best_blocks']} |")
    w = res["route_worst_case"]
    lines += [
        f"| worst case: {w['description']} | {w['p50_us']} / {w['p99_us']} / - | "
        f"{w['client_cpu_us_p50']} / {w['client_cpu_us_p99']} | - | - | {w['redis_us_per_route']} | "
        f"{res['config']['nodes']} | {res['config']['nodes']} | 1024 |",
        "",
        f"Heartbeats of the whole fleet (one script call per node and namespace, sent one node after another): "
        f"{res['heartbeat']['fleet_round_ms']} ms.",
        f"Janitor sweep after a node died: {res['sweep']['fields_scanned']:,} fields scanned, "
        f"{res['sweep']['entries_cleared']:,} entries cleared in {res['sweep']['seconds']} s "
        f"({res['sweep']['seconds_per_million_fields']} s per million fields wall, "
        f"{res['sweep']['redis_us_per_field']} us of Redis time per field, in bounded script calls).",
        "",
        "## Limits derived from these numbers",
        f"- Distinct blocks in 2 GiB of Redis: {res['limits']['distinct_blocks_in_2GiB']:,} (any number of holders each, up to ~100 nodes).",
        f"- Publish capacity of one client thread: {res['limits']['publish_entries_per_s_one_client']:,} entries/s.",
    ]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    raise SystemExit(main())
