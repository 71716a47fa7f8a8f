"""Reliability suite: kvstore under kill -9, disk faults, memory pressure, hostile input, tenants,
load and dependencies going down. Every scenario drives a REAL ``kvstore serve`` subprocess
(tests/daemon_util.py) and returns a dict of counts; CI runs short versions
(tests/test_reliability_*.py), this script runs long ones and writes
benchmarks/results/reliability.{json,md}.

    python benchmarks/reliability.py all            # the full suite (~15 min on 2 cores)
    python benchmarks/reliability.py crash --kills 50
    python benchmarks/reliability.py fuzz --requests 10000
    python benchmarks/reliability.py load --clients 64 --seconds 30
    python benchmarks/reliability.py all --quick    # the CI-sized versions

The promise being checked (docs/guarantees.md): never a wrong byte (every block's payload is
derived from its hash, so any byte served can be checked), never lose a block acknowledged as
"persisted", never hang or crash on bad input, never let one tenant see another's blocks.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import grpc
import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, REPO)

from daemon_util import DaemonProcess, start_daemon  # noqa: E402

from kvstore import ChainHasher, KVLayout, Namespace  # noqa: E402
from kvstore.client import AsyncClient, Client  # noqa: E402
from kvstore.errors import DaemonUnavailable, KVStoreError  # noqa: E402
from kvstore.proto import kvstore_pb2 as pb  # noqa: E402
from kvstore.proto import kvstore_pb2_grpc as pb_grpc  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20


class Unsupported(Exception):
    """The scenario cannot run here (e.g. mounting is not permitted); the reason says why."""


# -- blocks whose bytes can be checked -------------------------------------------------------------

def layout(block_bytes: int, model: str = "reliability/model") -> KVLayout:
    return KVLayout(model=model, num_layers=1, num_kv_heads=1, head_dim=64, dtype="uint8", block_tokens=16,
                    block_bytes=block_bytes)


def payload(h: bytes, nbytes: int) -> np.ndarray:
    """The one correct payload of block ``h``: anything else served under ``h`` is a wrong byte."""
    return np.frombuffer(np.random.Generator(np.random.PCG64(int.from_bytes(h[:16], "little"))).bytes(nbytes),
                         dtype=np.uint8)


def is_exact(h: bytes, got, nbytes: int) -> bool:
    return got is not None and len(got) == nbytes and bytes(got) == payload(h, nbytes).tobytes()


def hashes(n: int, seed: int = 0, algorithm: str = "xxh3_128") -> list[bytes]:
    return ChainHasher(algorithm, seed=seed).chain(np.arange(16 * n), 16)


def daemon_log_errors(d: DaemonProcess) -> int:
    """Unexpected exceptions the daemon logged (each is a bug: every failure should be a status)."""
    try:
        text = d.log()
    except OSError:
        return 0
    # gRPC's own "Exception deserializing request" (malformed protobuf, answered INTERNAL) is not ours
    return sum(text.count(s) for s in ("unexpected error in", "Exception calling application",
                                       "Exception iterating responses", "lease reaper tick failed"))


def rss(pid: int) -> dict:
    """The daemon's resident memory: anonymous (heap) and shared (the arena) separately."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "RssAnon", "RssShmem", "RssFile")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * KiB
    return out


def kill_and_reap(d: DaemonProcess) -> None:
    d.kill()
    for seg in os.listdir("/dev/shm"):
        if seg.startswith((f"kvstore-{d.pid}-", f".kvstore-probe-{d.pid}-")):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", seg))


@contextlib.contextmanager
def tmpfs(size: str, ro: bool = False):
    """A fresh small tmpfs (root only); ``Unsupported`` where mounting is not permitted."""
    where = tempfile.mkdtemp(prefix="kvstore-rel-tmpfs-")
    opts = f"size={size}" + (",ro" if ro else "")
    try:
        p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", where], capture_output=True, text=True,
                           timeout=30)
    except (OSError, subprocess.SubprocessError) as e:
        os.rmdir(where)
        raise Unsupported(f"cannot mount tmpfs: {e}") from None
    if p.returncode != 0:
        os.rmdir(where)
        raise Unsupported(f"cannot mount tmpfs ({p.stderr.strip() or 'mount failed'}); run as root")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", where], capture_output=True, timeout=30)
        with contextlib.suppress(OSError):
            os.rmdir(where)


def remount(where: str, opts: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{opts}", where], check=True, capture_output=True, timeout=30)


# -- 1. crash test ---------------------------------------------------------------------------------

class _CrashLedger:
    """What clients were told, per block: the checker's ground truth. Each worker owns a disjoint
    slice of the block pool, so the operations on one block are sequential."""

    def __init__(self) -> None:
        self.persisted: set[bytes] = set()     # acknowledged "persisted" and not deleted since
        self.deleted: set[bytes] = set()       # acknowledged deleted and not put since
        self.lock = threading.Lock()
        self.counts = {"puts": 0, "persisted_acks": 0, "gets": 0, "blocks_served": 0, "lookups": 0,
                       "deletes": 0, "errors_seen": 0, "wrong_bytes_served": 0, "persisted_missed_live": 0}
        self.errors: dict[str, int] = {}
        self.wrong: list[str] = []
        self.missed_by_transport: dict[str, int] = {}   # persisted blocks a live get reported as a miss

    def count(self, key: str, n: int = 1) -> None:
        with self.lock:
            self.counts[key] += n

    def error(self, e: Exception) -> None:
        with self.lock:
            self.counts["errors_seen"] += 1
            self.errors[type(e).__name__] = self.errors.get(type(e).__name__, 0) + 1


def _crash_worker(address: str, transport: str, ns_layout: KVLayout, pool: list[bytes], ledger: _CrashLedger,
                  stop: threading.Event, seed: int) -> None:
    rng = random.Random(seed)
    bb = ns_layout.block_bytes
    c = Client(address, timeout_s=2.0, transport=transport)
    try:
        ns = None
        while not stop.is_set():
            try:
                if ns is None:
                    ns = c.register_namespace(Namespace(ns_layout))
                op = rng.random()
                if op < 0.45:                                   # put 1-4 blocks
                    k = rng.randint(1, 4)
                    i = rng.randrange(len(pool))
                    batch = pool[i:i + k]
                    with ledger.lock:
                        ledger.deleted.difference_update(batch)  # may be stored from here on
                    results = c.put(ns, batch, [payload(h, bb) for h in batch])
                    ledger.count("puts", len(batch))
                    with ledger.lock:
                        for h, r in zip(batch, results):
                            if r == "persisted":
                                ledger.persisted.add(h)
                                ledger.counts["persisted_acks"] += 1
                elif op < 0.85:                                 # get 1-8 blocks
                    batch = rng.sample(pool, rng.randint(1, 8))
                    with ledger.lock:
                        must = {h for h in batch if h in ledger.persisted}
                    got = c.get(ns, batch)
                    ledger.count("gets", len(batch))
                    for h, g in zip(batch, got):
                        if g is None:
                            if h in must:
                                ledger.count("persisted_missed_live")
                                with ledger.lock:
                                    by = ledger.missed_by_transport
                                    by[transport] = by.get(transport, 0) + 1
                            continue
                        ledger.count("blocks_served")
                        if not is_exact(h, g, bb):
                            ledger.count("wrong_bytes_served")
                            with ledger.lock:
                                ledger.wrong.append(h.hex())
                elif op < 0.95:                                 # lookup a chain
                    i = rng.randrange(len(pool))
                    c.lookup(ns, pool[i:i + 16], lease=rng.random() < 0.5)
                    ledger.count("lookups")
                else:                                           # delete (evict) 1-2 blocks
                    batch = rng.sample(pool, rng.randint(1, 2))
                    with ledger.lock:
                        ledger.persisted.difference_update(batch)  # no longer promised
                    c.delete(ns, batch)
                    ledger.count("deletes", len(batch))
                    with ledger.lock:
                        ledger.deleted.update(batch)
            except (KVStoreError, OSError) as e:
                ledger.error(e)
                if isinstance(e, DaemonUnavailable):
                    time.sleep(0.05)
    finally:
        c.close()


def _crash_verify(d: DaemonProcess, ns_layout: KVLayout, pool: list[bytes], ledger: _CrashLedger) -> dict:
    """After a restart: every acknowledged-persisted block intact, nothing else wrong or resurrected."""
    bb = ns_layout.block_bytes
    out = {"checked": 0, "served": 0, "lost": 0, "wrong": 0, "resurrected": 0}
    with d.client(transport="grpc", timeout_s=30) as c:
        ns = c.register_namespace(Namespace(ns_layout))
        for a in range(0, len(pool), 64):
            batch = pool[a:a + 64]
            for h, g in zip(batch, c.get(ns, batch)):
                out["checked"] += 1
                if g is None:
                    out["lost"] += h in ledger.persisted
                    continue
                out["served"] += 1
                if not is_exact(h, g, bb):
                    out["wrong"] += 1
                    ledger.wrong.append(h.hex())
                out["resurrected"] += h in ledger.deleted
    return out


def crash_test(workdir: str, kills: int = 10, block_bytes: int = 64 * KiB, pool_blocks: int = 384,
               workers: int = 4, traffic_s: tuple[float, float] = (0.4, 1.5), seed: int = 1) -> dict:
    """Random kill -9 of the daemon during mixed put/get/lookup/delete traffic with a CPU tier small
    enough that blocks are demoted all the time; restart on the same NVMe directory and verify."""
    rng = random.Random(seed)
    lay = layout(block_bytes, "reliability/crash")
    pool = hashes(pool_blocks, seed=seed)
    nvme = os.path.join(workdir, "nvme")
    ledger = _CrashLedger()
    totals = {"kills": 0, "restarts": 0, "lost": 0, "wrong_after_restart": 0, "resurrected_after_delete": 0,
              "blocks_checked": 0, "blocks_served_after_restart": 0, "daemon_log_errors": 0,
              "persisted_at_last_check": 0, "write_back_cycles": 0, "exit_codes": {}}
    transports = ["shm", "bulk", "grpc", "auto"]
    d = None
    for cycle in range(kills + 1):
        write_through = cycle % 4 != 3   # one cycle in four runs write-back: demotion carries the data
        totals["write_back_cycles"] += not write_through
        flags = ["--cpu-slot-bytes", str(block_bytes), "--lease-seconds", "2"]
        flags.append("--write-through" if write_through else "--no-write-through")
        d = start_daemon(os.path.join(workdir, f"run{cycle}"), *flags, cpu_bytes=str(16 * block_bytes),
                         nvme_bytes=str(4 * pool_blocks * block_bytes), nvme_path=nvme)
        if cycle:
            totals["restarts"] += 1
        v = _crash_verify(d, lay, pool, ledger)
        totals["lost"] += v["lost"]
        totals["wrong_after_restart"] += v["wrong"]
        totals["resurrected_after_delete"] += v["resurrected"]
        totals["blocks_checked"] += v["checked"]
        totals["blocks_served_after_restart"] += v["served"]
        totals["persisted_at_last_check"] = len(ledger.persisted)
        if cycle == kills:
            break
        stop = threading.Event()
        threads = [threading.Thread(target=_crash_worker, args=(d.address, transports[w % len(transports)], lay,
                                                               pool[w::workers], ledger, stop, seed * 100 + cycle * 10 + w))
                   for w in range(workers)]
        for t in threads:
            t.start()
        time.sleep(rng.uniform(*traffic_s))
        alive_before_kill = d.alive()
        kill_and_reap(d)
        totals["kills"] += alive_before_kill
        code = str(d.proc.returncode)
        totals["exit_codes"][code] = totals["exit_codes"].get(code, 0) + 1
        time.sleep(0.2)   # let in-flight calls see the crash
        stop.set()
        for t in threads:
            t.join(60)
        totals["daemon_log_errors"] += daemon_log_errors(d)
    totals["daemon_log_errors"] += daemon_log_errors(d)
    d.stop()
    totals.update(ledger.counts)
    totals["client_errors_by_type"] = ledger.errors
    totals["persisted_missed_live_by_transport"] = ledger.missed_by_transport
    totals["wrong_examples"] = ledger.wrong[:5]
    totals["config"] = {"block_bytes": block_bytes, "pool_blocks": pool_blocks, "cpu_blocks": 16,
                        "workers": workers, "transports": transports[:workers]}
    return totals


# -- 2. disk faults --------------------------------------------------------------------------------

def _metrics(d: DaemonProcess) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10) as r:
        return r.read().decode()


def _metric_value(text: str, name: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and not line.startswith("#"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def disk_full(workdir: str, block_bytes: int = 256 * KiB, blocks: int = 48) -> dict:
    """NVMe directory on an 8 MiB tmpfs: write-through stops being acknowledged as persisted, the
    CPU tier keeps serving, counters say why, and freeing space makes writes durable again."""
    lay = layout(block_bytes, "reliability/diskfull")
    hs = hashes(blocks, seed=11)
    with tmpfs("8m") as where:
        d = start_daemon(os.path.join(workdir, "full"), "--write-through", "--metrics-port", "0",
                         "--cpu-slot-bytes", str(block_bytes), cpu_bytes=str(16 * block_bytes),
                         nvme_bytes="1GiB", nvme_path=where)
        try:
            with d.client(transport="grpc") as c:
                ns = c.register_namespace(Namespace(lay))
                statuses = []
                for h in hs:
                    statuses += c.put(ns, [h], [payload(h, block_bytes)])
                persisted = [h for h, s in zip(hs, statuses) if s == "persisted"]
                # the newest blocks first: reading NVMe blocks promotes them and would evict these
                recent = c.get(ns, hs[-8:])
                recent_served = sum(is_exact(h, g, block_bytes) for h, g in zip(hs[-8:], recent))
                got = c.get(ns, hs)
                wrong = sum(1 for h, g in zip(hs, got) if g is not None and not is_exact(h, g, block_bytes))
                wrong += sum(1 for h, g in zip(hs[-8:], recent) if g is not None and not is_exact(h, g, block_bytes))
                lost = sum(1 for h, g in zip(hs, got) if h in persisted and g is None)
                stats = c.stats()
                try:
                    c.register_namespace(Namespace(layout(block_bytes, "reliability/another")))
                    register_error = None
                except KVStoreError as e:
                    register_error = f"{type(e).__name__}: {e}"
                freed = c.delete(ns, persisted[:8])
                after_free = c.put(ns, hs[-1:], [payload(hs[-1], block_bytes)])[0]
                metrics = _metrics(d)
                healthy = c.health()
        finally:
            errors = daemon_log_errors(d)
            d.stop()
    return {"puts": len(hs), "acknowledged_persisted": len(persisted), "acknowledged_stored_only": statuses.count("stored"),
            "lost": lost, "wrong": wrong, "recent_blocks_served_from_cpu": recent_served,
            "write_through_failures": stats["counters"].get("write_through_failures", 0),
            "register_namespace_when_full": register_error, "freed_blocks": freed,
            "put_after_freeing": after_free, "healthy": healthy, "daemon_log_errors": errors,
            "metrics_has_tier_used": "kvstore_tier_used_bytes" in metrics}


def unwritable_dir_at_start(workdir: str) -> dict:
    """An NVMe path that cannot be a directory, and a read-only filesystem: refused at start, clearly."""
    out = {}
    blocker = os.path.join(workdir, "a-file")
    os.makedirs(workdir, exist_ok=True)
    with open(blocker, "w") as f:
        f.write("not a directory")
    cases = {"path_under_a_file": os.path.join(blocker, "nvme")}
    ro_ctx = contextlib.ExitStack()
    try:
        cases["read_only_filesystem"] = ro_ctx.enter_context(tmpfs("1m", ro=True))
    except Unsupported as e:
        out["read_only_filesystem"] = {"skipped": str(e)}
    with ro_ctx:
        for name, path in cases.items():
            try:
                d = start_daemon(os.path.join(workdir, name), nvme_path=path, timeout=60)
                d.stop()
                out[name] = {"refused": False}
            except RuntimeError as e:
                msg = str(e)
                line = next((ln for ln in msg.splitlines() if "cannot start" in ln), msg.splitlines()[0])
                out[name] = {"refused": True, "message": line.strip(), "names_the_path": path in msg}
    return out


def _nvme_only_blocks(c: Client, ns: bytes, hs: list[bytes]) -> list[bytes]:
    return [h for h in hs if c.lookup(ns, [h], lease=False).tiers == ["nvme"]]


def corrupt_files_while_running(workdir: str, block_bytes: int = 64 * KiB, blocks: int = 48) -> dict:
    """Truncate, bit-flip, empty and swap block files under a running daemon: every damaged block
    becomes a counted miss, never wrong bytes; undamaged ones are still served."""
    lay = layout(block_bytes, "reliability/corrupt")
    hs = hashes(blocks, seed=12)
    d = start_daemon(os.path.join(workdir, "corrupt"), "--write-through", "--no-promote-on-hit", "--metrics-port", "0",
                     "--cpu-slot-bytes", str(block_bytes), cpu_bytes=str(16 * block_bytes), nvme_bytes="256MiB")
    try:
        with d.client(transport="grpc") as c:
            ns = c.register_namespace(Namespace(lay))
            statuses = c.put(ns, hs, [payload(h, block_bytes) for h in hs])
            on_disk = _nvme_only_blocks(c, ns, hs)
            files = {h: os.path.join(d.nvme_path, (ns + h).hex() + ".kvb") for h in on_disk}
            victims = on_disk[:6]
            damage = {}
            with open(files[victims[0]], "r+b") as f:                       # truncated
                f.truncate(4096 + block_bytes // 2)
            damage[victims[0]] = "truncated"
            with open(files[victims[1]], "r+b") as f:                       # payload bit flip
                f.seek(4096 + 1234)
                b = f.read(1)
                f.seek(4096 + 1234)
                f.write(bytes([b[0] ^ 0x10]))
            damage[victims[1]] = "payload bit flip"
            with open(files[victims[2]], "r+b") as f:                       # header bit flip
                f.seek(20)
                b = f.read(1)
                f.seek(20)
                f.write(bytes([b[0] ^ 0x01]))
            damage[victims[2]] = "header bit flip"
            open(files[victims[3]], "wb").close()                            # emptied
            damage[victims[3]] = "emptied"
            shutil.copyfile(files[victims[5]], files[victims[4]])           # another block's file
            damage[victims[4]] = "another block's file"
            os.unlink(files[victims[5]])                                    # vanished
            damage[victims[5]] = "deleted"
            got = c.get(ns, hs)
            wrong = sum(1 for h, g in zip(hs, got) if g is not None and not is_exact(h, g, block_bytes))
            damaged_served = sum(1 for h, g in zip(hs, got) if h in damage and g is not None)
            intact_missing = sum(1 for h, g in zip(hs, got) if h not in damage and g is None)
            stats = c.stats()
            metrics = _metrics(d)
            healthy = c.health()
            # a damaged block can be stored again
            again = c.put(ns, victims, [payload(h, block_bytes) for h in victims])
            reserved = sum(is_exact(h, g, block_bytes) for h, g in zip(victims, c.get(ns, victims)))
    finally:
        errors = daemon_log_errors(d)
        d.stop()
    return {"blocks": blocks, "persisted": statuses.count("persisted"), "nvme_only": len(on_disk),
            "damaged": len(damage), "damaged_served": damaged_served, "wrong": wrong,
            "intact_missing": intact_missing,
            "corrupt_dropped_counter": stats["counters"].get("corrupt_dropped", 0),
            "corrupt_metric": _metric_value(metrics, "kvstore_corrupt_blocks_dropped"),
            "healthy": healthy, "stored_again": again, "served_again_exact": reserved, "daemon_log_errors": errors}


def dir_lost_while_running(workdir: str, mode: str, block_bytes: int = 64 * KiB, blocks: int = 48) -> dict:
    """The NVMe directory is deleted (``mode="deleted"``) or its filesystem turns read-only
    (``mode="read_only"``) under a running daemon: puts are acknowledged as stored (not
    persisted), what the CPU tier holds is still served, nothing wrong is served, SIGTERM exits."""
    lay = layout(block_bytes, f"reliability/{mode}")
    hs = hashes(blocks, seed=13)
    extra = hashes(8, seed=14)
    ctx = tmpfs("64m") if mode == "read_only" else contextlib.nullcontext(os.path.join(workdir, "lost-nvme"))
    with ctx as nvme:
        d = start_daemon(os.path.join(workdir, f"lost-{mode}"), "--write-through", "--no-promote-on-hit",
                         "--cpu-slot-bytes", str(block_bytes), cpu_bytes=str(16 * block_bytes), nvme_bytes="256MiB",
                         nvme_path=nvme)
        try:
            with d.client(transport="grpc") as c:
                ns = c.register_namespace(Namespace(lay))
                c.put(ns, hs, [payload(h, block_bytes) for h in hs])
                in_cpu = [h for h in hs if c.lookup(ns, [h], lease=False).tiers == ["cpu"]]
                if mode == "deleted":
                    shutil.rmtree(nvme)
                else:
                    remount(nvme, "ro")
                cpu_got = c.get(ns, in_cpu)   # what the CPU tier held before the fault
                cpu_still_served = sum(is_exact(h, g, block_bytes) for h, g in zip(in_cpu, cpu_got))
                new_statuses, extra_served, wrong = [], 0, 0
                for h in extra:               # new blocks land in the CPU tier and are served from it
                    new_statuses += c.put(ns, [h], [payload(h, block_bytes)])
                    g = c.get(ns, [h])[0]
                    extra_served += is_exact(h, g, block_bytes)
                    wrong += g is not None and not is_exact(h, g, block_bytes)
                got = c.get(ns, hs)
                wrong += sum(1 for h, g in zip(hs, got) if g is not None and not is_exact(h, g, block_bytes))
                wrong += sum(1 for h, g in zip(in_cpu, cpu_got) if g is not None and not is_exact(h, g, block_bytes))
                stats = c.stats()
                healthy = c.health()
                recovered = None
                if mode == "read_only":
                    remount(nvme, "rw")
                    more = hashes(2, seed=15)
                    recovered = c.put(ns, more, [payload(h, block_bytes) for h in more])
        finally:
            errors = daemon_log_errors(d)
            code = d.stop()
    return {"mode": mode, "puts_after_fault": new_statuses, "wrong": wrong, "new_blocks_served": extra_served,
            "cpu_blocks_before_fault": len(in_cpu), "cpu_blocks_still_served": cpu_still_served,
            "write_through_failures": stats["counters"].get("write_through_failures", 0),
            "corrupt_dropped": stats["counters"].get("corrupt_dropped", 0), "healthy": healthy,
            "puts_after_recovery": recovered, "sigterm_exit_code": code, "daemon_log_errors": errors}


def pinned_arena(workdir: str, block_bytes: int = 256 * KiB) -> dict:
    """Every CPU slot pinned by lookup leases: blocks that sit on NVMe must still be served over
    every transport (streamed around the arena), not reported as misses."""
    d = start_daemon(os.path.join(workdir, "pinned"), "--write-through", "--lease-seconds", "30",
                     "--cpu-slot-bytes", str(block_bytes), cpu_bytes=str(4 * block_bytes), nvme_bytes="64MiB")
    out = {}
    try:
        for t in ("grpc", "bulk", "shm"):
            with d.client(transport=t) as c:
                ns = c.register_namespace(Namespace(layout(block_bytes, "reliability/pinned"), cache_salt=t))
                hs = hashes(12, seed=len(t))
                c.put(ns, hs, [payload(h, block_bytes) for h in hs])
                in_cpu = [h for h in hs if c.lookup(ns, [h], lease=False).tiers == ["cpu"]]
                c.lookup(ns, in_cpu, lease=True)          # pin every block the arena holds
                on_nvme = [h for h in hs if h not in in_cpu][:3]
                got = c.get(ns, on_nvme)
                out[t] = {"pinned_cpu_blocks": len(in_cpu), "nvme_blocks_asked": len(on_nvme),
                          "served_exact": sum(is_exact(h, g, block_bytes) for h, g in zip(on_nvme, got))}
                c.delete(ns, hs)                          # frees the arena for the next transport
    finally:
        d.stop()
    return out


# -- 3. memory pressure ----------------------------------------------------------------------------

def memory_refusals(workdir: str) -> dict:
    """Tiers larger than the machine: refused at start with a clear error, never an OOM kill."""
    import psutil

    out = {}
    ram = psutil.virtual_memory().total
    cases = [("cpu_bytes_over_ram", [], {"cpu_bytes": str(2 * ram)})]
    ctx = contextlib.ExitStack()
    try:
        small = ctx.enter_context(tmpfs("8m"))
        cases.append(("cpu_bytes_over_shm_dir", ["--shm-dir", small], {"cpu_bytes": "32MiB"}))
    except Unsupported as e:
        out["cpu_bytes_over_shm_dir"] = {"skipped": str(e)}
    with ctx:
        for name, flags, kw in cases:
            t0 = time.monotonic()
            try:
                d = start_daemon(os.path.join(workdir, name), *flags, timeout=60, **kw)
                out[name] = {"refused": False, "alive": d.alive()}
                d.kill()
            except RuntimeError as e:
                msg = str(e)
                first = msg.splitlines()[0]
                line = next((ln for ln in msg.splitlines() if "cannot start" in ln), first)
                code = int(first.split("exited with ")[1].split(":")[0]) if "exited with" in first else None
                out[name] = {"refused": True, "exit_code": code, "killed_by_signal": code is not None and code < 0,
                             "message": line.strip(), "seconds": round(time.monotonic() - t0, 2)}
    return out


# -- 4. hostile input ------------------------------------------------------------------------------

# Answers the daemon may give to bad input. INTERNAL only as gRPC's own "cannot parse" answer.
DEFINED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "RESOURCE_EXHAUSTED", "OUT_OF_RANGE",
           "PERMISSION_DENIED", "UNAUTHENTICATED", "DATA_LOSS", "UNIMPLEMENTED"}
UNARY = {"Handshake": (pb.HandshakeRequest, pb.HandshakeResponse),
         "RegisterNamespace": (pb.RegisterNamespaceRequest, pb.RegisterNamespaceResponse),
         "Lookup": (pb.LookupRequest, pb.LookupResponse), "LookupBatch": (pb.LookupBatchRequest, pb.LookupBatchResponse),
         "Exists": (pb.ExistsRequest, pb.ExistsResponse), "Delete": (pb.DeleteRequest, pb.DeleteResponse),
         "Stats": (pb.StatsRequest, pb.StatsResponse), "PrepareStore": (pb.PrepareStoreRequest, pb.LeaseResponse),
         "CompleteStore": (pb.LeaseRequest, pb.PutResponse), "AbortStore": (pb.LeaseRequest, pb.Empty),
         "PrepareLoad": (pb.PrepareLoadRequest, pb.LeaseResponse), "CompleteLoad": (pb.LeaseRequest, pb.Empty),
         "BulkGet": (pb.BulkRequest, pb.BulkGetResponse), "BulkPut": (pb.BulkRequest, pb.PutResponse)}


class _Nasty:
    """Hostile field values: wrong lengths, wrong types' bytes, boundaries, other namespaces."""

    def __init__(self, rng: random.Random, good_ns: list[bytes], good_hashes: list[bytes]) -> None:
        self.rng = rng
        self.good_ns = good_ns
        self.good_hashes = good_hashes

    def blob(self) -> bytes:
        r = self.rng
        return r.choice([b"", b"\x00", os.urandom(r.choice([1, 15, 16, 17, 32, 64, 65, 200])),
                         r.choice(self.good_ns), r.choice(self.good_hashes), b"\xff" * r.choice([16, 64, 4096])])

    def ns(self) -> bytes:
        return self.rng.choice(self.good_ns) if self.rng.random() < 0.6 else self.blob()

    def hash_list(self) -> list[bytes]:
        r = self.rng
        n = r.choice([0, 1, 2, 5, 64, 4096, 4097, 9000])
        if n > 100:
            return [os.urandom(16)] * n
        return [r.choice(self.good_hashes) if r.random() < 0.5 else self.blob() for _ in range(n)]

    def uint(self, bits: int = 64) -> int:
        return self.rng.choice([0, 1, 2, 4095, 4096, 16 * KiB, 64 * KiB, 1 << 31, (1 << bits) - 1,
                                self.rng.randrange(1 << bits)])

    def text(self) -> str:
        return self.rng.choice(["", "x", "bfloat16", "opaque", "\u0000\ud7ff\ufffd", "a" * 257, "m" * 5000,
                                "../../etc/passwd", "float8_e4m3fn"])

    def layout(self) -> pb.Layout:
        u = lambda: self.uint(32)  # noqa: E731
        return pb.Layout(model=self.text(), num_layers=u(), num_kv_heads=u(), head_dim=u(), dtype=self.text(),
                         block_tokens=u(), layout=self.text(), kv_per_token=u(), tp_rank=u(), tp_size=u(),
                         pp_rank=u(), pp_size=u(), cp_rank=u(), cp_size=u(), block_bytes=self.uint())

    def request(self, method: str):
        n, r = self, self.rng
        if method == "Handshake":
            return pb.HandshakeRequest(nonce=n.blob(), client_version=n.uint(32))
        if method == "RegisterNamespace":
            return pb.RegisterNamespaceRequest(layout=n.layout(), cache_salt=n.text(), tenant=n.text()) \
                if r.random() < 0.8 else pb.RegisterNamespaceRequest(cache_salt=n.text())
        if method == "Lookup":
            return pb.LookupRequest(namespace_id=n.ns(), hashes=n.hash_list(), no_lease=r.random() < 0.5)
        if method == "LookupBatch":
            k = r.choice([0, 1, 3, 1024, 1025, 3000])
            one = pb.LookupRequest(namespace_id=n.ns(), hashes=n.hash_list()[:8])
            return pb.LookupBatchRequest(requests=[one] * k)
        if method in ("Exists", "Delete"):
            return UNARY[method][0](namespace_id=n.ns(), hashes=n.hash_list())
        if method == "Stats":
            return pb.StatsRequest()
        if method == "PrepareStore":
            return pb.PrepareStoreRequest(namespace_id=n.ns(), hashes=n.hash_list(), parent=n.blob(),
                                          block_bytes=n.uint())
        if method == "PrepareLoad":
            return pb.PrepareLoadRequest(namespace_id=n.ns(), hashes=n.hash_list(), block_bytes=n.uint())
        if method in ("CompleteStore", "AbortStore", "CompleteLoad"):
            return pb.LeaseRequest(lease_id=n.uint())
        return pb.BulkRequest(namespace_id=n.ns(), hashes=n.hash_list(), parent=n.blob(), block_bytes=n.uint(),
                              session=n.blob())

    def put_stream(self, block_bytes: int) -> list:
        n, r = self, self.rng
        header = pb.PutHeader(namespace_id=n.ns(), hashes=n.hash_list()[:r.choice([1, 2, 8, 4097])],
                              parent=n.blob(), block_bytes=r.choice([0, block_bytes, n.uint()]),
                              codec=r.choice([0, 0, 1, 7, 2**32 - 1]))
        msgs = []
        if r.random() < 0.9:
            msgs.append(pb.PutChunk(header=header, data=b"\x01" * r.choice([0, 10, block_bytes])))
        for _ in range(r.choice([0, 1, 2, 5])):
            msgs.append(pb.PutChunk(data=b"\x02" * r.choice([0, 1, block_bytes, 2 * block_bytes])))
            if r.random() < 0.1:
                msgs.append(pb.PutChunk(header=header))
        return msgs


def _mutate(raw: bytes, rng: random.Random) -> bytes:
    """Truncate, bit-flip, splice or replace a serialized message (malformed protobuf)."""
    kind = rng.randrange(4)
    if kind == 0 and raw:
        return raw[:rng.randrange(len(raw))]
    if kind == 1 and raw:
        b = bytearray(raw)
        for _ in range(rng.randint(1, 4)):
            i = rng.randrange(len(b))
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b)
    if kind == 2:
        return raw + os.urandom(rng.randint(1, 64))
    return os.urandom(rng.randint(1, 256))


def _leak_check(c: Client, wait_s: float) -> dict:
    """After the hostile traffic stops and leases had time to expire: no lease, stream or slot leak."""
    deadline = time.monotonic() + wait_s
    while True:
        s = c.stats()
        cpu = s["tiers"]["cpu"]
        leaks = {"leases": s["leases"], "client_leases": s["server"].get("client_leases", 0),
                 "open_streams": s["server"].get("open_streams", 0),
                 "reserved_unpublished_cpu_slots": cpu["blocks"] - cpu["policy_blocks"]}
        if not any(leaks.values()) or time.monotonic() > deadline:
            return leaks
        time.sleep(0.25)


def fuzz(workdir: str, requests: int = 300, seed: int = 7, block_bytes: int = 16 * KiB) -> dict:
    """Malformed, truncated, oversized and wrong-type requests to every RPC through the raw stubs."""
    rng = random.Random(seed)
    lease_s = 1.0
    d = start_daemon(os.path.join(workdir, "fuzz"), "--lease-seconds", str(lease_s), "--cpu-slot-bytes", "16KiB",
                     cpu_bytes="16MiB", nvme_bytes="64MiB")
    outcomes: dict[str, dict[str, int]] = {}
    undefined: list[str] = []
    try:
        with d.client(transport="grpc") as c:
            lay = layout(block_bytes, "reliability/fuzz")
            good_ns = [c.register_namespace(Namespace(lay)),
                       c.register_namespace(Namespace(layout(2 * block_bytes, "reliability/fuzz2")))]
            good_hashes = hashes(32, seed=seed)
            c.put(good_ns[0], good_hashes[:8], [payload(h, block_bytes) for h in good_hashes[:8]])
            # blocks the fuzzer never learns the namespace of: must come through untouched
            kept_ns = c.register_namespace(Namespace(lay, cache_salt="kept"))
            c.put(kept_ns, good_hashes[:8], [payload(h, block_bytes) for h in good_hashes[:8]])
            baseline = c.stats()["tiers"]["cpu"]["blocks"]
            nasty = _Nasty(rng, good_ns, good_hashes)
            channel = grpc.insecure_channel(d.address, options=[("grpc.max_send_message_length", 64 << 20)])
            stub = pb_grpc.KVStoreStub(channel)
            methods = list(UNARY) + ["Put", "Get", "raw"]

            def record(method: str, code: str, details: str) -> None:
                outcomes.setdefault(method, {})
                outcomes[method][code] = outcomes[method].get(code, 0) + 1
                ok = code in DEFINED or (code == "INTERNAL" and "deserializ" in details.lower())
                if not ok:
                    undefined.append(f"{method}: {code}: {details[:200]}")

            for i in range(requests):
                method = methods[i % len(methods)]
                try:
                    if method == "Put":
                        stub.Put(iter(nasty.put_stream(block_bytes)), timeout=15)
                    elif method == "Get":
                        req = pb.GetRequest(namespace_id=nasty.ns(), hashes=nasty.hash_list(),
                                            block_bytes=rng.choice([0, block_bytes, nasty.uint()]),
                                            chunk_bytes=nasty.uint(32))
                        for _ in stub.Get(req, timeout=15):
                            pass
                    elif method == "raw":   # bytes that are not (quite) a message of the method's type
                        name = rng.choice(list(UNARY))
                        req = nasty.request(name)
                        call = channel.unary_unary(f"/kvstore.v1.KVStore/{name}", request_serializer=None,
                                                   response_deserializer=None)
                        call(_mutate(req.SerializeToString(), rng), timeout=15)
                        method = f"raw:{name}"
                    else:
                        getattr(stub, method)(nasty.request(method), timeout=15)
                    record(method, "OK", "")
                except grpc.RpcError as e:
                    record(method, e.code().name, e.details() or "")
            # oversized: one message above the daemon's 16 MiB limit
            try:
                stub.Exists(pb.ExistsRequest(namespace_id=good_ns[0], hashes=[b"\x01" * 64] * (300_000)), timeout=30)
                record("oversized", "OK", "")
            except grpc.RpcError as e:
                record("oversized", e.code().name, e.details() or "")
            channel.close()
            alive = d.alive() and c.health()
            leaks = _leak_check(c, wait_s=4 * lease_s + 3)
            after = c.stats()["tiers"]["cpu"]["blocks"]
            still_exact = sum(is_exact(h, g, block_bytes)
                              for h, g in zip(good_hashes[:8], c.get(kept_ns, good_hashes[:8])))
    finally:
        errors = daemon_log_errors(d)
        d.stop()
    total = sum(sum(v.values()) for v in outcomes.values())
    return {"requests": total, "undefined_answers": len(undefined), "undefined_examples": undefined[:5],
            "outcomes": outcomes, "daemon_alive": alive, "leaks": leaks, "cpu_blocks_before": baseline,
            "cpu_blocks_after": after, "stored_blocks_still_exact": still_exact, "daemon_log_errors": errors}


def slowloris(workdir: str, stallers: int = 24, block_bytes: int = 256 * KiB) -> dict:
    """Clients that open streams and stall, hold leases and vanish, or stop reading a Get: others are
    still served, the stalled streams are cut, and leases, slots and sessions return to baseline."""
    import queue

    lease_s = 1.0
    d = start_daemon(os.path.join(workdir, "slowloris"), "--lease-seconds", str(lease_s), "--cpu-slot-bytes",
                     str(block_bytes), cpu_bytes=str(64 * block_bytes), nvme_bytes="128MiB")
    held = []
    try:
        with d.client(transport="grpc", timeout_s=10) as c:
            lay = layout(block_bytes, "reliability/slow")
            ns = c.register_namespace(Namespace(lay))
            hs = hashes(16, seed=21)
            c.put(ns, hs, [payload(h, block_bytes) for h in hs])
            base = c.stats()
            channel = grpc.insecure_channel(d.address)
            stub = pb_grpc.KVStoreStub(channel)
            gates = []

            def stalled_put(q):
                yield pb.PutChunk(header=pb.PutHeader(namespace_id=ns, hashes=hashes(4, seed=99), block_bytes=block_bytes),
                                  data=b"\x00" * 1000)
                q.get()

            kinds = {"stalled_put": 0, "unread_get": 0, "held_load_lease": 0, "held_store_lease": 0,
                     "stalled_bulk_put": 0}
            for i in range(stallers):
                kind = list(kinds)[i % len(kinds)]
                kinds[kind] += 1
                if kind == "stalled_put":
                    q = queue.Queue()
                    gates.append(q)
                    held.append(stub.Put.future(stalled_put(q)))
                elif kind == "unread_get":
                    it = stub.Get(pb.GetRequest(namespace_id=ns, hashes=hs * 16, chunk_bytes=64 * KiB))
                    next(it)      # read one message, then never again
                    held.append(it)
                elif kind == "held_load_lease":
                    stub.PrepareLoad(pb.PrepareLoadRequest(namespace_id=ns, hashes=hs[:4]))
                elif kind == "held_store_lease":
                    stub.PrepareStore(pb.PrepareStoreRequest(namespace_id=ns, hashes=hashes(2, seed=100 + i)))
                else:
                    hs_ = pb.HandshakeRequest()
                    info = stub.Handshake(hs_)
                    s = socket.create_connection(("127.0.0.1", info.bulk_port))
                    s.sendall(b"KVSBULK1" + info.bulk_ticket)
                    sid = s.recv(16)
                    held.append(s)
                    held.append(stub.BulkPut.future(pb.BulkRequest(namespace_id=ns, hashes=hashes(2, seed=200 + i),
                                                                   block_bytes=block_bytes, session=sid)))
            time.sleep(0.3)
            t0 = time.monotonic()
            served = c.get(ns, hs[:2])
            first_answer_s = time.monotonic() - t0
            exact = sum(is_exact(h, g, block_bytes) for h, g in zip(hs[:2], served))
            leaks = _leak_check(c, wait_s=6 * lease_s + 5)
            after = c.stats()
            for q in gates:
                q.put(None)
            channel.close()
            alive = d.alive() and c.health()
    finally:
        for h in held:
            with contextlib.suppress(Exception):
                h.close() if isinstance(h, socket.socket) else h.cancel()
        errors = daemon_log_errors(d)
        d.stop()
    return {"stallers": kinds, "normal_client_answer_s": round(first_answer_s, 3), "normal_client_exact": exact,
            "leaks_after_expiry": leaks, "leases_expired": after["counters"].get("leases_expired", 0),
            "stalled_streams_cancelled": after["server"].get("stalled_streams_cancelled", 0),
            "cpu_blocks_before": base["tiers"]["cpu"]["blocks"], "cpu_blocks_after": after["tiers"]["cpu"]["blocks"],
            "daemon_alive": alive, "daemon_log_errors": errors}


# -- 5. tenancy ------------------------------------------------------------------------------------

def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def make_test_ca(where: str) -> dict:
    """A throwaway CA and a server certificate for 127.0.0.1/localhost signed by it (openssl CLI)."""
    if shutil.which("openssl") is None:
        raise Unsupported("the openssl command is needed to make a test CA")
    p = {k: os.path.join(where, f"{k}.pem") for k in ("ca_key", "ca", "key", "csr", "cert")}
    ext = os.path.join(where, "ext.cnf")
    with open(ext, "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-keyout", p["ca_key"], "-out", p["ca"],
             "-subj", "/CN=kvstore test CA")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", p["key"], "-out", p["csr"], "-subj", "/CN=localhost")
    _openssl("x509", "-req", "-in", p["csr"], "-CA", p["ca"], "-CAkey", p["ca_key"], "-CAcreateserial", "-days", "1",
             "-out", p["cert"], "-extfile", ext)
    return p


def tenancy(workdir: str, writers: int = 8, block_bytes: int = 16 * KiB) -> dict:
    """Two tenants on one daemon (tokens, quota) and a TLS daemon with a test CA."""
    out: dict = {}
    quota_blocks = 20
    d = start_daemon(os.path.join(workdir, "tenants"), "--token", "alice-token=alice", "--token", "bob-token=bob",
                     "--token", "carol-token=carol", "--quota", f"carol={quota_blocks * block_bytes}",
                     cpu_bytes="32MiB", nvme_bytes="128MiB")
    lay = layout(block_bytes, "reliability/tenancy")
    try:
        alice, bob = d.client(token="alice-token", transport="bulk"), d.client(token="bob-token", transport="grpc")
        hs = hashes(8, seed=31)
        ns_a = alice.register_namespace(Namespace(lay))
        alice.put(ns_a, hs, [payload(h, block_bytes) for h in hs])
        ns_b = bob.register_namespace(Namespace(lay, tenant="alice"))   # claiming alice's tenant is ignored
        refused, leaked = {}, []
        probes = {"lookup": lambda: bob.lookup(ns_a, hs), "exists": lambda: bob.exists(ns_a, hs),
                  "get": lambda: bob.get_into(ns_a, hs[:1], [np.empty(block_bytes, np.uint8)]),
                  "delete": lambda: bob.delete(ns_a, hs), "put": lambda: bob.put(ns_a, hs[:1], [np.zeros(block_bytes, np.uint8)])}
        stub = pb_grpc.KVStoreStub(bob._channel)
        meta = (("authorization", "Bearer bob-token"),)
        probes["prepare_load"] = lambda: stub.PrepareLoad(pb.PrepareLoadRequest(namespace_id=ns_a, hashes=hs), metadata=meta)
        probes["prepare_store"] = lambda: stub.PrepareStore(pb.PrepareStoreRequest(namespace_id=ns_b, hashes=hs), metadata=meta)
        for name, call in probes.items():
            try:
                call()
                leaked.append(name)
            except KVStoreError as e:
                refused[name] = type(e).__name__
            except grpc.RpcError as e:
                refused[name] = e.code().name
        # bob plants garbage under the very same hash bytes, in the only namespace he can write
        planted = bob.put(ns_b, hs, [np.zeros(block_bytes, np.uint8)] * len(hs))
        alice_exact = sum(is_exact(h, g, block_bytes) for h, g in zip(hs, alice.get(ns_a, hs)))
        bob_stats = bob.stats()["server"]
        out["isolation"] = {"namespace_ids_differ": ns_a != ns_b, "refused": refused, "leaked": leaked,
                            "plant_attempt_results": sorted(set(planted)), "victim_blocks_exact": alice_exact,
                            "victim_blocks": len(hs), "bob_sees_tenant": bob_stats["tenant"],
                            "bob_sees_bytes": bob_stats["tenant_bytes"]}
        for token in (None, "Alice-token", "alice-tokeX", "x" * 11, "alice-token" * 100):
            with d.client(token=token) as wrong:
                try:
                    wrong.stats()
                    out.setdefault("bad_tokens_accepted", []).append(repr(token))
                except KVStoreError as e:
                    out.setdefault("bad_tokens_refused", {})[repr(token)[:20]] = type(e).__name__
        # quota under concurrent writers
        errors: dict[str, int] = {}
        stored = []
        lock = threading.Lock()

        def writer(w: int) -> None:
            with d.client(token="carol-token", transport=("grpc", "bulk")[w % 2]) as cl:
                ns = cl.register_namespace(Namespace(lay))
                mine = hashes(12, seed=1000 + w)
                for h in mine:
                    try:
                        r = cl.put(ns, [h], [payload(h, block_bytes)])[0]
                        with lock:
                            stored.append((h, r))
                    except KVStoreError as e:
                        with lock:
                            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(writers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        with d.client(token="carol-token") as carol:
            ns_c = carol.register_namespace(Namespace(lay))
            used = carol.stats()["server"]["tenant_bytes"]
            ok = [h for h, _ in stored]
            got = carol.get(ns_c, ok)
        out["quota"] = {"writers": writers, "attempted_blocks": writers * 12, "quota_bytes": quota_blocks * block_bytes,
                        "tenant_bytes_after": used, "held": used <= quota_blocks * block_bytes,
                        "acknowledged": len(ok), "refusals": errors,
                        "acknowledged_served_exact": sum(is_exact(h, g, block_bytes) for h, g in zip(ok, got))}
        alice.close()
        bob.close()
    finally:
        out["daemon_log_errors"] = daemon_log_errors(d)
        d.stop()
    # lease ids cannot be guessed or hijacked (no auth: every client is the same tenant)
    d = start_daemon(os.path.join(workdir, "leases"), cpu_bytes="16MiB", nvme_bytes="64MiB")
    try:
        with d.client(transport="shm") as victim, d.client(transport="grpc") as thief:
            ns = victim.register_namespace(Namespace(lay))
            assert victim.active_transport == "shm"   # maps the arena
            hs = hashes(2, seed=41)
            lease = victim._call("PrepareStore", pb.PrepareStoreRequest(namespace_id=ns, hashes=hs, block_bytes=block_bytes))
            hijacked = 0
            for guess in list(range(1, 200)) + [lease.lease_id ^ 1, lease.lease_id + 1, lease.lease_id - 1]:
                with contextlib.suppress(KVStoreError):
                    thief._call("CompleteStore", pb.LeaseRequest(lease_id=guess))
                    hijacked += 1
            for blk, h in zip(lease.blocks, hs):
                victim._arena.copy_in([(e.offset, e.length) for e in blk.extents], payload(h, block_bytes))
            results = [r for r in victim._call("CompleteStore", pb.LeaseRequest(lease_id=lease.lease_id)).results]
            exact = sum(is_exact(h, g, block_bytes) for h, g in zip(hs, victim.get(ns, hs)))
        out["lease_hijack"] = {"guesses": 202, "hijacked": hijacked, "victim_completed": len(results), "victim_exact": exact}
    finally:
        d.stop()
    # sha256 block keys travel and work like any other
    d = start_daemon(os.path.join(workdir, "sha"), cpu_bytes="16MiB", nvme_bytes="64MiB")
    try:
        with d.client() as c:
            ns = c.register_namespace(Namespace(lay, cache_salt="sha256"))
            hs = hashes(4, seed=51, algorithm="sha256")
            c.put(ns, hs, [payload(h, block_bytes) for h in hs])
            out["sha256_keys"] = {"hash_bytes": len(hs[0]), "lookup_hits": c.lookup(ns, hs).num_hit,
                                  "exact": sum(is_exact(h, g, block_bytes) for h, g in zip(hs, c.get(ns, hs)))}
    finally:
        d.stop()
    # TLS with a test CA
    try:
        ca = make_test_ca(tempfile.mkdtemp(prefix="kvstore-ca-", dir=workdir))
    except Unsupported as e:
        out["tls"] = {"skipped": str(e)}
        return out
    d = start_daemon(os.path.join(workdir, "tls"), "--tls-cert", ca["cert"], "--tls-key", ca["key"], "--token",
                     "tls-token=t", cpu_bytes="16MiB", nvme_bytes="64MiB",
                     client_kwargs={"root_ca": ca["ca"], "token": "tls-token"})
    try:
        tls: dict = {}
        with Client(f"grpcs://{d.address}", root_ca=ca["ca"], token="tls-token", timeout_s=5) as c:
            ns = c.register_namespace(Namespace(lay))
            hs = hashes(2, seed=61)
            c.put(ns, hs, [payload(h, block_bytes) for h in hs])
            tls["with_ca_exact"] = sum(is_exact(h, g, block_bytes) for h, g in zip(hs, c.get(ns, hs)))
            tls["transport"] = c.active_transport
        for name, kwargs in (("no_ca", {"url": f"grpcs://{d.address}"}), ("plaintext", {"url": d.address}),
                             ("wrong_ca", {"url": f"grpcs://{d.address}", "root_ca": make_test_ca(
                                 tempfile.mkdtemp(prefix="kvstore-ca2-", dir=workdir))["ca"]})):
            with Client(token="tls-token", timeout_s=3, **kwargs) as c:
                try:
                    c.stats()
                    tls[name] = "ACCEPTED"
                except KVStoreError as e:
                    tls[name] = type(e).__name__
        out["tls"] = tls
    finally:
        d.stop()
    return out


# -- 6. load ---------------------------------------------------------------------------------------

LOAD_OPS = ("lookup", "get", "put")


def _load_loop(c, ns: bytes, bb: int, seconds: float, seed: int, shared: list[bytes]) -> dict:
    rng = random.Random(seed)
    lat = {op: [] for op in LOAD_OPS}
    errors: dict[str, int] = {}
    wrong = 0
    mine = hashes(4096, seed=seed)
    n_put = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        op = rng.choice(LOAD_OPS)
        t0 = time.perf_counter()
        try:
            if op == "lookup":
                c.lookup(ns, shared[:32], lease=False)
            elif op == "get":
                batch = rng.sample(shared, 4)
                for h, g in zip(batch, c.get(ns, batch)):
                    wrong += g is not None and not is_exact(h, g, bb)
            else:
                batch = mine[n_put % 4096:n_put % 4096 + 2]
                n_put += 2
                c.put(ns, batch, [payload(h, bb) for h in batch])
        except (KVStoreError, OSError) as e:
            errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
            continue
        lat[op].append(time.perf_counter() - t0)
    return {"lat": lat, "errors": errors, "wrong": wrong}


def _load_worker_main(args) -> None:
    """One load-generating process: ``threads`` sync Clients or ``tasks`` AsyncClients."""
    lay = layout(args.block_bytes, "reliability/load")
    shared = hashes(64, seed=5)
    results = []
    if args.mode == "async":
        async def one(i: int):
            async with AsyncClient(args.url, max_in_flight=1, timeout_s=30) as ac:
                ns = await ac.register_namespace(Namespace(lay))
                rng = random.Random(args.seed + i)
                lat = {op: [] for op in LOAD_OPS}
                errors: dict[str, int] = {}
                wrong = 0
                mine = hashes(4096, seed=args.seed + i)
                n_put = 0
                end = time.monotonic() + args.seconds
                while time.monotonic() < end:
                    op = rng.choice(LOAD_OPS)
                    t0 = time.perf_counter()
                    try:
                        if op == "lookup":
                            await ac.lookup(ns, shared[:32], lease=False)
                        elif op == "get":
                            batch = rng.sample(shared, 4)
                            for h, g in zip(batch, await ac.get(ns, batch)):
                                wrong += g is not None and not is_exact(h, g, args.block_bytes)
                        else:
                            batch = mine[n_put % 4096:n_put % 4096 + 2]
                            n_put += 2
                            await ac.put(ns, batch, [payload(h, args.block_bytes) for h in batch])
                    except (KVStoreError, OSError) as e:
                        errors[type(e).__name__] = errors.get(type(e).__name__, 0) + 1
                        continue
                    lat[op].append(time.perf_counter() - t0)
                return {"lat": lat, "errors": errors, "wrong": wrong}

        async def all_tasks():
            return await asyncio.gather(*(one(i) for i in range(args.clients)))

        results = asyncio.run(all_tasks())
    else:
        out = [None] * args.clients

        def run(i: int) -> None:
            with Client(args.url, timeout_s=30, transport=args.transport) as c:
                ns = c.register_namespace(Namespace(lay))
                out[i] = _load_loop(c, ns, args.block_bytes, args.seconds, args.seed + i, shared)

        ts = [threading.Thread(target=run, args=(i,)) for i in range(args.clients)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        results = out
    with open(args.result_file, "w") as f:   # not stdout: the parent only reads it at the end
        json.dump(results, f)


def _percentiles(xs: list[float]) -> dict:
    if not xs:
        return {"n": 0}
    a = np.sort(np.asarray(xs)) * 1e3
    return {"n": len(a), "p50_ms": round(float(np.percentile(a, 50)), 3), "p99_ms": round(float(np.percentile(a, 99)), 3),
            "max_ms": round(float(a[-1]), 3)}


def _run_load(d: DaemonProcess, plan: list[tuple[str, str, int]], seconds: float, block_bytes: int) -> dict:
    """``plan``: (mode sync|async, transport, clients) per process. Samples the daemon's RSS."""
    procs, files = [], []
    for i, (mode, transport, n) in enumerate(plan):
        fd, result_file = tempfile.mkstemp(prefix="kvstore-load-", suffix=".json")
        os.close(fd)
        files.append(result_file)
        cmd = [sys.executable, os.path.abspath(__file__), "_load-worker", "--url", d.address, "--mode", mode,
               "--transport", transport, "--clients", str(n), "--seconds", str(seconds), "--seed", str(1000 * (i + 1)),
               "--block-bytes", str(block_bytes), "--result-file", result_file]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
    samples = []
    t0 = time.monotonic()
    while any(p.poll() is None for p in procs):
        with contextlib.suppress(OSError):
            samples.append((round(time.monotonic() - t0, 1), rss(d.pid)))
        time.sleep(0.5)
    results = []
    for p, result_file in zip(procs, files):
        _, err = p.communicate()
        if p.returncode != 0:
            raise RuntimeError(f"load worker failed: {err[-2000:]}")
        with open(result_file) as f:
            results += json.load(f)
        os.unlink(result_file)
    lat = {op: [x for r in results for x in r["lat"][op]] for op in LOAD_OPS}
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r["errors"].items():
            errors[k] = errors.get(k, 0) + v
    total_ops = sum(len(v) for v in lat.values())
    return {"clients": sum(n for _, _, n in plan), "seconds": seconds, "ops": total_ops,
            "ops_per_s": round(total_ops / seconds, 1), "errors": errors, "error_count": sum(errors.values()),
            "wrong_bytes": sum(r["wrong"] for r in results),
            "latency": {op: _percentiles(lat[op]) for op in LOAD_OPS}, "rss_samples": samples}


def load(workdir: str, clients: int = 64, seconds: float = 20.0, block_bytes: int = 64 * KiB,
         procs: int = 4) -> dict:
    """64 concurrent clients (processes with threads + one asyncio process) vs one client."""
    d = start_daemon(os.path.join(workdir, "load"), "--cpu-slot-bytes", str(block_bytes), cpu_bytes="128MiB",
                     nvme_bytes="2GiB")
    try:
        with d.client() as c:
            lay = layout(block_bytes, "reliability/load")
            ns = c.register_namespace(Namespace(lay))
            shared = hashes(64, seed=5)
            c.put(ns, shared, [payload(h, block_bytes) for h in shared])
        single = _run_load(d, [("sync", "auto", 1)], seconds, block_bytes)
        n_async = clients // 2
        per_proc = max(1, (clients - n_async) // procs)
        transports = ["auto", "grpc", "bulk", "auto"]
        plan = [("sync", transports[i % 4], per_proc) for i in range(procs)] + [("async", "auto", n_async)]
        many = _run_load(d, plan, seconds, block_bytes)
        anon = [s["RssAnon"] for _, s in many["rss_samples"] if "RssAnon" in s]
        rss_summary = {"rss_anon_start_mib": round(anon[0] / MiB, 1) if anon else None,
                       "rss_anon_peak_mib": round(max(anon) / MiB, 1) if anon else None,
                       "rss_anon_end_mib": round(anon[-1] / MiB, 1) if anon else None,
                       "rss_anon_second_half_growth_mib": round((anon[-1] - anon[len(anon) // 2]) / MiB, 1) if anon else None,
                       "rss_total_end_mib": round(many["rss_samples"][-1][1]["VmRSS"] / MiB, 1) if anon else None}
        with d.client() as c:
            s = c.stats()
        alive = d.alive()
    finally:
        errors = daemon_log_errors(d)
        d.stop()
    for r in (single, many):
        r.pop("rss_samples")
    return {"single_client": single, "concurrent": many, "plan": plan, "block_bytes": block_bytes,
            "throughput_ratio": round(many["ops_per_s"] / max(single["ops_per_s"], 1e-9), 2), "rss": rss_summary,
            "daemon_alive": alive, "leases_left": s["leases"], "daemon_log_errors": errors,
            "demotions": s["counters"].get("demotions", 0), "evictions": s["counters"].get("evictions", 0)}


# -- 7. dependencies down --------------------------------------------------------------------------

def daemon_killed_mid_request(workdir: str, block_bytes: int = 4 * MiB, rounds: int = 1) -> dict:
    """kill -9 while clients of every transport are mid-request: each raises DaemonUnavailable within
    its deadline (never hangs); after a restart on the same port and directory the same Client
    objects work again and every byte they are served is right."""
    out: dict = {"rounds": rounds, "per_transport": {}}
    lay = layout(block_bytes, "reliability/midreq")
    hs = hashes(6, seed=71)
    nvme = os.path.join(workdir, "midreq-nvme")
    d = start_daemon(os.path.join(workdir, "midreq0"), "--write-through", "--cpu-slot-bytes", "1MiB", cpu_bytes="64MiB",
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
            d = start_daemon(os.path.join(workdir, f"midreq{r + 1}"), "--write-through", "--cpu-slot-bytes", "1MiB",
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
        fleet = Fleet(store, f"redis://127.0.0.1:{port}/0", "node-a", "127.0.0.1:1").start()
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


# -- driver ----------------------------------------------------------------------------------------

SCENARIOS = ("crash", "disk", "memory", "fuzz", "slowloris", "tenancy", "load", "deps")


def run_scenario(name: str, workdir: str, quick: bool, args) -> dict:
    t0 = time.monotonic()
    try:
        if name == "crash":
            r = crash_test(workdir, kills=10 if quick else args.kills)
        elif name == "disk":
            r = {}
            for sub, fn in (("disk_full", lambda: disk_full(workdir)),
                            ("unwritable_at_start", lambda: unwritable_dir_at_start(os.path.join(workdir, "unw"))),
                            ("corrupt_files", lambda: corrupt_files_while_running(workdir)),
                            ("pinned_arena", lambda: pinned_arena(workdir)),
                            ("dir_deleted", lambda: dir_lost_while_running(workdir, "deleted")),
                            ("read_only_remount", lambda: dir_lost_while_running(workdir, "read_only"))):
                try:
                    r[sub] = fn()
                except Unsupported as e:
                    r[sub] = {"skipped": str(e)}
        elif name == "memory":
            r = memory_refusals(workdir)
        elif name == "fuzz":
            r = fuzz(workdir, requests=300 if quick else args.requests)
        elif name == "slowloris":
            r = slowloris(workdir, stallers=10 if quick else 40)
        elif name == "tenancy":
            r = tenancy(workdir)
        elif name == "load":
            r = load(workdir, clients=16 if quick else args.clients, seconds=3 if quick else args.seconds)
        elif name == "deps":
            r = {"daemon_killed_mid_request": daemon_killed_mid_request(workdir, rounds=1 if quick else 3)}
            try:
                r["redis_down"] = redis_down(workdir)
            except Unsupported as e:
                r["redis_down"] = {"skipped": str(e)}
        else:
            raise ValueError(name)
    except Unsupported as e:
        r = {"skipped": str(e)}
    r["wall_s"] = round(time.monotonic() - t0, 1)
    return r


def machine() -> dict:
    import psutil

    return {"cpus": os.cpu_count(), "ram_gib": round(psutil.virtual_memory().total / 2**30, 1),
            "python": platform.python_version(), "kernel": platform.release(),
            "grpcio": grpc.__version__, "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime())}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("scenario", choices=SCENARIOS + ("all", "_load-worker"))
    p.add_argument("--quick", action="store_true", help="CI-sized runs")
    p.add_argument("--kills", type=int, default=50)
    p.add_argument("--requests", type=int, default=10000)
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--workdir", default=None)
    # load worker (internal)
    p.add_argument("--url")
    p.add_argument("--mode", default="sync")
    p.add_argument("--transport", default="auto")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-bytes", type=int, default=64 * KiB)
    p.add_argument("--result-file")
    args = p.parse_args(argv)
    if args.scenario == "_load-worker":
        _load_worker_main(args)
        return 0
    names = SCENARIOS if args.scenario == "all" else (args.scenario,)
    workdir = args.workdir or tempfile.mkdtemp(prefix="kvstore-reliability-")
    path = os.path.join(args.out, "reliability.json")
    report = {"machine": machine(), "scenarios": {}}
    if os.path.exists(path) and args.scenario != "all":
        with open(path) as f:
            report = json.load(f)   # update one scenario in place
        report["machine"] = machine()
    for name in names:
        print(f"== {name}", flush=True)
        r = run_scenario(name, os.path.join(workdir, name), args.quick, args)
        r["quick"] = args.quick
        report["scenarios"][name] = r
        print(json.dumps(r, indent=1, default=str)[:3000], flush=True)
        os.makedirs(args.out, exist_ok=True)
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=str)
        with open(os.path.join(args.out, "reliability.md"), "w") as f:
            f.write(render_markdown(report))
    shutil.rmtree(workdir, ignore_errors=True)
    return 0


def _row(*cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def render_markdown(report: dict) -> str:
    """The human summary of reliability.json: one section per scenario, the counts that matter."""
    sc = report["scenarios"]
    m = report["machine"]
    out = ["# kvstore reliability suite", "",
           f"Machine: {m['cpus']} CPUs, {m['ram_gib']} GiB RAM, Python {m['python']}, kernel {m['kernel']}, "
           f"grpcio {m['grpcio']}; run {m['date_utc']} UTC. Regenerate: `python benchmarks/reliability.py all` "
           "(one scenario: `python benchmarks/reliability.py crash`). Raw numbers: reliability.json.", "",
           "Every payload is derived from its block hash, so every byte served is checked. "
           "**Lost** = an acknowledged-persisted block missing after a restart; **wrong** = any served byte "
           "that is not the block's. Both must be 0.", ""]
    summary = []
    if "crash" in sc:
        r = sc["crash"]
        summary.append(_row("kill -9 loop", f"{r['kills']} kills", r["lost"], r["wrong_bytes_served"] + r["wrong_after_restart"],
                            f"DaemonUnavailable x{r['client_errors_by_type'].get('DaemonUnavailable', 0)} while down"))
    if "disk" in sc:
        runs = [g for g in sc["disk"].values() if isinstance(g, dict) and "skipped" not in g]
        summary.append(_row("disk faults", f"{len(runs)} fault scenarios", sum(g.get("lost", 0) for g in runs),
                            sum(g.get("wrong", 0) for g in runs), "puts acknowledged `stored` instead of `persisted`; counted misses"))
    if "fuzz" in sc:
        r = sc["fuzz"]
        summary.append(_row("hostile input", f"{r['requests']} requests", 0, 0,
                            f"{r['undefined_answers']} undefined statuses; no leaks"))
    if "load" in sc:
        r = sc["load"]["concurrent"]
        summary.append(_row("load", f"{r['clients']} clients x {r['seconds']} s", 0, r["wrong_bytes"], f"{r['error_count']} errors"))
    if "deps" in sc:
        per = sc["deps"]["daemon_killed_mid_request"]["per_transport"]
        n = sum(len(v) for v in per.values())
        hung = sum(g["hung"] for v in per.values() for g in v)
        wrong = sum(g["wrong"] + g["wrong_after_restart"] for v in per.values() for g in v)
        summary.append(_row("daemon killed mid-request", f"{n} clients", 0, wrong, f"{hung} hung; all raised DaemonUnavailable"))
    if summary:
        out += [_row("scenario", "runs", "lost", "wrong bytes", "what users saw"), _row(*["---"] * 5), *summary, ""]
    if "crash" in sc:
        r = sc["crash"]
        out += ["## Crash test (kill -9 loop)", "",
                _row("kills", "restarts", "puts", "persisted acks", "gets", "blocks served", "deletes",
                     "lost", "wrong (live)", "wrong (after restart)", "resurrected deletes", "daemon log errors"),
                _row(*["---"] * 12),
                _row(r["kills"], r["restarts"], r["puts"], r["persisted_acks"], r["gets"], r["blocks_served"],
                     r["deletes"], r["lost"], r["wrong_bytes_served"], r["wrong_after_restart"],
                     r["resurrected_after_delete"], r["daemon_log_errors"]), "",
                f"Traffic: {r['config']['workers']} clients ({', '.join(r['config']['transports'])}) on a pool of "
                f"{r['config']['pool_blocks']} blocks of {r['config']['block_bytes'] // 1024} KiB, CPU tier of "
                f"{r['config']['cpu_blocks']} blocks (constant demotion), {r['write_back_cycles']} of the runs in "
                f"write-back mode. Blocks checked after restarts: {r['blocks_checked']} "
                f"({r['blocks_served_after_restart']} present). Errors clients saw: "
                f"{r['client_errors_by_type'] or 'none'}. Persisted blocks a *live* get reported as a miss: "
                f"{r['persisted_missed_live']} (by transport: {r.get('persisted_missed_live_by_transport') or 'none'}).", ""]
    if "disk" in sc:
        r = sc["disk"]
        out += ["## Disk faults", "", _row("fault", "what users saw", "lost", "wrong", "counters / notes"), _row(*["---"] * 5)]
        f = r.get("disk_full", {})
        if "skipped" in f:
            out.append(_row("disk full (8 MiB tmpfs)", "skipped: " + f["skipped"], "", "", ""))
        elif f:
            out.append(_row("disk full (8 MiB tmpfs)",
                            f"{f['acknowledged_persisted']} puts `persisted`, then {f['acknowledged_stored_only']} `stored` "
                            f"(not persisted); newest {f['recent_blocks_served_from_cpu']}/8 served from CPU; after "
                            f"freeing space: `{f['put_after_freeing']}`", f["lost"], f["wrong"],
                            f"write_through_failures={f['write_through_failures']}, healthy={f['healthy']}"))
        for case, g in r.get("unwritable_at_start", {}).items():
            out.append(_row(f"unwritable dir at start ({case})", g.get("message", g.get("skipped", "")), "", "", ""))
        g = r.get("corrupt_files", {})
        if g:
            out.append(_row("block files truncated / bit-flipped / emptied / swapped / deleted under a running daemon",
                            f"{g['damaged']} damaged blocks -> misses ({g['damaged_served']} served); "
                            f"{g['intact_missing']} intact blocks missing; stored again: {g['served_again_exact']}/6 exact",
                            0, g["wrong"], f"corrupt_dropped={g['corrupt_dropped_counter']}, "
                            f"kvstore_corrupt_blocks_dropped={g['corrupt_metric']:g}"))
        g = r.get("pinned_arena", {})
        if g:
            out.append(_row("every CPU slot pinned (lookup leases), blocks on NVMe requested",
                            "; ".join(f"{t}: {v['served_exact']}/{v['nvme_blocks_asked']} served" for t, v in g.items()),
                            0, 0, "streamed around the arena instead of a false miss"))
        for key, label in (("dir_deleted", "NVMe directory deleted while running"),
                           ("read_only_remount", "NVMe filesystem remounted read-only while running")):
            g = r.get(key, {})
            if "skipped" in g:
                out.append(_row(label, "skipped: " + g["skipped"], "", "", ""))
            elif g:
                out.append(_row(label, f"puts `{'/'.join(sorted(set(g['puts_after_fault'])))}`; new blocks served "
                                f"{g['new_blocks_served']}/8; CPU-resident blocks served {g['cpu_blocks_still_served']}/"
                                f"{g['cpu_blocks_before_fault']}; after recovery: {g['puts_after_recovery']}; "
                                f"SIGTERM exit {g['sigterm_exit_code']}", "n/a (medium gone)", g["wrong"],
                                f"write_through_failures={g['write_through_failures']}, corrupt_dropped={g['corrupt_dropped']}"))
        out.append("")
    if "memory" in sc:
        out += ["## Memory pressure", "", _row("configuration", "outcome", "exit code", "seconds"), _row(*["---"] * 4)]
        for case, g in sc["memory"].items():
            if isinstance(g, dict) and "refused" in g:
                out.append(_row(case, g.get("message", ""), g.get("exit_code"), g.get("seconds")))
            elif isinstance(g, dict) and "skipped" in g:
                out.append(_row(case, "skipped: " + g["skipped"], "", ""))
        if "load" in sc and sc["load"].get("rss"):
            rr = sc["load"]["rss"]
            out += ["", f"Daemon RSS under the load test (anonymous memory, i.e. excluding the shared arena): start "
                        f"{rr['rss_anon_start_mib']} MiB, peak {rr['rss_anon_peak_mib']} MiB, end {rr['rss_anon_end_mib']} MiB "
                        f"(growth over the second half: {rr['rss_anon_second_half_growth_mib']} MiB); total RSS at the end "
                        f"{rr['rss_total_end_mib']} MiB."]
        out.append("")
    if "fuzz" in sc:
        r = sc["fuzz"]
        codes: dict[str, int] = {}
        for per in r["outcomes"].values():
            for k, v in per.items():
                codes[k] = codes.get(k, 0) + v
        out += ["## Hostile input", "",
                f"Fuzz: {r['requests']} randomized requests over every RPC through the raw stubs (structured "
                "nasty values, huge batch counts, namespace/layout confusion, plus serialized messages truncated, "
                f"bit-flipped or replaced by garbage, and one oversized message). Answers: {codes}. "
                f"Undefined answers: **{r['undefined_answers']}**; daemon alive: {r['daemon_alive']}; "
                f"leaks after lease expiry: {r['leaks']}; unrelated stored blocks still exact: "
                f"{r['stored_blocks_still_exact']}/8; daemon log errors: {r['daemon_log_errors']}. (INTERNAL appears only "
                "as gRPC's own answer to bytes that are not a protobuf message.)", ""]
    if "slowloris" in sc:
        r = sc["slowloris"]
        out += [f"Slowloris: {r['stallers']} (more stalled streams than the daemon's 16 worker threads). A normal "
                f"client was answered in {r['normal_client_answer_s']} s (exact: {r['normal_client_exact']}/2); "
                f"stalled streams cancelled: {r['stalled_streams_cancelled']}; leases expired: {r['leases_expired']}; "
                f"after expiry: {r['leaks_after_expiry']}; CPU blocks {r['cpu_blocks_before']} -> {r['cpu_blocks_after']}.", ""]
    if "tenancy" in sc:
        r = sc["tenancy"]
        iso, q = r["isolation"], r["quota"]
        out += ["## Tenancy", "",
                f"- Tenant B against tenant A's namespace: {iso['refused']} (the same answer as a namespace that does "
                f"not exist); leaked: {iso['leaked'] or 'nothing'}.",
                f"- B claiming A's tenant name gets its own namespace ({iso['namespace_ids_differ']}); B writing garbage "
                f"under the very same hash bytes left A's blocks exact: {iso['victim_blocks_exact']}/{iso['victim_blocks']}.",
                f"- Wrong tokens refused: {r.get('bad_tokens_refused')}; accepted: {r.get('bad_tokens_accepted', 'none')}.",
                f"- Quota {q['quota_bytes']} bytes, {q['writers']} concurrent writers attempting {q['attempted_blocks']} blocks: "
                f"tenant holds {q['tenant_bytes_after']} bytes (held: {q['held']}), refusals {q['refusals']}, "
                f"acknowledged blocks exact {q['acknowledged_served_exact']}/{q['acknowledged']}.",
                f"- Lease hijack: {r['lease_hijack']}.", f"- sha256 block keys: {r['sha256_keys']}.",
                f"- TLS with a test CA: {r['tls']}.", ""]
    if "load" in sc:
        r = sc["load"]
        out += ["## Load", "", _row("run", "clients", "ops/s", "errors", "wrong bytes", "lookup p50/p99 ms",
                                    "get p50/p99 ms", "put p50/p99 ms"), _row(*["---"] * 8)]
        for name in ("single_client", "concurrent"):
            g = r[name]
            lat = g["latency"]
            out.append(_row(name, g["clients"], g["ops_per_s"], g["error_count"], g["wrong_bytes"],
                            *[f"{lat[op].get('p50_ms')} / {lat[op].get('p99_ms')}" for op in LOAD_OPS]))
        out += ["", f"{r['concurrent']['seconds']} s per run, {r['block_bytes'] // 1024} KiB blocks; get = 4 blocks, "
                "put = 2 new blocks, lookup = a 32-block chain. Clients: " + ", ".join(
                    f"{n}x {mode}/{t}" for mode, t, n in r["plan"]) + f". Throughput vs one client: "
                f"{r['throughput_ratio']}x (the machine has {m['cpus']} cores shared by clients and daemon, so "
                "latency grows with queueing). Leases left after: " + str(r["leases_left"]) + ".", ""]
    if "deps" in sc:
        r = sc["deps"]
        out += ["## Dependencies down", "", _row("transport", "raised", "seconds to raise (kill -> exception)",
                                                 "hung", "reconnected after restart (s)", "hits after restart", "wrong"),
                _row(*["---"] * 7)]
        for t, runs in r["daemon_killed_mid_request"]["per_transport"].items():
            for g in runs:
                out.append(_row(t, g["raised"], g["seconds_to_raise"], g["hung"], g["reconnected_s"],
                                g["hits_after_restart"], g["wrong"] + g["wrong_after_restart"]))
        rd = r.get("redis_down", {})
        out += ["", f"Client deadline {r['daemon_killed_mid_request']['client_timeout_s']} s. The same Client objects "
                "were reused after the daemon came back on the same port and directory.", "",
                f"Redis killed under a fleet-publishing Store: {rd}", ""]
    return "\n".join(out)


if __name__ == "__main__":
    sys.exit(main())
