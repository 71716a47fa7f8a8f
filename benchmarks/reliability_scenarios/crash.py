"""Scenario 1, the crash test: random kill -9 of the daemon during mixed traffic, restart, verify.

A ledger of what clients were told (persisted, deleted) is the ground truth: after every restart
each acknowledged-persisted block must be served exactly, and no deleted block may come back.
"""

from __future__ import annotations

import os
import random
import threading
import time

from kvstore import KVLayout, Namespace
from kvstore.client import Client
from kvstore.errors import DaemonUnavailable, KVStoreError
from kvstore.ops.local_daemon import LocalDaemon, start_local_daemon

from .common import KiB, daemon_log_errors, hashes, is_exact, kill_and_reap, layout, payload


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


def _crash_verify(d: LocalDaemon, ns_layout: KVLayout, pool: list[bytes], ledger: _CrashLedger) -> dict:
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
        d = start_local_daemon(os.path.join(workdir, f"run{cycle}"), *flags, cpu_bytes=str(16 * block_bytes),
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
