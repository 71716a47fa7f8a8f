"""Tenant segments cycling between tenants while a client keeps every one it was handed (issue 35,
attack 5): how much shared memory the host holds beyond the CPU arena.

A daemon with two tenants and tenant segments (auth on). Each cycle the holder (tenant A,
segment_holder.py, its own process) fills the arena and takes and keeps a descriptor and a mapping
of every segment A owns; then tenant B's honest client fills the arena, so every segment passes
to B and gets fresh memory. After each cycle the scenario counts the memory of every tenant
segment the daemon, the holder and B's client still reference (``st_blocks`` of each distinct
``memfd``, through ``/proc/<pid>/fd`` and ``/proc/<pid>/map_files``): the daemon's current
segments (the arena) and the replaced ones. The host's ``Shmem`` (``/proc/meminfo``, which
other processes on the host move too) is recorded beside it.

The bound checked: current + replaced <= ``cpu_bytes`` + tenants x
``max_held_segment_bytes_per_tenant`` (docs/guarantees.md).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.ops.local_daemon import start_local_daemon
from kvstore.units import parse_size

HOLDER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "segment_holder.py")
LAYOUT = KVLayout(model="reliability/segments", num_layers=2, num_kv_heads=2, head_dim=128, dtype="bfloat16",
                  block_tokens=128)   # 256 KiB blocks, as the holder's
MiB = 1 << 20
SEGMENT_NAME = "/memfd:kvstore-cpu-segment-"


def host_shmem() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1]) * 1024
    return 0


def segment_memory(daemon_pid: int, pids: list[int]) -> dict:
    """Bytes in memory of the tenant segments these processes reference, by whether the daemon
    still holds them (its arena) or not (replaced)."""
    seen: dict[int, tuple[int, bool]] = {}
    for pid in [daemon_pid, *pids]:
        for folder in ("fd", "map_files"):
            try:
                names = os.listdir(f"/proc/{pid}/{folder}")
            except OSError:
                continue
            for name in names:
                path = f"/proc/{pid}/{folder}/{name}"
                try:
                    if not os.readlink(path).startswith(SEGMENT_NAME):
                        continue
                    st = os.stat(path)
                except OSError:
                    continue
                current = seen.get(st.st_ino, (0, False))[1] or (pid == daemon_pid and folder == "fd")
                seen[st.st_ino] = (st.st_blocks * 512, current)
    return {"current_bytes": sum(b for b, cur in seen.values() if cur),
            "replaced_bytes": sum(b for b, cur in seen.values() if not cur),
            "replaced_segments": sum(1 for _, cur in seen.values() if not cur)}


def segments_cycle(workdir: str, cycles: int = 3, cpu_bytes: str = "64MiB", segment_bytes: str = "4MiB",
                   held_cap: str | None = None, mode: str = "keep") -> dict:
    """``mode``: the holder keeps its segments untouched (``keep``) or writes every page of them
    after each fill (``touch``). ``held_cap``: the daemon's ``max_held_segment_bytes_per_tenant``
    (None: its default, ``cpu_bytes``)."""
    arena, cap = parse_size(cpu_bytes), parse_size(held_cap or cpu_bytes)
    env = {"KVSTORE_CPU_SEGMENT_BYTES": segment_bytes, "KVSTORE_ADMIN_TENANTS": '["ops"]'}
    if held_cap:
        env["KVSTORE_MAX_HELD_SEGMENT_BYTES_PER_TENANT"] = held_cap
    shm_dir = os.path.join(workdir, "shm")
    os.makedirs(shm_dir, exist_ok=True)
    shmem_before = host_shmem()
    d = start_local_daemon(workdir, "--token", "a-token=a", "--token", "b-token=b", "--token", "ops-token=ops",
                           "--shm-dir", shm_dir,
                           cpu_bytes=cpu_bytes, nvme_bytes="0", env=env)
    holder = subprocess.Popen([sys.executable, HOLDER, d.address, "a-token", mode], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    rounds, n = [], arena // LAYOUT.block_bytes
    try:
        with d.client(token="b-token", timeout_s=60) as b:
            ns_b = b.register_namespace(Namespace(LAYOUT))
            for cycle in range(cycles):
                holder.stdin.write(f"fill {cycle} {n}\n")
                holder.stdin.flush()
                a = json.loads(holder.stdout.readline())
                hashes = ChainHasher(seed=1000 + cycle).chain(list(range(n * LAYOUT.block_tokens)), LAYOUT.block_tokens)
                data = [bytes([(cycle + i) % 251]) * LAYOUT.block_bytes for i in range(n)]
                b_stored = b.put(ns_b, hashes, data).count("stored")
                b_exact = b.get(ns_b, hashes[-4:]) == data[-4:]
                memory = segment_memory(d.pid, [holder.pid, os.getpid()])
                rounds.append({"cycle": cycle + 1, "a_stored": a["stored"], "a_held_segments": a["held_segments"],
                               "a_held_bytes": a["held_bytes"], "a_refused_by_limit": a["refused"].get("limit", 0),
                               "a_put_error": a["error"],
                               "b_stored": b_stored, "b_exact": b_exact, "b_transport": b.active_transport, **memory,
                               "host_shmem_delta_bytes": host_shmem() - shmem_before})
        with d.client(token="ops-token", transport="grpc") as ops:
            cpu = ops.stats()["tiers"]["cpu"]
        holder.stdin.write("exit\n")
        holder.stdin.flush()
        holder.wait(30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
        d.stop()
    bound = arena + 2 * cap
    worst = max(r["current_bytes"] + r["replaced_bytes"] for r in rounds)
    return {"cycles": cycles, "cpu_bytes": arena, "segment_bytes": parse_size(segment_bytes), "held_cap_bytes": cap,
            "mode": mode, "bound_bytes": bound, "worst_segment_bytes": worst, "rounds": rounds,
            "daemon_cpu_tier": {k: v for k, v in cpu.items() if "segment" in k},
            "ok": worst <= bound and all(r["b_exact"] and r["b_stored"] == n for r in rounds)}
