"""Service throughput, quoted against ceilings measured in the same run (``kvstore bench``).

For each block size: put and get GB/s over every transport (gRPC streams, the raw-TCP side
channel, shared memory), beside memcpy into distinct buffers (the shm ceiling) and a raw TCP
loopback socket with ``recv_into`` (the remote ceiling), each ceiling pass run right before the
pass it judges; ratios are medians of those per-pass ratios. Lookups per second, one chain per RPC
and batched. Without a
URL a private daemon is started as a separate process (client and daemon in one Python process
would share one GIL and measure that instead).

Numbers are medians of ``reps`` repetitions, GB = 1e9 bytes. The machine is usually shared and
noisy: read the ratios, not the absolute figures.
"""

from __future__ import annotations

import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable

import numpy as np

GB = 1e9


# -- ceilings, as passes that can be interleaved with the code they judge ------------------------
# A pass object runs one timed pass per call and returns its seconds; ``bytes`` is what one pass
# moves. Interleaving ceiling and service passes, and taking the median of per-pass ratios, keeps
# the ratio honest on a shared machine whose speed changes from one second to the next.

class MemcpyPass:
    """``count`` numpy copies of ``nbytes`` into distinct destinations (a ``working_set``-byte
    region, as a get fills distinct output buffers), from a small pool of sources. Used when
    benchmarks/ceilings.py is not importable (an installed kvstore)."""

    def __init__(self, nbytes: int, count: int | None = None, working_set: int | None = None) -> None:
        slots = max(1, (working_set or nbytes) // nbytes)
        self.srcs = [np.full(nbytes, i, dtype=np.uint8) for i in range(8)]
        dst = np.ones(slots * nbytes, dtype=np.uint8)
        self.dsts = [dst[i * nbytes:(i + 1) * nbytes] for i in range(slots)]
        self.count = count or max(slots, (256 << 20) // nbytes)
        self.bytes = nbytes * self.count

    def __call__(self) -> float:
        t = time.perf_counter()
        for i in range(self.count):
            np.copyto(self.dsts[i % len(self.dsts)], self.srcs[i % len(self.srcs)])
        return time.perf_counter() - t


class TcpPass:
    """``count`` messages of ``nbytes`` over one TCP loopback connection, sent from and received
    into distinct, already-touched buffers (``count * nbytes`` each side, like a get that reads
    distinct blocks into distinct outputs): what a perfect remote data path could do on this
    machine at this moment. One pass = one call."""

    def __init__(self, nbytes: int, count: int) -> None:
        self.nbytes, self.count, self.bytes = nbytes, count, nbytes * count
        self._srv = socket.create_server(("127.0.0.1", 0))
        self._go = threading.Semaphore(0)
        self._stop = False
        src = memoryview(np.ones(nbytes * count, dtype=np.uint8)).cast("B")
        payloads = [src[i * nbytes:(i + 1) * nbytes] for i in range(count)]
        port = self._srv.getsockname()[1]

        def sender() -> None:
            with socket.create_connection(("127.0.0.1", port)) as c:
                c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                while True:
                    self._go.acquire()
                    if self._stop:
                        return
                    for payload in payloads:
                        c.sendall(payload)

        self._thread = threading.Thread(target=sender, daemon=True)
        self._thread.start()
        self._conn, _ = self._srv.accept()
        sink = memoryview(np.zeros(nbytes * count, dtype=np.uint8)).cast("B")
        self._sinks = [sink[i * nbytes:(i + 1) * nbytes] for i in range(count)]

    def __call__(self) -> float:
        self._go.release()
        t = time.perf_counter()
        for dst in self._sinks:
            got = 0
            while got < self.nbytes:
                k = self._conn.recv_into(dst[got:], self.nbytes - got)
                if k == 0:
                    raise ConnectionError("ceiling sender closed")
                got += k
        return time.perf_counter() - t

    def close(self) -> None:
        self._stop = True
        self._go.release()
        self._thread.join(10)
        self._conn.close()
        self._srv.close()


# -- the daemon under test -------------------------------------------------------------------------

class _PrivateDaemon:
    """``kvstore serve`` in a child process on an ephemeral port, for the duration of a run."""

    def __init__(self, cpu_bytes: int) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvstore-bench-")
        ready = os.path.join(self.dir, "ready.json")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSTORE_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.ops.cli", "serve", "--listen", "127.0.0.1:0", "--cpu-bytes", str(cpu_bytes),
             "--cpu-slot-bytes", "1MiB", "--nvme-bytes", "0", "--nvme-path", os.path.join(self.dir, "nvme"),
             "--ready-file", ready, "--log-level", "WARNING"],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"bench daemon did not start: {self.proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
        import json
        with open(ready) as f:
            self.address = json.load(f)["address"]

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        import shutil
        shutil.rmtree(self.dir, ignore_errors=True)


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


def _service_gbps(client, ns_id: bytes, block_bytes: int, count: int, reps: int, tag: str,
                  ceiling) -> dict:
    """Put and get ``count`` blocks ``reps`` times, each pass right after one ``ceiling`` pass."""
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
        c_get = ceiling.bytes / ceiling()
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
            "verified": ok}


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


def machine_facts() -> dict:
    import grpc
    import psutil

    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total,
            "python": platform.python_version(), "grpcio": grpc.__version__, "numpy": np.__version__,
            "kernel": platform.release(), "load_avg_1m": os.getloadavg()[0],
            "malloc_tuned": "MALLOC_MMAP_MAX_" in os.environ}


def run_bench(url: str | None = None, token: str | None = None, sizes=(1 << 20, 4 << 20, 16 << 20),
              total_bytes: int = 256 << 20, transports=("grpc", "bulk", "shm"), reps: int = 3,
              memcpy_pass=None, redis_url: str | None = "redis://127.0.0.1:6379/0") -> dict:
    """Measure everything; returns a JSON-able report (see ``format_report``).

    ``memcpy_pass(nbytes, working_set=...)`` builds the memcpy ceiling pass (default
    ``MemcpyPass``; benchmarks/bench_service.py passes benchmarks/ceilings.py's)."""
    from kvstore.client import Client
    from kvstore.keys import KVLayout, Namespace

    memcpy_pass = memcpy_pass or MemcpyPass
    daemon = None if url else _PrivateDaemon(cpu_bytes=max(sizes) * 8 + 2 * total_bytes + (64 << 20))
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
        for size in sizes:
            count = max(2, total_bytes // size)
            layout = KVLayout(model="bench", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8",
                              block_tokens=16, block_bytes=size)
            memcpy = memcpy_pass(size, working_set=size * count)
            tcp = TcpPass(size, count)
            row: dict = {"count": count}
            try:
                for t, c in clients.items():
                    ns_id = c.register_namespace(Namespace(layout, cache_salt="bench"))
                    row[t] = _service_gbps(c, ns_id, size, count, reps, tag=t, ceiling=memcpy if t == "shm" else tcp)
                row["memcpy_gbps"] = memcpy.bytes / statistics.median(memcpy() for _ in range(3)) / GB
                row["tcp_gbps"] = tcp.bytes / statistics.median(tcp() for _ in range(3)) / GB
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
            c = next(iter(clients.values()))
            ns_id = c.register_namespace(Namespace(KVLayout(model="bench", num_layers=1, num_kv_heads=1, head_dim=1,
                                                            dtype="uint8", block_tokens=16), cache_salt="lookup"))
            report["lookups"] = _lookups_per_s(c, ns_id)
        for c in clients.values():
            c.close()
    finally:
        if daemon is not None:
            daemon.close()
    return report


def format_report(report: dict) -> str:
    lines = [f"kvstore bench ({report['daemon']}; {report['machine']['cores']} cores, "
             f"load {report['machine']['load_avg_1m']:.1f}; medians of {report['reps']})", ""]
    head = f"{'block':>7} {'path':<6} {'put GB/s':>9} {'get GB/s':>9}  ceiling"
    lines.append(head)
    for size, row in report["sizes"].items():
        mib = f"{int(size) >> 20}MiB"
        for t in ("shm", "bulk", "grpc", "redis"):
            r = row.get(t)
            if not r:
                continue
            if t == "shm":
                ceil = (f"memcpy {row['memcpy_gbps']:.2f} GB/s -> get {row['shm_get_vs_memcpy']:.2f}x, "
                        f"put {row['shm_put_vs_memcpy']:.2f}x")
            elif t == "redis":
                ceil = "peer"
            else:
                ceil = (f"raw TCP {row['tcp_gbps']:.2f} GB/s -> get {row[f'{t}_get_vs_tcp']:.2f}x, "
                        f"put {row[f'{t}_put_vs_tcp']:.2f}x")
            lines.append(f"{mib:>7} {t:<6} {r['put_gbps']:>9.2f} {r['get_gbps']:>9.2f}  {ceil}")
    if "lookups" in report:
        lk = report["lookups"]
        lines += ["", f"lookups: {lk['sequential_per_s']:,.0f}/s one chain per RPC, "
                      f"{lk['batched_per_s']:,.0f}/s batched ({lk['batch']} chains per RPC)"]
    for s in report.get("skipped", []):
        lines.append(f"skipped {s}")
    return "\n".join(lines)
