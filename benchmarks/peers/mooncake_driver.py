"""Mooncake Store put / get GB/s, run by benchmarks/bench_peers.py in the Mooncake venv.

    unshare -n sh -c 'ip link set lo up && exec PYTHON mooncake_driver.py JOB.json RESULT.json'

Runs inside a private network namespace (only loopback exists there): Mooncake's store node and
transfer engine also open listeners on 0.0.0.0, which in that namespace reach nothing but
127.0.0.1. Every server this script starts (master, HTTP metadata server, store node) is its
child, dies with it (PR_SET_PDEATHSIG) and is stopped in a ``finally``; every wait is bounded.

Job: {"block_bytes": N, "count": N, "reps": N, "modes": ["tcp", "local"], "segment_bytes": N}
  tcp:   master + metadata server + a separate store node (``mooncake_client``) holding all the
         memory; the Python client mounts none, so every put and get crosses TCP to that node.
  local: master + metadata server, the Python client mounts the memory itself ("client inside
         the store process"): puts and gets are copies inside one process.
Both use registered, pooled, already-touched buffers and the batched zero-copy API
(batch_put_from / batch_get_into), one call per pass (per 1024 keys). Fresh keys every pass; a pass's keys are
removed (force: past the read lease) before the next. Standard library, numpy and mooncake only.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

from driver_common import die_with_parent, free_port, stop_process, touched, wait_port  # run as a script: its folder is sys.path[0]

BIN = os.path.dirname(sys.executable)
# keys per batch_put_from / batch_get_into call: one call of 4096 64 KiB slices overflows the TCP
# transport's lane queue here ("queue-full rejection", put error -800); 2048 did not, 1024 leaves room
# (64, 256, 1024 and 2048 keys per call measured within noise of each other)
BATCH_KEYS = 1024


def listeners() -> list[str]:
    """Listening TCP sockets in this namespace (shown in the result: where Mooncake listens)."""
    try:
        out = subprocess.run(["ss", "-ltnH"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return sorted({line.split()[3] for line in out.splitlines() if len(line.split()) > 3})


class Servers:
    """Master, metadata server and (optionally) a store node, all children of this process."""

    def __init__(self, workdir: str, store_node_bytes: int) -> None:
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.master_port, self.meta_port = free_port(), free_port()
        self.master = f"127.0.0.1:{self.master_port}"
        self.metadata = f"http://127.0.0.1:{self.meta_port}/metadata"
        self.workdir = workdir
        try:
            self._start("master", [os.path.join(BIN, "mooncake_master"), "--rpc_address=127.0.0.1",
                                   f"--rpc_port={self.master_port}", "--metrics_host=127.0.0.1",
                                   f"--metrics_port={free_port()}", "--logtostderr"], self.master_port)
            self._start("metadata", [os.path.join(BIN, "mooncake_http_metadata_server"), "--host", "127.0.0.1",
                                     "--port", str(self.meta_port), "--log-level", "WARNING"], self.meta_port)
            if store_node_bytes:
                node_port = free_port()
                self._start("store-node", [os.path.join(BIN, "mooncake_client"), "--host=127.0.0.1",
                                           f"--port={node_port}", f"--global_segment_size={store_node_bytes}",
                                           f"--master_server_address={self.master}",
                                           f"--metadata_server={self.metadata}", "--protocol=tcp",
                                           "--logtostderr"], node_port)
        except BaseException:
            self.stop()
            raise

    def _start(self, name: str, cmd: list[str], port: int) -> None:
        log = open(os.path.join(self.workdir, f"mooncake-{name}.log"), "wb")
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
        log.close()
        self.procs.append((name, p))
        wait_port(port, p, name)

    def stop(self) -> None:
        for _, p in reversed(self.procs):
            stop_process(p)
        self.procs = []


def measure(mode: str, job: dict, workdir: str) -> dict:
    from mooncake.store import MooncakeDistributedStore

    size, count, reps = job["block_bytes"], job["count"], job["reps"]
    total = size * count
    segment = job["segment_bytes"]
    batch = job.get("batch_keys", BATCH_KEYS)
    servers = Servers(workdir, segment if mode == "tcp" else 0)
    store = None
    try:
        store = MooncakeDistributedStore()
        rc = store.setup("127.0.0.1", servers.metadata, 0 if mode == "tcp" else segment, 64 << 20, "tcp", "",
                         servers.master)
        if rc != 0:
            raise RuntimeError(f"MooncakeDistributedStore.setup returned {rc}")
        src = touched(total, random=True)
        dst = touched(total, random=False)
        for buf in (src, dst):
            if store.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
                raise RuntimeError("register_buffer failed")
        src_ptrs = [src.ctypes.data + i * size for i in range(count)]
        dst_ptrs = [dst.ctypes.data + i * size for i in range(count)]
        sizes = [size] * count
        puts, gets = [], []
        ok = True
        for r in range(reps + 1):  # pass 0 warms connections and buffers; not counted
            keys = [f"peer-bench-{size}-{r}-{i}" for i in range(count)]
            t = time.perf_counter()
            res = []
            for i in range(0, count, batch):
                res += store.batch_put_from(keys[i:i + batch], src_ptrs[i:i + batch], sizes[i:i + batch])
            t_put = time.perf_counter() - t
            if any(x != 0 for x in res):
                raise RuntimeError(f"batch_put_from failed: {sorted(set(res))}")
            dst[:] = 0  # outside the timing: a get must really land the bytes
            t = time.perf_counter()
            res = []
            for i in range(0, count, batch):
                res += store.batch_get_into(keys[i:i + batch], dst_ptrs[i:i + batch], sizes[i:i + batch])
            t_get = time.perf_counter() - t
            if any(x != size for x in res):
                raise RuntimeError(f"batch_get_into returned {sorted(set(res))}")
            ok = ok and bool(np.array_equal(src, dst))
            # force: past the read lease, so the next pass reuses the same (touched) memory
            if any(x != 0 for x in store.batch_remove(keys, force=True)):
                raise RuntimeError("batch_remove failed")
            if r:
                puts.append(total / t_put / 1e9)
                gets.append(total / t_get / 1e9)
        return {"put_gbps": statistics.median(puts), "get_gbps": statistics.median(gets), "put_runs": puts,
                "get_runs": gets, "verified": ok, "listeners": listeners()}
    finally:
        if store is not None:
            try:
                store.close()
            except Exception:  # noqa: BLE001 - the servers are stopped regardless
                pass
        servers.stop()


def main() -> int:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    workdir = os.path.dirname(os.path.abspath(result_path))
    out = {"version": _version()}
    for mode in job["modes"]:
        try:
            out[mode] = measure(mode, job, workdir)
        except Exception as e:  # noqa: BLE001 - reported per mode, the other mode still runs
            out[mode] = {"error": f"{type(e).__name__}: {e}"}
    with open(result_path, "w") as f:
        json.dump(out, f)
    return 0


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("mooncake-transfer-engine-non-cuda")
    except Exception:  # noqa: BLE001
        return "?"


if __name__ == "__main__":
    sys.exit(main())
