"""kvstore against its peers (Mooncake Store, LMCache, Redis) and the machine's ceilings, in one run.

    .venv/bin/python benchmarks/bench_peers.py                    # writes results/peers.{json,md}
    .venv/bin/python benchmarks/bench_peers.py --total 32MiB --out /tmp/peers-trial   # a quick trial

Per block size (64 KiB, 1 MiB, 16 MiB), put and get GB/s (1e9 bytes/s) of:
  kvstore   same-host shared memory, the raw-TCP side channel and gRPC streams (a private daemon
            process, kvstore.ops.bench.service_gbps), and the NVMe tier in-process through a Store;
  Mooncake  Store over TCP with a separate store node, and with the client holding the memory
            itself (mooncake-transfer-engine-non-cuda, benchmarks/peers/mooncake_driver.py);
  LMCache   its standalone server (``lmcache_server``, lm://) and its local disk backend with
            O_DIRECT (benchmarks/peers/lmcache_driver.py);
  Redis     a private redis-server on 127.0.0.1 (--save '' --appendonly no), redis-py pipelines
            (kvstore.ops.bench's Redis pass),
beside the ceilings measured in the same run (kvstore.ops.ceilings): memcpy with sources and
destinations each as large as the data moved, raw TCP over loopback with recv_into, raw O_DIRECT
write+fsync (what a durable put must do), write without fsync (what LMCache's disk backend does)
and read.
Every path runs twice per block size, in a forward and a backward order (A B B A for each pair, so a
steady drift of the load cancels), each peer next to its kvstore counterpart. Each path's ceiling is
measured right before and right after it (kvstore's daemon paths also interleave one ceiling pass with
each of their own) and its ratio divides by the median of those passes. Where kvstore is not ahead,
the markdown gives the reason (REASONS below, filled in with the run's figures).

Peers run in cached venvs, as child processes that report JSON: LMCache in the engine venv
(scripts/engine-venv.sh lmcache), Mooncake in benchmarks/peers/peer-venv.sh mooncake (needs
Debian's libibverbs1: installed here when missing). Peer drivers run inside a private network
namespace (``unshare -n``: only loopback exists there), because Mooncake's servers also open
listeners on 0.0.0.0; everything else binds 127.0.0.1. Every server started is stopped in a
``finally`` (drivers run in their own process group, killed on timeout); every wait is bounded.
A peer that cannot be set up is reported as not run, with the reason.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.ops import bench as kv_bench
from kvstore.ops.ceilings import GB, MemcpyPass, ODirectReadPass, ODirectWritePass, TcpPass, touched_buffer
from kvstore.ops.engines import engine_env, engine_venv, job_result
from kvstore.ops.grpc_ceiling import GrpcStreamPass
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.ops.machine import code_changes, git_state, machine_facts
from kvstore.ops.report import machine_line, write_report
from kvstore.store import Store, StoreConfig
from kvstore.transport.chunks import DEFAULT_CHUNK_BYTES
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.nvme import HEADER_BYTES, NvmeTier
from kvstore.units import format_size, parse_size
from peers.driver_common import die_with_parent, free_port, stop_process  # benchmarks/ is sys.path[0]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
PEERS_DIR = os.path.join(HERE, "peers")
ENGINE_VENV_BUILDER = os.path.join(REPO, "scripts", "engine-venv.sh")
PEER_VENV_BUILDER = os.path.join(PEERS_DIR, "peer-venv.sh")
MIB = 1 << 20
CPU_SLOT_BYTES = 256 << 10       # the daemon's default arena slot
DRIVER_TIMEOUT_S = 900
CEILING_PASSES = 3               # per checkpoint; two checkpoints per block size
LOCAL_PASSES = 2                 # ceiling passes right before and right after each path
LEVEL = 0.9                      # kvstore / peer in [0.9, 1): level within this run's noise, not ahead

service_gbps = kv_bench.service_gbps
redis_gbps = kv_bench._redis_gbps

# path rows: key -> (label, ceiling kind, who)
PATHS = {
    "kv_shm": ("kvstore same-host shared memory", "memcpy", "kvstore"),
    "kv_bulk": ("kvstore side channel (raw TCP, loopback)", "tcp", "kvstore"),
    "kv_grpc": ("kvstore gRPC streams (loopback)", "tcp", "kvstore"),
    "kv_nvme": ("kvstore NVMe tier (in-process Store)", "odirect_nofsync", "kvstore"),
    "kv_cpu": ("kvstore CPU tier (in-process Store)", "memcpy", "kvstore"),
    "mc_tcp": ("Mooncake Store, TCP, separate store node, batched", "tcp", "mooncake"),
    "mc_local": ("Mooncake, client inside the store process, batched", "memcpy", "mooncake"),
    "lm_server": ("LMCache standalone server (`lmcache_server`, lm://)", "tcp", "lmcache"),
    "lm_disk": ("LMCache local disk backend, O_DIRECT", "odirect_nofsync", "lmcache"),
    "redis": ("Redis 127.0.0.1, redis-py pipeline", "tcp", "redis"),
}
# peer rows: key -> (peer, driver script, driver mode)
PEER_MODES = {"mc_tcp": ("mooncake", "mooncake_driver.py", "tcp"), "mc_local": ("mooncake", "mooncake_driver.py", "local"),
              "lm_server": ("lmcache", "lmcache_driver.py", "server"), "lm_disk": ("lmcache", "lmcache_driver.py", "disk")}
# the order paths run in at each block size: each group's kvstore paths and peers one after another
ORDER = ("kv_shm", "mc_local", "kv_cpu", "kv_bulk", "mc_tcp", "lm_server", "redis", "kv_grpc", "kv_nvme", "lm_disk")
# each peer row against the kvstore paths of the same kind (first: the one an engine uses)
COUNTERPARTS = {"mc_tcp": ("kv_bulk", "kv_grpc"), "lm_server": ("kv_bulk", "kv_grpc"), "redis": ("kv_bulk", "kv_grpc"),
                "mc_local": ("kv_shm", "kv_cpu"), "lm_disk": ("kv_nvme",)}
# Why kvstore trails a peer where it does (filled in from the committed run; read with that run's code)
# Why kvstore is not ahead where it is not: (peer, kvstore path, op[, size]) -> a sentence, filled in
# with that cell's figures ({kv_us}/{peer_us}/{ceil_us}: microseconds a block for kvstore, the peer,
# and kvstore's ceiling; {kv_x}/{peer_x}: x ceiling). Established by reading the code and by the
# measurements named in them (profiles and A/B repeats on this machine, 2026-12-01).
_PER_BLOCK = ("per-block work bounds it, not the bytes: kvstore {kv_us:.0f} us a block, the peer {peer_us:.0f} us, "
              "raw TCP {ceil_us:.0f} us to move it. The daemon's BulkPut receives the blocks straight into CPU-arena "
              "slots reserved a run of up to 4 MiB at a time and publishes each run with one call "
              "(kvstore/service/bulk_rpcs.py); what is left per block is bookkeeping in Python (reserve slots, "
              "index and chain the block, eviction policy): a py-spy profile of 64 KiB side-channel puts "
              "(2026-12-05, samples holding the GIL) has 78% of BulkPut's in the store's reserve_store and "
              "finish_store")
_GRPC = ("kvstore's gRPC streams are the fallback for clients that cannot reach the side channel (behind a proxy, "
         "TLS-only): payloads cross in protobuf messages of up to 1 MiB (smaller blocks packed several to one) "
         "through grpcio in Python, {kv_x_range} raw TCP here, and grpcio's own stream of 1 MiB messages with no work "
         "at either end reaches {grpcio_x_range} raw TCP in this run (ceilings table): most of the gap is the "
         "library's. Engines use shared memory on the same host and the side channel from another (the rows above).")
_SHM = ("not like for like: Mooncake's client holds the store's memory itself, so its put and get are a memcpy inside "
        "one process ({peer_us:.0f} us a block); kvstore's shared-memory path serves another process, the daemon: "
        "PrepareStore and CompleteStore round trips per put (a window of up to 1024 blocks each, overlapped with the "
        "copies), a PrepareLoad per get, and per-block bookkeeping in the daemon's Python ({kv_us:.0f} us a block; "
        "the memcpy alone {ceil_us:.0f} us). kvstore's in-process CPU tier "
        "(next row) is the like-for-like comparison.")
_INPROC = ("the Store's per-block bookkeeping in Python (reserve slots, index and chain the block, eviction policy; no "
           "RPC in this row): {kv_us:.0f} us a block against {peer_us:.0f} us for Mooncake's C++ and {ceil_us:.0f} us "
           "for the memcpy alone.")
_DISK_PUT = ("kvstore promises more for the same ceiling: its put returns `persisted`, each block written "
             "with O_DIRECT into its slot of a slab file, a chain's neighbouring slots up to 4 MiB with one pwritev, "
             "up to 4 such writes at once (puts.DiskWrites), then one fdatasync per "
             "slab file for the batch (group commit), all inside the timed put; LMCache's disk backend writes "
             "with O_DIRECT from 4 I/O threads and never flushes (a finished write may still sit in the device's "
             "cache, and a crash can lose it). Both against raw O_DIRECT writes without fsync: kvstore at "
             "{kv_x:.2f}x, LMCache at {peer_x:.2f}x. How much of a gap the flush is was not measured apart.")
_DISK_GET = ("both read a batch several blocks at a time with O_DIRECT into page-aligned memory (kvstore 4 in flight, "
             "each a run of neighbouring slots of up to 1 MiB in one preadv; LMCache 4 threads, a block each); "
             "kvstore at {kv_x:.2f}x and LMCache at {peer_x:.2f}x the single-stream O_DIRECT read "
             "measured around each. This virtio disk varies from pass to pass by more than that gap (see the read "
             "ceiling's min-max); no further reason established.")
REASONS: dict[tuple, str] = {
    **{(peer, "kv_bulk", "put", size): _PER_BLOCK + suffix
       for peer, suffix in (("mc_tcp", "; Mooncake's per-object work is C++."),
                            ("lm_server", "; LMCache's server keeps each block as the bytearray it arrived in, in a "
                                          "dict, acknowledges no PUT and evicts nothing."),
                            ("redis", "; Redis's per-key work is C."))
       for size in ("64KiB", "1MiB")},
    ("lm_server", "kv_bulk", "get", "16MiB"): (
        "not established. An A/B repeat outside the run (3 alternating pairs, 16 x 16 MiB): kvstore 2.20 / 3.45 / "
        "2.94 GB/s, LMCache 2.99 / 3.49 / 3.16. Both send each block with one call from contiguous memory into a "
        "client's recv_into; 16 MiB arena slots instead of 256 KiB (one extent per block, no concatenation in the "
        "daemon) changed nothing (2.49 vs 2.54 GB/s); kvstore's get also runs a BulkGet RPC and pins blocks in "
        "windows."),
    ("lm_server", "kv_bulk", "put", "16MiB"): (
        "not established; the same A/B repeat had kvstore ahead on puts (2.03 / 2.28 / 2.10 GB/s against LMCache's "
        "1.10 / 1.69 / 1.03)."),
    **{(peer, "kv_grpc", op): _GRPC for peer in ("mc_tcp", "lm_server", "redis") for op in ("put", "get")},
    **{("mc_local", "kv_shm", op): _SHM for op in ("put", "get")},
    **{("mc_local", "kv_cpu", op, size): _INPROC for op in ("put", "get") for size in ("64KiB", "1MiB")},
    ("lm_disk", "kv_nvme", "put"): _DISK_PUT,
    ("lm_disk", "kv_nvme", "get"): _DISK_GET,
}


# -- set-up ----------------------------------------------------------------------------------------

def have_libibverbs() -> bool:
    out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    return "libibverbs.so.1" in out


def ensure_libibverbs() -> None:
    """Mooncake's wheel links libibverbs even for TCP: install Debian's package when it is missing."""
    if have_libibverbs():
        return
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(["apt-get", "install", "-y", "-q", "libibverbs1"], env=env, capture_output=True,
                      timeout=600).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-q", "libibverbs1"], env=env, capture_output=True,
                       timeout=600, check=True)
    if not have_libibverbs():
        raise RuntimeError("libibverbs1 installed but libibverbs.so.1 not found")


def private_netns_works() -> bool:
    try:
        return subprocess.run(["unshare", "-n", "sh", "-c", "ip link set lo up"], capture_output=True,
                              timeout=30).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def peer_venv(peer: str) -> str:
    out = subprocess.run([PEER_VENV_BUILDER, peer], check=True, capture_output=True, text=True,
                         timeout=1800).stdout
    return out.strip().splitlines()[-1]


def set_up_peers(wanted: list[str]) -> tuple[dict, dict]:
    """-> ({peer: python}, {peer: why not run}); ``netns`` is a pseudo-entry when unshare works."""
    ready, skipped = {}, {}
    netns = private_netns_works()
    if netns:
        ready["netns"] = True
    if "lmcache" in wanted:
        try:
            ready["lmcache"] = os.path.join(engine_venv("lmcache", ENGINE_VENV_BUILDER), "bin", "python")
        except Exception as e:  # noqa: BLE001 - reported as not run
            skipped["lmcache"] = f"venv: {type(e).__name__}: {e}"
    if "mooncake" in wanted:
        if not netns:
            skipped["mooncake"] = ("no private network namespace (unshare -n refused): Mooncake's servers "
                                   "listen on 0.0.0.0, so it runs only where that is loopback")
        else:
            try:
                ensure_libibverbs()
                ready["mooncake"] = os.path.join(peer_venv("mooncake"), "bin", "python")
            except Exception as e:  # noqa: BLE001
                skipped["mooncake"] = f"set-up: {type(e).__name__}: {e}"
    if "redis" in wanted:
        exe = shutil.which("redis-server")
        if exe:
            ready["redis"] = exe
        else:
            skipped["redis"] = "no redis-server on PATH"
    return ready, skipped


# -- servers and drivers ---------------------------------------------------------------------------

def _own_group_dies_with_us() -> None:
    """preexec_fn of every server and driver started here: its own process group (killed whole on
    timeout), and SIGKILL when this process dies, however it dies (PR_SET_PDEATHSIG)."""
    os.setsid()
    die_with_parent()


class RedisServer:
    """A private redis-server on 127.0.0.1, no persistence; ``stop()`` always."""

    def __init__(self, exe: str, workdir: str) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.log = open(os.path.join(workdir, "redis.log"), "wb")
        self.proc = subprocess.Popen([exe, "--bind", "127.0.0.1", "--port", str(self.port), "--save", "",
                                      "--appendonly", "no", "--dir", workdir, "--protected-mode", "yes"],
                                     stdout=self.log, stderr=subprocess.STDOUT,
                                     preexec_fn=_own_group_dies_with_us)
        import redis

        deadline = time.monotonic() + 30
        while True:
            try:
                redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2).ping()
                self.version = redis.Redis(host="127.0.0.1", port=self.port).info("server")["redis_version"]
                return
            except Exception:  # noqa: BLE001 - not up yet
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError("redis-server did not start") from None
                time.sleep(0.1)

    def stop(self) -> None:
        stop_process(self.proc, 15)
        self.log.close()


def merge_rounds(rounds: list[dict]) -> dict:
    """One path's two rounds (forward and backward order) as one result: GB/s the mean of the
    rounds' medians, the local ceiling the median of all its passes, verified only if every round was."""
    out = {"put_gbps": statistics.mean(r["put_gbps"] for r in rounds),
           "get_gbps": statistics.mean(r["get_gbps"] for r in rounds),
           "verified": all(r.get("verified", True) for r in rounds), "rounds": rounds}
    out["local_ceiling_gbps"] = {op: statistics.median([x for r in rounds for x in r["local_ceiling_passes"][op]])
                                 for op in ("put", "get")}
    for extra in ("put_backend_gbps", "get_backend_gbps"):
        if all(extra in r for r in rounds):
            out[extra] = statistics.mean(r[extra] for r in rounds)
    statuses = sorted({x for r in rounds for x in r.get("put_statuses", [])})
    if statuses:
        out["put_statuses"] = statuses
    return out


def _raise(e: Exception):
    raise e


def peer_mode(report: dict, python: str, driver: str, mode: str, job: dict, work: str, size: int,
              netns: bool) -> dict:
    """One mode of a peer's driver, in its own child process (and network namespace)."""
    out = run_driver(python, os.path.join(PEERS_DIR, driver), job, work, f"{driver[:-3]}-{mode}-{size}", netns)
    report["versions"][driver.split("_")[0]] = out.get("version")
    r = out.get(mode, {"error": "no result"})
    if "error" in r:
        raise RuntimeError(r["error"])
    return r


def run_driver(python: str, driver: str, job: dict, workdir: str, name: str, netns: bool) -> dict:
    """Run a peer driver (JSON job in, JSON result out) in its own process group, inside a private
    network namespace when ``netns``; the whole group is killed on timeout or on any failure."""
    base = os.path.join(workdir, name)
    with open(base + ".job.json", "w") as f:
        json.dump(job, f)
    argv = [python, driver, base + ".job.json", base + ".result.json"]
    if netns:
        argv = ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh", *argv]
    if os.path.exists(base + ".result.json"):
        os.unlink(base + ".result.json")
    with open(base + ".log", "wb") as log:
        p = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=engine_env(), cwd=workdir,
                             preexec_fn=_own_group_dies_with_us)
    try:
        rc = p.wait(timeout=DRIVER_TIMEOUT_S)
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # whatever of the group is left (servers included)
        except ProcessLookupError:
            pass
        p.wait()
    return job_result(base, rc, f"{name} driver", tail_chars=3000)


# -- kvstore paths ---------------------------------------------------------------------------------

def layout(size: int) -> KVLayout:
    return KVLayout(model="bench/peers", num_layers=1, num_kv_heads=1, head_dim=1, dtype="uint8", block_tokens=16,
                    block_bytes=size)


def aligned_blocks(size: int, n: int, fill: int | None) -> list[np.ndarray]:
    """``n`` page-aligned views of one touched buffer (what a pooled engine buffer looks like)."""
    arr = np.frombuffer(touched_buffer(size * n, fill=fill), dtype=np.uint8)
    return [arr[i * size:(i + 1) * size] for i in range(n)]


def service(client, size: int, count: int, reps: int, key: str, memcpy: MemcpyPass, tcp: TcpPass) -> dict:
    """One daemon transport through kvstore.ops.bench.service_gbps (shm judged by memcpy, the others by TCP)."""
    ns_id = client.register_namespace(Namespace(layout(size), cache_salt="peers"))
    r = service_gbps(client, ns_id, size, count, reps, tag=key, ceiling=memcpy if key == "kv_shm" else tcp,
                     get_ceiling=memcpy if key == "kv_shm" else tcp)
    r["put_vs_ceiling_interleaved"] = r.pop("put_vs_ceiling")
    r["get_vs_ceiling_interleaved"] = r.pop("get_vs_ceiling")
    return r


def kv_nvme(work: str, size: int, n: int, reps: int, wpass: ODirectWritePass, rpass: ODirectReadPass) -> dict:
    """The NVMe tier alone in an in-process Store, each pass right after one raw O_DIRECT pass."""
    path = os.path.join(work, "kvstore-nvme")
    shutil.rmtree(path, ignore_errors=True)
    try:
        return kv_in_process(NvmeTier(path, n * (HEADER_BYTES + size) + 4 * MIB), size, n, reps, wpass, rpass)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def kv_cpu(size: int, n: int, reps: int, memcpy: MemcpyPass) -> dict:
    """The CPU tier alone in an in-process Store (client and storage in one process, like Mooncake's
    client holding the memory itself), each pass right after one memcpy pass."""
    slot = min(size, 4 * MIB)
    return kv_in_process(CpuTier(n * -(-size // slot) * slot + 4 * MIB, slot_bytes=slot), size, n, reps, memcpy,
                         memcpy)


def kv_in_process(tier, size: int, n: int, reps: int, put_ceiling, get_ceiling) -> dict:
    """One tier in an in-process Store: the whole chain in one put, one get_into of all of it into
    pooled page-aligned buffers, delete; each put / get right after one pass of its ceiling."""
    store = Store([tier], StoreConfig(promote_on_hit=False, eviction_policy="lru"))
    try:
        ns = store.register_namespace(Namespace(layout(size)))
        srcs, outs = aligned_blocks(size, n, None), aligned_blocks(size, n, 0)
        total = size * n
        puts, gets, put_ratio, get_ratio, statuses = [], [], [], [], set()
        ok = True
        for r in range(reps + 1):  # pass 0 warms; not counted
            hashes = ChainHasher(seed=r).chain(np.arange(16 * n) + (r + 1) * 9_000_011, 16)
            c_put = put_ceiling.bytes / put_ceiling() / GB
            t = time.perf_counter()
            st = store.put(ns, hashes, srcs)
            put = total / (time.perf_counter() - t) / GB
            statuses.update(st)
            for o in outs:
                o[:] = 0
            c_get = get_ceiling.bytes / get_ceiling() / GB
            t = time.perf_counter()
            got = store.get_into(ns, hashes, outs)
            get = total / (time.perf_counter() - t) / GB
            if got != [size] * n:
                raise RuntimeError(f"kvstore {tier.name} tier missed a block")
            ok = ok and all(np.array_equal(a, b) for a, b in zip(srcs, outs))
            store.delete(ns, hashes)
            if r:
                puts.append(put)
                gets.append(get)
                put_ratio.append(put / c_put)
                get_ratio.append(get / c_get)
        return {"put_gbps": statistics.median(puts), "get_gbps": statistics.median(gets), "put_runs": puts,
                "get_runs": gets, "put_vs_ceiling_interleaved": statistics.median(put_ratio),
                "get_vs_ceiling_interleaved": statistics.median(get_ratio), "verified": ok,
                "put_statuses": sorted(statuses)}
    finally:
        store.close()


# -- ceilings --------------------------------------------------------------------------------------

def ceiling_passes(p, n: int = CEILING_PASSES) -> list[float]:
    return [p.bytes / p() / GB for _ in range(n)]


def checkpoint(ceil: dict, memcpy: MemcpyPass, tcp: TcpPass, wpass: ODirectWritePass, wpass_nofsync: ODirectWritePass,
               rpass: ODirectReadPass, grpcio: tuple[GrpcStreamPass, GrpcStreamPass] | None = None) -> None:
    named = [("memcpy", memcpy), ("tcp", tcp), ("odirect_write", wpass), ("odirect_write_nofsync", wpass_nofsync),
             ("odirect_read", rpass)]
    if grpcio is not None:
        named += [("grpcio_up", grpcio[0]), ("grpcio_down", grpcio[1])]
    for name, p in named:
        ceil.setdefault(name, []).extend(ceiling_passes(p))


# -- the run ---------------------------------------------------------------------------------------

def no_huge_pages_for_numpy() -> None:
    """Every caller buffer in this run in 4 KiB pages, like the ceilings' (kvstore.ops.ceilings
    touched_buffer) and the peer drivers' (anonymous mmaps): numpy would otherwise give its large
    arrays (service_gbps's 16 MiB blocks) transparent huge pages, which copy about 1.4x faster here."""
    try:
        np._core.multiarray._set_madvise_hugepage(False)
    except AttributeError:  # an older numpy
        np.core.multiarray._set_madvise_hugepage(False)


def run(args) -> dict:
    no_huge_pages_for_numpy()
    sizes = [parse_size(s, "--sizes") for s in args.sizes.split(",")]
    total, disk_total, reps = parse_size(args.total, "--total"), parse_size(args.disk_total, "--disk-total"), args.reps
    wanted = [p for p in args.peers.split(",") if p]
    os.makedirs(args.dir, exist_ok=True)
    work = tempfile.mkdtemp(prefix="bench-peers-", dir=args.dir)
    report: dict = {
        "machine": machine_facts(work), "load_avg_start": list(os.getloadavg()), "git": git_state(),
        "sizes": [format_size(s) for s in sizes], "bytes_per_pass": total, "disk_bytes_per_pass": disk_total,
        "reps": reps, "ceiling_passes_per_size": 2 * CEILING_PASSES, "paths": {k: v[0] for k, v in PATHS.items()},
        "results": {}, "ceilings": {}, "not_run": {}, "failed": {}, "versions": {}}
    print(f"set-up: peers {wanted} ...", flush=True)
    ready, skipped = set_up_peers(wanted)
    netns = bool(ready.pop("netns", False))
    report["peer_netns"] = netns
    for peer, why in skipped.items():
        for key, (_, _, who) in PATHS.items():
            if who == peer:
                report["not_run"][key] = why
    redis_srv = daemon = None
    clients: dict = {}
    try:
        if "redis" in ready:
            try:
                redis_srv = RedisServer(ready["redis"], work)
                report["versions"]["redis"] = redis_srv.version
            except Exception as e:  # noqa: BLE001
                report["not_run"]["redis"] = f"{type(e).__name__}: {e}"
        if not args.no_kvstore:
            need = max(max(2, total // s) * -(-s // CPU_SLOT_BYTES) * CPU_SLOT_BYTES for s in sizes)
            daemon = start_local_daemon(os.path.join(work, "kvd"), "--log-level", "WARNING",
                                        cpu_bytes=str(need + 256 * MIB), nvme_bytes="0", timeout=120)
            from kvstore.client import Client

            for key, transport in (("kv_shm", "shm"), ("kv_bulk", "bulk"), ("kv_grpc", "grpc")):
                c = Client(daemon.address, transport=transport, timeout_s=120)
                if c.active_transport != transport:
                    report["not_run"][key] = f"{transport} not available ({c.active_transport} negotiated)"
                    c.close()
                    continue
                clients[key] = c
        for size in sizes:
            count, n_disk = max(2, total // size), max(2, disk_total // size)
            label = format_size(size)
            print(f"{label} blocks: {count} per pass ({n_disk} on disk) ...", flush=True)
            res: dict = {}
            failed: dict = {}
            ceil: dict = {}
            # sources and destinations each span the data moved, as every path here copies them
            memcpy = MemcpyPass(size, working_set=size * count, cold_sources=True)
            tcp = TcpPass(size, count)
            # grpcio's own stream of the chunks kvstore's gRPC path sends: what that path could reach
            grpcio = tuple(GrpcStreamPass(DEFAULT_CHUNK_BYTES, max(1, size * count // DEFAULT_CHUNK_BYTES), upload)
                           for upload in (True, False))
            try:
                with ODirectWritePass(work, size, n_disk) as wpass, ODirectReadPass(work, size, n_disk) as rpass, \
                        ODirectWritePass(work, size, n_disk, fsync=False) as wpass_nofsync:
                    checkpoint(ceil, memcpy, tcp, wpass, wpass_nofsync, rpass, grpcio)
                    passes = {"memcpy": (memcpy, memcpy), "tcp": (tcp, tcp), "odirect": (wpass, rpass),
                              "odirect_nofsync": (wpass_nofsync, rpass)}
                    measures = {key: (lambda c=c, key=key: service(c, size, count, reps, key, memcpy, tcp))
                                for key, c in clients.items()}
                    if not args.no_kvstore:
                        measures["kv_nvme"] = lambda: kv_nvme(work, size, n_disk, reps, wpass_nofsync, rpass)
                        measures["kv_cpu"] = lambda: kv_cpu(size, count, reps, memcpy)
                    if redis_srv is not None:
                        measures["redis"] = lambda: redis_gbps(size, count, reps, redis_srv.url) or _raise(
                            RuntimeError("redis-server stopped answering"))
                    job = {"block_bytes": size, "count": count, "disk_count": n_disk, "reps": reps, "dir": work,
                           "segment_bytes": max(1 << 30, 2 * size * count + (256 << 20))}
                    for key, (peer, driver, mode) in PEER_MODES.items():
                        if peer in ready:
                            measures[key] = (lambda peer=peer, driver=driver, mode=mode: peer_mode(
                                report, ready[peer], driver, mode, {**job, "modes": [mode]}, work, size, netns))
                    rounds: dict = {}
                    # forward, then backward: each pair runs A B B A, so a steady drift of the machine's
                    # load cancels out of the comparisons; each peer runs next to its kvstore counterpart
                    for order in (ORDER, ORDER[::-1]):
                        for key in order:
                            if key not in measures or key in failed:
                                continue
                            before = passes[PATHS[key][1]]
                            local = {"put": ceiling_passes(before[0], LOCAL_PASSES),
                                     "get": ceiling_passes(before[1], LOCAL_PASSES)}
                            try:
                                r = measures[key]()
                            except Exception as e:  # noqa: BLE001 - reported; the other paths still run
                                failed[key] = f"{type(e).__name__}: {e}"[-600:]
                                rounds.pop(key, None)
                                continue
                            local["put"] += ceiling_passes(before[0], LOCAL_PASSES)
                            local["get"] += ceiling_passes(before[1], LOCAL_PASSES)
                            r["local_ceiling_passes"] = local
                            rounds.setdefault(key, []).append(r)
                            print(f"  {key}: {r['put_gbps']:.2f} / {r['get_gbps']:.2f}", flush=True)
                    res.update({key: merge_rounds(rs) for key, rs in rounds.items()})
                    checkpoint(ceil, memcpy, tcp, wpass, wpass_nofsync, rpass, grpcio)
            finally:
                tcp.close()
                for p in grpcio:
                    p.close()
            report["results"][label] = res
            if failed:
                report["failed"][label] = failed
            report["ceilings"][label] = {name: {"median_gbps": statistics.median(v), "min_gbps": min(v),
                                                "max_gbps": max(v), "passes": v} for name, v in ceil.items()}
    finally:
        for c in clients.values():
            c.close()
        if daemon is not None:
            daemon.stop(timeout=30)
        if redis_srv is not None:
            redis_srv.stop()
        shutil.rmtree(work, ignore_errors=True)
    report["load_avg_end"] = list(os.getloadavg())
    derive(report)
    return report


# -- ratios ----------------------------------------------------------------------------------------

def ceiling_of(report: dict, size: str, kind: str, op: str) -> float:
    c = report["ceilings"][size]
    if kind.startswith("odirect"):
        name = "odirect_read" if op == "get" else "odirect_write_nofsync" if kind == "odirect_nofsync" else "odirect_write"
    else:
        name = kind
    return c[name]["median_gbps"]


def derive(report: dict) -> None:
    """Ratios to the ceilings and kvstore-vs-peer ratios, per size and op."""
    for size, res in report["results"].items():
        for key, r in res.items():
            kind = PATHS[key][1]
            for op in ("put", "get"):
                local = r.get("local_ceiling_gbps", {}).get(op)
                r[f"{op}_vs_ceiling"] = r[f"{op}_gbps"] / (local or ceiling_of(report, size, kind, op))
    cmp: list = []
    for peer, kvs in COUNTERPARTS.items():
        for kv in kvs:
            rows = {}
            for size, res in report["results"].items():
                if peer in res and kv in res:
                    rows[size] = {op: res[kv][f"{op}_gbps"] / res[peer][f"{op}_gbps"] for op in ("put", "get")}
                    # the same with each side divided by the ceiling measured around it: drift-corrected
                    rows[size].update({f"{op}_normalized": res[kv][f"{op}_vs_ceiling"] / res[peer][f"{op}_vs_ceiling"]
                                       for op in ("put", "get")})
            if rows:
                level = [f"{size} {op}" for size, x in rows.items() for op in ("put", "get") if LEVEL <= x[op] < 1.0]
                behind = [f"{size} {op}" for size, x in rows.items() for op in ("put", "get") if x[op] < LEVEL]
                cmp.append({"peer": peer, "kvstore_path": kv, "kvstore_over_peer": rows,
                            "kvstore_ahead_everywhere": not behind and not level, "level_at": level,
                            "behind_at": behind})
    report["kvstore_vs_peers"] = cmp


# -- markdown --------------------------------------------------------------------------------------

def summary(r: dict) -> str:
    """One line: per peer, against the kvstore path an engine would use, how many cells are ahead."""
    parts = []
    for c in r["kvstore_vs_peers"]:
        if c["kvstore_path"] != COUNTERPARTS[c["peer"]][0]:
            continue
        n = 2 * len(c["kvstore_over_peer"])
        ahead = n - len(c["behind_at"]) - len(c["level_at"])
        parts.append(f"{PATHS[c['peer']][0]} (against {PATHS[c['kvstore_path']][0]}): ahead in {ahead} of {n}"
                     + (f", level in {len(c['level_at'])}" if c["level_at"] else "")
                     + (f", behind at {', '.join(c['behind_at'])}" if c["behind_at"] else ""))
    return "Summary (kvstore ahead in how many of the put / get cells): " + "; ".join(parts) + "."


def dirty_note(files: list[str]) -> str:
    code = code_changes(files)
    if code:
        return f" with uncommitted changes in {len(code)} tracked files of code (other work in progress)"
    return " (uncommitted changes only in results and docs)" if files else ""


def reasons_for(r: dict, c: dict) -> str:
    """The REASONS sentence for each cell where kvstore is not ahead, filled in with that cell's
    figures (a sentence shared by several cells is given once, with the first cell's figures)."""
    peer, kv = c["peer"], c["kvstore_path"]
    cells: dict[str, list[str]] = {}
    for at in c["behind_at"] + c["level_at"]:
        size, op = at.split()
        template = REASONS.get((peer, kv, op, size)) or REASONS.get((peer, kv, op))
        cells.setdefault(template or "", []).append(at)
    out = []
    for template, ats in cells.items():
        size, op = ats[0].split()
        norm = c["kvstore_over_peer"][size][f"{op}_normalized"]
        if not template:
            out.append(f"{', '.join(ats)}: reason not established" + (
                f" (divided by the ceiling measured around each, kvstore is ahead: {norm:.2f}x; the load drifted)."
                if norm >= 1 else "."))
            continue
        res, ceil_kind = r["results"][size], PATHS[kv][1]
        x = block_bytes(size) / 1e3  # us a block = bytes / (GB/s * 1e9) * 1e6
        fields = {"size": size, "op": op, "kv_gbps": res[kv][f"{op}_gbps"], "peer_gbps": res[peer][f"{op}_gbps"],
                  "kv_us": x / res[kv][f"{op}_gbps"], "peer_us": x / res[peer][f"{op}_gbps"],
                  "ceil_us": x / (res[kv].get("local_ceiling_gbps", {}).get(op) or ceiling_of(r, size, ceil_kind, op)),
                  "kv_x": res[kv][f"{op}_vs_ceiling"], "peer_x": res[peer][f"{op}_vs_ceiling"],
                  "norm": c["kvstore_over_peer"][size][f"{op}_normalized"]}
        xs = [r["results"][a.split()[0]][kv][f"{a.split()[1]}_vs_ceiling"] for a in ats]
        fields["kv_x_range"] = f"{min(xs):.2f}x" if len(xs) == 1 else f"{min(xs):.2f}-{max(xs):.2f}x"
        gx = [cs["grpcio_up" if o == "put" else "grpcio_down"]["median_gbps"] / cs["tcp"]["median_gbps"]
              for s_, o in (a.split() for a in ats) if "grpcio_up" in (cs := r["ceilings"][s_])]
        fields["grpcio_x_range"] = ("(not measured)" if not gx else f"{min(gx):.2f}x" if len(gx) == 1
                                    else f"{min(gx):.2f}-{max(gx):.2f}x")
        out.append(f"{', '.join(ats)}: " + template.format(**fields))
    return " ".join(out)


def block_bytes(label: str) -> int:
    return parse_size(label, "size")


def markdown(r: dict) -> str:
    m = r["machine"]
    sizes = list(r["results"])
    ceiling_name = {"memcpy": "memcpy", "tcp": "raw TCP", "odirect": "raw O_DIRECT write+fsync / read",
                    "odirect_nofsync": "raw O_DIRECT write (no fsync) / read"}
    lines = [
        "# kvstore vs Mooncake Store, LMCache and Redis, one run",
        "",
        f"`python benchmarks/bench_peers.py` at {m['time_utc']}: block sizes {', '.join(sizes)}; "
        f"{format_size(r['bytes_per_pass'], 'readable')} moved per pass "
        f"({format_size(r['disk_bytes_per_pass'], 'readable')} for the disk paths). Every path runs twice per "
        f"block size, in a forward and a backward round (each pair A B B A); each round is the median of "
        f"{r['reps']} passes after a warm-up pass, a figure is the mean of the two rounds, and every pass's bytes "
        "are read back and compared. GB/s = 1e9 bytes/s, one Python client thread.",
        "",
        machine_line(m, "numpy", "grpcio", directory=True, load=(r["load_avg_start"], r["load_avg_end"]))
        + " (1-minute). Peers: "
        + ", ".join(f"{k} {v}" for k, v in sorted(r["versions"].items())) + ". kvstore at "
        f"{r['git']['commit'][:12]}" + dirty_note(r["git"]["modified_tracked_files"]) + ".",
        "",
        "## Put / get GB/s",
        "",
        "| path | " + " | ".join(f"{s} blocks" for s in sizes) + " | ceiling | "
        + " | ".join(f"x ceiling, {s}" for s in sizes) + " |",
        "|---|" + "---:|" * len(sizes) + "---|" + "---:|" * len(sizes),
    ]
    for key, (label, kind, _) in PATHS.items():
        cells, ratios = [], []
        for s in sizes:
            x = r["results"][s].get(key)
            cells.append(f"{x['put_gbps']:.2f} / {x['get_gbps']:.2f}" if x else "-")
            ratios.append(f"{x['put_vs_ceiling']:.2f} / {x['get_vs_ceiling']:.2f}" if x else "-")
        if any(c != "-" for c in cells):
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {ceiling_name[kind]} | " + " | ".join(ratios) + " |")
    lines += ["", "## Ceilings, same run (median of the passes before and after each size's paths; min-max)", "",
              "| ceiling | " + " | ".join(sizes) + " |", "|---|" + "---:|" * len(sizes)]
    for name, label in (("memcpy", "memcpy, sources and destinations each as large as the data moved"),
                        ("tcp", "raw TCP loopback, recv_into"),
                        ("odirect_write", "raw O_DIRECT write + fsync per file"),
                        ("odirect_write_nofsync", "raw O_DIRECT write, no fsync"),
                        ("odirect_read", "raw O_DIRECT read"),
                        ("grpcio_up", "grpcio stream up: 1 MiB bytes messages, client-streaming call, no work at "
                                      "either end (`kvstore.ops.grpc_ceiling`)"),
                        ("grpcio_down", "grpcio stream down: the same, server-streaming")):
        if not all(name in r["ceilings"][s] for s in sizes):
            continue
        cells = []
        for s in sizes:
            c = r["ceilings"][s][name]
            cells.append(f"{c['median_gbps']:.2f} ({c['min_gbps']:.2f}-{c['max_gbps']:.2f})")
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines += ["", "## kvstore against each peer", "",
              "kvstore GB/s / peer GB/s, put / get; in brackets the same with each side first divided by its ceiling "
              "measured right around it (corrects for the machine's load drifting between the two). The verdict "
              f"reads the plain ratios: ahead >= 1, within {100 - 100 * LEVEL:.0f}% is level, below that behind.", "",
              summary(r), "",
              "| peer | kvstore path | " + " | ".join(sizes) + " | kvstore ahead? |", "|---|---|" + "---:|" * len(sizes)
              + "---|"]
    for c in r["kvstore_vs_peers"]:
        peer = c["peer"]
        cells = [(lambda x: f"{x['put']:.2f}x / {x['get']:.2f}x ({x['put_normalized']:.2f} / "
                            f"{x['get_normalized']:.2f})")(c["kvstore_over_peer"][s])
                 if s in c["kvstore_over_peer"] else "-" for s in sizes]
        if c["kvstore_ahead_everywhere"]:
            verdict = "yes, every size, put and get"
        else:
            parts = []
            if c["behind_at"]:
                parts.append("behind at " + ", ".join(c["behind_at"]))
            if c["level_at"]:
                parts.append(f"within {100 - 100 * LEVEL:.0f}% at " + ", ".join(c["level_at"]))
            verdict = ("no: " if c["behind_at"] else "level: ") + "; ".join(parts) + ". " + reasons_for(r, c)
        lines.append(f"| {PATHS[peer][0]} | {PATHS[c['kvstore_path']][0]} | " + " | ".join(cells) + f" | {verdict} |")
    if r["not_run"] or r["failed"]:
        lines += ["", "## Not run", ""]
        for key, why in r["not_run"].items():
            lines.append(f"- {PATHS.get(key, (key,))[0]}: {why.splitlines()[0] if why else '?'}")
        for size, failed in r["failed"].items():
            for key, why in failed.items():
                lines.append(f"- {PATHS.get(key, (key,))[0]}, {size} blocks: {why.splitlines()[0] if why else '?'}")
    lines += ["", "## How each path is measured", ""] + HOW + [""]
    return "\n".join(lines)


HOW = [
    "- Caller buffers (what is put from and got into) are touched 4 KiB-page memory on every path, like the "
    "ceilings' (numpy's huge-page advice is switched off in this process; the drivers use anonymous mmaps): huge "
    "pages copy about 1.4x faster here, which would favour whichever side got them. Each store's own memory is "
    "its own (kvstore's arena: tmpfs shared memory, 4 KiB pages).",
    "- kvstore shm / side channel / gRPC: a private `kvstore serve` child process (CPU arena only, default "
    "256 KiB slots), `kvstore.ops.bench.service_gbps`: one `put` of all the pass's blocks, one `get_into` of "
    "them into preallocated arrays, fresh hashes every pass. Each pass follows one ceiling pass (memcpy for shm, raw "
    "TCP for the others); those interleaved ratios are in the JSON (`*_vs_ceiling_interleaved`).",
    "- kvstore NVMe / CPU tier: that tier alone in an in-process `Store` (NVMe: O_DIRECT; CPU: slots of "
    "min(block, 4 MiB)), the whole chain in one `put`, one `get_into` of it into pooled page-aligned buffers, then "
    "`delete`. The CPU-tier row is the like-for-like counterpart of Mooncake's client holding its memory itself "
    "(storage and client in one process); engines reach kvstore through the daemon (the shared-memory row).",
    "- Mooncake (mooncake-transfer-engine-non-cuda): master, HTTP metadata server and store node as separate "
    "processes in a private network namespace (only loopback), MC_TCP_BIND_ADDRESS=127.0.0.1, protocol tcp; the "
    "Python client uses registered buffers and `batch_put_from` / `batch_get_into`, one call per 1024 keys "
    "(one call of 4096 64 KiB slices overflows its TCP lane queue). \"TCP, "
    "separate store node\": the client mounts no memory, the store node holds it all. \"Client inside the store "
    "process\": no store node, the client mounts the memory itself.",
    "- LMCache `lmcache_server 127.0.0.1 PORT cpu`: LMCache's own wire protocol (`lmcache.v1.protocol`) on one "
    "connection from pooled buffers with `recv_into`; the server does not acknowledge PUTs, so a put pass ends "
    "when it answers an EXIST sent after the last PUT.",
    "- LMCache local disk: `LocalDiskBackend` with `use_odirect` (4 I/O threads, no fsync), driven as its "
    "storage manager does: copy each block into a MemoryObj of LMCache's CPU allocator, one "
    "`batched_submit_put_task`, wait for every write's completion callback; get = one `batched_get_blocking` plus "
    "the copy into the caller's buffers. Without those copies (the backend alone) see `*_backend_gbps` in the JSON.",
    "- Redis: a private `redis-server --bind 127.0.0.1 --save '' --appendonly no`, redis-py, one pipeline of "
    "SETs and one of GETs per pass (`kvstore.ops.bench`'s Redis pass).",
    "- Order at each block size: kvstore shm, Mooncake in-process, kvstore CPU tier; kvstore side channel, Mooncake "
    "TCP, LMCache server, Redis, kvstore gRPC; kvstore NVMe, LMCache disk (each peer next to its kvstore "
    "counterpart), then the same backwards. `x ceiling` divides a path by the median of its ceiling's passes run "
    f"right before and right after it in both rounds ({LOCAL_PASSES} + {LOCAL_PASSES} each); the ceilings table "
    "gives the passes at the start and end of each block size. Per-round figures are in the JSON (`rounds`). Disk "
    "puts are judged against raw O_DIRECT writes without fsync, both kvstore's (durable on return: the batch's "
    "slab files are flushed once each, group commit) and LMCache's (never flushed); raw write + fsync per file is shown "
    "for reference. "
    "The machine is shared and noisy: compare rows of this run, not figures of other runs.",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64KiB,1MiB,16MiB", help="block sizes, comma-separated")
    ap.add_argument("--total", default="256MiB", help="bytes moved per pass (memory and network paths)")
    ap.add_argument("--disk-total", default="128MiB", help="bytes moved per pass by the disk paths")
    ap.add_argument("--reps", type=int, default=3, help="measured passes per path and size (after one warm-up)")
    ap.add_argument("--dir", default="/var/tmp", help="where the disk paths and O_DIRECT ceilings write")
    ap.add_argument("--peers", default="mooncake,lmcache,redis", help="peers to run (comma-separated)")
    ap.add_argument("--no-kvstore", action="store_true", help="peers and ceilings only (a peer trial)")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "peers"), help="output prefix (.json, .md)")
    ap.add_argument("--render", metavar="JSON", help="no run: rewrite the markdown (and ratios) from a JSON result")
    args = ap.parse_args()
    if args.render:
        with open(args.render) as f:
            report = json.load(f)
        derive(report)
    else:
        report = run(args)
    write_report(args.out, report, markdown)


if __name__ == "__main__":
    sys.exit(main())
