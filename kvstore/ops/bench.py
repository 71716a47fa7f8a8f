"""Service throughput, quoted against ceilings measured in the same run (``kvstore bench``).

For each block size: put and get GB/s over every transport (gRPC streams, the raw-TCP side
channel, shared memory), beside memcpy into distinct buffers (the shm ceiling) and a raw TCP
loopback socket with ``recv_into`` (the remote ceiling), each ceiling pass run right before the
pass it judges; ratios are medians of those per-pass ratios. Lookups per second, one chain per RPC
and batched. Without a URL a private daemon is started as a separate process
(kvstore.ops.local_daemon; client and daemon in one Python process would share one GIL and
measure that instead).

Numbers are medians of ``reps`` repetitions, GB = 1e9 bytes. The machine is usually shared and
noisy: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from collections.abc import Callable

import numpy as np

from kvstore.buffers import COPY_THREADS
from kvstore.ops.ceilings import GB, MemcpyPass, TcpPass
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import machine_facts


# -- measurements ------------------------------------------------------------------------------------

def _median_time(fn: Callable[[], None], reps: int, setup: Callable[[], None] | None = None) -> float:
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def service_gbps(client, ns_id: bytes, block_bytes: int, count: int, reps: int, tag: str,
                 ceiling, get_ceiling=None) -> dict:
    """Put and get ``count`` blocks ``reps`` times, each pass right after one ``ceiling`` pass
    (``get_ceiling`` for the gets when given: reading an arena larger than the caches is judged
    against copies whose sources are not in the caches either)."""
    get_ceiling = get_ceiling or ceiling
    from kvstore.keys import ChainHasher

    rng = np.random.default_rng(0)
    blocks = [rng.integers(0, 256, block_bytes, dtype=np.uint8) for _ in range(count)]
    outs = [np.zeros(block_bytes, dtype=np.uint8) for _ in range(count)]
    total = block_bytes * count
    puts, gets, put_ratio, get_ratio = [], [], [], []
    hashes: list[bytes] = []
    for r in range(reps + 1):  # pass 0 warms buffers and connections; not counted
        if hashes:
            client.delete(ns_id, hashes)
        # fresh hashes every pass: a put of blocks already present moves nothing
        hashes = ChainHasher(seed=r).chain(np.arange(count * 16) + (r + 1) * 7_000_003 + len(tag), 16)
        c_put = ceiling.bytes / ceiling()
        t = time.perf_counter()
        assert client.put(ns_id, hashes, blocks) == ["stored"] * count
        put_gbps = total / (time.perf_counter() - t) / GB
        c_get = get_ceiling.bytes / get_ceiling()
        t = time.perf_counter()
        assert client.get_into(ns_id, hashes, outs) == [block_bytes] * count
        get_gbps = total / (time.perf_counter() - t) / GB
        if r:
            puts.append(put_gbps)
            gets.append(get_gbps)
            put_ratio.append(put_gbps / (c_put / GB))
            get_ratio.append(get_gbps / (c_get / GB))
    ok = all(np.array_equal(o, b) for o, b in zip(outs, blocks))
    client.delete(ns_id, hashes)
    return {"put_gbps": statistics.median(puts), "get_gbps": statistics.median(gets),
            "put_vs_ceiling": statistics.median(put_ratio), "get_vs_ceiling": statistics.median(get_ratio),
            "ceiling_gbps": ceiling.bytes / statistics.median(ceiling() for _ in range(3)) / GB,
            "get_ceiling_gbps": get_ceiling.bytes / statistics.median(get_ceiling() for _ in range(3)) / GB,
            "verified": ok}


SMALL_REQUESTS = ((16, 64 << 10), (4, 1 << 20))   # (blocks, block bytes) per call: one request's load or save


def small_requests(address: str, token: str | None, calls: int = 100, rounds: int = 3) -> list[dict]:
    """Per-call latency of small same-host puts and gets (one request's blocks, as a connector
    loads or saves them each step), with the lease calls over the daemon's Unix socket and, in
    the same rounds, over gRPC (``Client(local_leases=False)``); beside the time memcpy takes for
    the same bytes between buffers larger than the caches. Rounds alternate the two clients;
    each figure is the median over rounds of the per-round median call, after a round that is not
    counted (it maps the arena pages the calls use into each client: first touches fault)."""
    from kvstore.client import Client
    from kvstore.keys import ChainHasher, KVLayout, Namespace

    ways = {"socket": Client(address, token=token, transport="shm", timeout_s=60),
            "grpc": Client(address, token=token, transport="shm", timeout_s=60, local_leases=False)}
    out = []
    try:
        for n, size in SMALL_REQUESTS:
            layout = KVLayout(model="bench-small", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                              block_tokens=16, block_bytes=size)
            rng = np.random.default_rng(1)
            blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
            outs = [np.zeros(size, dtype=np.uint8) for _ in range(n)]
            memcpy = MemcpyPass(size, working_set=max(256 << 20, 4 * n * size), cold_sources=True)
            per = {w: {"put": [], "get": []} for w in ways}
            verified = True
            seed = 0
            for counted in [False] + [True] * rounds:
                for way, c in ways.items():
                    ns_id = c.register_namespace(Namespace(layout, cache_salt="small"))
                    seed += 1
                    hashes = ChainHasher(seed=seed).chain(np.arange(calls * n * 16) + seed * 1_000_003, 16)
                    puts, gets = [], []
                    for k in range(calls):
                        batch = hashes[k * n:(k + 1) * n]
                        t = time.perf_counter()
                        c.put(ns_id, batch, blocks)
                        puts.append(time.perf_counter() - t)
                    for k in range(calls):
                        batch = hashes[k * n:(k + 1) * n]
                        t = time.perf_counter()
                        got = c.get_into(ns_id, batch, outs)
                        gets.append(time.perf_counter() - t)
                        verified &= got == [size] * n
                    verified &= all(np.array_equal(o, b) for o, b in zip(outs, blocks))
                    c.delete(ns_id, hashes)
                    if counted:
                        per[way]["put"].append(statistics.median(puts))
                        per[way]["get"].append(statistics.median(gets))
            memcpy_s = n * size / (memcpy.bytes / statistics.median(memcpy() for _ in range(3)))
            row = {"blocks": n, "block_bytes": size, "calls": calls, "rounds": rounds, "memcpy_ms": memcpy_s * 1e3,
                   "verified": bool(verified)}
            for way in ways:
                for op in ("put", "get"):
                    ms = statistics.median(per[way][op]) * 1e3
                    row[f"{way}_{op}_ms"] = ms
                    row[f"{way}_{op}_vs_memcpy"] = memcpy_s * 1e3 / ms
            out.append(row)
    finally:
        for c in ways.values():
            c.close()
    return out


def _grpcio_gbps(total_bytes: int, reps: int = 3) -> dict:
    """grpcio's own stream of the chunks kvstore's gRPC path sends (``kvstore.ops.grpc_ceiling``),
    up and down, medians of ``reps`` passes: the most the fallback could reach."""
    from kvstore.ops.grpc_ceiling import GrpcStreamPass
    from kvstore.transport.chunks import DEFAULT_CHUNK_BYTES

    out = {}
    for key, upload in (("grpcio_up_gbps", True), ("grpcio_down_gbps", False)):
        ceiling = GrpcStreamPass(DEFAULT_CHUNK_BYTES, max(1, total_bytes // DEFAULT_CHUNK_BYTES), upload)
        try:
            ceiling()   # warm-up
            out[key] = ceiling.bytes / statistics.median(ceiling() for _ in range(reps)) / GB
        finally:
            ceiling.close()
    return out


def _redis_gbps(block_bytes: int, count: int, reps: int, url: str = "redis://127.0.0.1:6379/0") -> dict | None:
    try:
        import redis

        r = redis.Redis.from_url(url, socket_timeout=30)
        r.ping()
    except Exception:  # noqa: BLE001 - Redis is an optional peer
        return None
    payload = np.random.default_rng(1).integers(0, 256, block_bytes, dtype=np.uint8).tobytes()
    keys = [f"kvstore-bench:{block_bytes}:{i}" for i in range(count)]

    def put() -> None:
        p = r.pipeline(transaction=False)
        for k in keys:
            p.set(k, payload)
        p.execute()

    def get() -> None:
        p = r.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        got = p.execute()
        assert got[0] == payload

    try:
        put_s = _median_time(put, reps)
        get_s = _median_time(get, reps)
    finally:
        r.delete(*keys)
    total = block_bytes * count
    return {"put_gbps": total / put_s / GB, "get_gbps": total / get_s / GB}


def _lookups_per_s(client, ns_id: bytes, seconds: float = 1.0) -> dict:
    from kvstore.keys import ChainHasher

    chain = ChainHasher(seed=99).chain(np.arange(64), 16)  # 4 blocks, absent: pure metadata cost
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        client.lookup(ns_id, chain)
        n += 1
    sequential = n / (time.perf_counter() - t0)
    batch = [chain] * 256
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        client.lookup_many(ns_id, batch)
        n += len(batch)
    batched = n / (time.perf_counter() - t0)
    return {"sequential_per_s": sequential, "batched_per_s": batched, "batch": len(batch)}


TRANSPORTS = ("grpc", "bulk", "shm")


def check_transports(transports) -> list[str]:
    """The transports asked for, or ``InvalidArgument`` naming the one that is not known."""
    from kvstore.errors import InvalidArgument

    for t in transports:
        if t not in TRANSPORTS:
            raise InvalidArgument("transports", f"{t!r} is not a transport; use some of {', '.join(TRANSPORTS)}")
    return list(transports)


def size_label(size: int) -> str:
    """A block size as the report shows it: ``1MiB``, ``64KiB``, ``976.56KiB`` (1 MB)."""
    from kvstore.units import format_size
    return format_size(size, "exact")


def _drop_namespaces(client, namespace_ids) -> None:
    """Unregister what the bench registered on a daemon it did not start (best effort: the blocks
    are deleted already; a daemon that refuses keeps an empty namespace)."""
    from kvstore.ops.admin_cli import drop_namespace

    for ns_id in namespace_ids:
        try:
            drop_namespace(client, ns_id)
        except Exception:  # noqa: BLE001 - cleanup must not hide the measurements
            pass


def run_bench(url: str | None = None, token: str | None = None, sizes=(1 << 20, 4 << 20, 16 << 20),
              total_bytes: int = 256 << 20, transports=TRANSPORTS, reps: int = 3,
              redis_url: str | None = "redis://127.0.0.1:6379/0", small: bool = False, steps=None) -> dict:
    """Measure everything; returns a JSON-able report (see ``format_report``). ``small``: also
    ``small_requests`` (needs 400 MiB of arena for its 1 MiB blocks). ``steps``: a
    ``kvstore.progress.Progress`` told each measurement as it begins."""
    from kvstore.client import Client
    from kvstore.keys import KVLayout, Namespace

    transports = check_transports(transports)
    say = steps.advance if steps is not None else (lambda _label: None)
    say("starting a private daemon" if not url else f"connecting to {url}")

    workdir = None if url else tempfile.mkdtemp(prefix="kvstore-bench-")
    daemon = None if url else start_local_daemon(
        workdir, "--cpu-slot-bytes", str(max(4096, min(min(sizes), 1 << 20))), "--log-level", "WARNING", nvme_bytes="0",
        cpu_bytes=str(max(sizes) * 8 + 2 * total_bytes + (64 << 20)), timeout=120)
    address = url or daemon.address
    report: dict = {"machine": machine_facts(), "daemon": "external " + url if url else "private child process",
                    "total_bytes_per_measurement": total_bytes, "reps": reps, "sizes": {}}
    try:
        clients = {}
        for t in transports:
            c = Client(address, token=token, transport=t, timeout_s=60)
            if c.active_transport != t:
                report.setdefault("skipped", []).append(f"{t}: not available ({c.active_transport} negotiated)")
                c.close()
                continue
            clients[t] = c
        registered: dict = {}   # client -> namespace ids it registered (dropped at the end)
        for size in sizes:
            count = max(2, total_bytes // size)
            layout = KVLayout(model="bench", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                              block_tokens=16, block_bytes=size)
            memcpy = MemcpyPass(size, working_set=size * count)
            memcpy_cold = MemcpyPass(size, working_set=size * count, cold_sources=True)
            tcp = TcpPass(size, count)
            row: dict = {"count": count}
            try:
                for t, c in clients.items():
                    say(f"{size_label(size)} blocks over {t}")
                    ns_id = c.register_namespace(Namespace(layout, cache_salt="bench"))
                    registered.setdefault(t, []).append(ns_id)
                    row[t] = service_gbps(c, ns_id, size, count, reps, tag=t, ceiling=memcpy if t == "shm" else tcp,
                                          get_ceiling=memcpy_cold if t == "shm" else None)
                say(f"{size_label(size)} ceilings (memcpy, raw TCP)")
                row["memcpy_gbps"] = memcpy.bytes / statistics.median(memcpy() for _ in range(3)) / GB
                row["memcpy_cold_gbps"] = memcpy_cold.bytes / statistics.median(memcpy_cold() for _ in range(3)) / GB
                if COPY_THREADS > 1:   # what the shm path's copy threads could reach together
                    several = MemcpyPass(size, working_set=size * count, cold_sources=True, threads=COPY_THREADS)
                    row["copy_threads"] = COPY_THREADS
                    row["memcpy_cold_threads_gbps"] = several.bytes / statistics.median(several() for _ in range(3)) / GB
                row["tcp_gbps"] = tcp.bytes / statistics.median(tcp() for _ in range(3)) / GB
                if "grpc" in row:
                    row.update(_grpcio_gbps(count * size))
                    row["grpc_put_vs_grpcio"] = row["grpc"]["put_gbps"] / row["grpcio_up_gbps"]
                    row["grpc_get_vs_grpcio"] = row["grpc"]["get_gbps"] / row["grpcio_down_gbps"]
            finally:
                tcp.close()
            if redis_url:
                row["redis"] = _redis_gbps(size, count, reps, redis_url)
            if "shm" in row:
                row["shm_get_vs_memcpy"] = row["shm"]["get_vs_ceiling"]
                row["shm_put_vs_memcpy"] = row["shm"]["put_vs_ceiling"]
            for t in ("grpc", "bulk"):
                if t in row:
                    row[f"{t}_get_vs_tcp"] = row[t]["get_vs_ceiling"]
                    row[f"{t}_put_vs_tcp"] = row[t]["put_vs_ceiling"]
            report["sizes"][str(size)] = row
        if clients:
            say("lookups")
            c = next(iter(clients.values()))
            ns_id = c.register_namespace(Namespace(KVLayout(model="bench", num_layers=1, num_kv_heads=1, head_dim=1,
                                                            dtype="uint8", block_tokens=16), cache_salt="lookup"))
            report["lookups"] = _lookups_per_s(c, ns_id)
            registered.setdefault(next(iter(clients)), []).append(ns_id)
        if small and "shm" in clients:
            say("small requests")
            report["small_requests"] = small_requests(address, token)
        for t, c in clients.items():
            if url:   # a daemon the bench did not start is left with no namespace of the bench's
                _drop_namespaces(c, dict.fromkeys(registered.get(t, [])))
            c.close()
    finally:
        if daemon is not None:
            daemon.stop(timeout=30)
            shutil.rmtree(workdir, ignore_errors=True)
    return report


def format_report(report: dict) -> str:
    lines = [f"kvstore bench ({report['daemon']}; {report['machine']['cores']} cores, "
             f"load {report['machine']['load_avg_1m']:.1f}; medians of {report['reps']})", ""]
    head = f"{'block':>9} {'path':<6} {'put GB/s':>9} {'get GB/s':>9}  vs the ceiling named (median of per-pass ratios)"
    lines.append(head)
    for size, row in report["sizes"].items():
        label = size_label(int(size))
        lines.append(f"{label:>9} ceilings: memcpy {row['memcpy_gbps']:.2f} GB/s, memcpy from cold sources "
                     f"{row['memcpy_cold_gbps']:.2f} GB/s, raw TCP {row['tcp_gbps']:.2f} GB/s")
        for t in ("shm", "bulk", "grpc", "redis"):
            r = row.get(t)
            if not r:
                continue
            if t == "shm":
                ceil = (f"put {row['shm_put_vs_memcpy']:.2f}x memcpy, "
                        f"get {row['shm_get_vs_memcpy']:.2f}x memcpy from cold sources")
            elif t == "redis":
                ceil = "a peer (redis-py pipeline), no ratio"
            else:
                ceil = f"put {row[f'{t}_put_vs_tcp']:.2f}x, get {row[f'{t}_get_vs_tcp']:.2f}x raw TCP"
            lines.append(f"{label:>9} {t:<6} {r['put_gbps']:>9.2f} {r['get_gbps']:>9.2f}  {ceil}")
    if "lookups" in report:
        lk = report["lookups"]
        lines += ["", f"lookups: {lk['sequential_per_s']:,.0f}/s one chain per RPC, "
                      f"{lk['batched_per_s']:,.0f}/s batched ({lk['batch']} chains per RPC)"]
    for r in report.get("small_requests", []):
        lines.append(f"small shm requests, {r['blocks']} x {r['block_bytes'] >> 10} KiB: put / get "
                     f"{r['socket_put_ms']:.2f} / {r['socket_get_ms']:.2f} ms (lease calls over gRPC: "
                     f"{r['grpc_put_ms']:.2f} / {r['grpc_get_ms']:.2f} ms; memcpy {r['memcpy_ms']:.2f} ms)")
    for s in report.get("skipped", []):
        lines.append(f"skipped {s}")
    return "\n".join(lines)
