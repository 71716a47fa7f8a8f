"""Scenario 2, disk faults: a full disk, an unwritable directory, block files damaged, deleted or
remounted read-only under a running daemon, and every CPU slot pinned while NVMe blocks are asked for.

What users must see: puts acknowledged ``stored`` instead of ``persisted``, damaged blocks as misses,
never a wrong byte, and counters that say why.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import urllib.request

from kvstore import Namespace
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.ops.local_daemon import LocalDaemon, start_local_daemon
from kvstore.tiers.nvme import find_blocks

from .common import KiB, Unsupported, daemon_log_errors, hashes, is_exact, layout, payload, remount, tmpfs


# -- 2. disk faults --------------------------------------------------------------------------------

def _metrics(d: LocalDaemon) -> str:
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
        d = start_local_daemon(os.path.join(workdir, "full"), "--write-through", "--metrics-port", "0",
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
                d = start_local_daemon(os.path.join(workdir, name), nvme_path=path, timeout=60)
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
    """Tear, bit-flip, zero and swap blocks' slots in the slab files under a running daemon:
    every damaged block becomes a counted miss, never wrong bytes; undamaged ones are still served."""
    lay = layout(block_bytes, "reliability/corrupt")
    hs = hashes(blocks, seed=12)
    d = start_local_daemon(os.path.join(workdir, "corrupt"), "--write-through", "--no-promote-on-hit", "--metrics-port", "0",
                     "--cpu-slot-bytes", str(block_bytes), cpu_bytes=str(16 * block_bytes), nvme_bytes="256MiB")
    try:
        with d.client(transport="grpc") as c:
            ns = c.register_namespace(Namespace(lay))
            statuses = c.put(ns, hs, [payload(h, block_bytes) for h in hs])
            on_disk = _nvme_only_blocks(c, ns, hs)
            where = find_blocks(d.nvme_path)
            victims = on_disk[:6]
            path, offset = {h: where[ns + h] for h in victims}, {h: where[ns + h][1] for h in victims}
            damage = {}

            def rewrite(h: bytes, at: int, data: bytes) -> None:
                with open(path[h][0], "r+b") as f:
                    f.seek(offset[h] + at)
                    f.write(data)

            def flip(h: bytes, at: int, bit: int) -> None:
                with open(path[h][0], "rb") as f:
                    f.seek(offset[h] + at)
                    b = f.read(1)
                rewrite(h, at, bytes([b[0] ^ bit]))

            rewrite(victims[0], 4096 + block_bytes // 2, bytes(block_bytes // 2))   # torn: its second half never written
            damage[victims[0]] = "torn"
            flip(victims[1], 4096 + 1234, 0x10)
            damage[victims[1]] = "payload bit flip"
            flip(victims[2], 20, 0x01)
            damage[victims[2]] = "header bit flip"
            rewrite(victims[3], 0, bytes(4096 + block_bytes))                  # the whole slot zeroed
            damage[victims[3]] = "zeroed"
            with open(path[victims[5]][0], "rb") as f:                       # another block's slot
                f.seek(offset[victims[5]])
                rewrite(victims[4], 0, f.read(4096 + block_bytes))
            damage[victims[4]] = "another block's slot"
            rewrite(victims[5], 0, bytes(4096))                                # header erased
            damage[victims[5]] = "header erased"
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
        d = start_local_daemon(os.path.join(workdir, f"lost-{mode}"), "--write-through", "--no-promote-on-hit",
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
    d = start_local_daemon(os.path.join(workdir, "pinned"), "--write-through", "--lease-seconds", "30",
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
