"""LMCache put / get GB/s, run by benchmarks/bench_peers.py in the LMCache venv.

    unshare -n sh -c 'ip link set lo up && exec PYTHON lmcache_driver.py JOB.json RESULT.json'

Job: {"block_bytes": N, "count": N, "disk_count": N, "reps": N, "modes": ["server", "disk"], "dir": PATH}
(disk moves ``disk_count`` blocks per pass, the server ``count``)

server: LMCache's standalone server (``lmcache_server 127.0.0.1 PORT cpu``, the lm:// remote
        backend), a child of this process (dies with it, stopped in a ``finally``). The client
        speaks LMCache's own protocol (lmcache.v1.protocol, what LMCServerConnector sends) on one
        connection, sending from and ``recv_into`` pooled, already-touched buffers: the best a
        client of that server can do. The server does not acknowledge a PUT, so a put pass ends
        when the server answers an EXIST sent after the last PUT (it serves one connection in
        order). The server has no delete: every pass overwrites the same keys.
disk:   LMCache's LocalDiskBackend (``local_disk`` + ``extra_config.use_odirect``, its default 4
        I/O threads) in this process, driven the way its storage manager drives it: a put copies
        each block from the caller's buffer into a MemoryObj of LMCache's CPU allocator and
        submits them all in one batched_submit_put_task; the pass ends when every write's
        completion callback has run. A get is one batched_get_blocking (concurrent O_DIRECT reads
        into MemoryObjs) plus the copy into the caller's buffers. Both also report the backend
        alone (without the copy in / out). LMCache's writes do not fsync.
Fresh keys every disk pass, removed afterwards. Bounded waits everywhere.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import threading
import time

import numpy as np

from driver_common import die_with_parent, free_port, stop_process, touched  # run as a script: its folder is sys.path[0]

BIN = os.path.dirname(sys.executable)
WAIT_S = 300.0


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("lmcache_server closed the connection")
        got += k


def measure_server(job: dict, workdir: str) -> dict:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.protocol import ClientCommand, ClientMetaMessage, ServerMetaMessage, ServerReturnCode

    size, count, reps = job["block_bytes"], job["count"], job["reps"]
    total = size * count
    port = free_port()
    log = open(os.path.join(workdir, "lmcache-server.log"), "wb")
    proc = subprocess.Popen([os.path.join(BIN, "lmcache_server"), "127.0.0.1", str(port), "cpu"], stdout=log,
                            stderr=subprocess.STDOUT, preexec_fn=die_with_parent)
    log.close()
    sock = None
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"lmcache_server exited with {proc.returncode}")
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=WAIT_S)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise TimeoutError("lmcache_server did not listen in 120 s") from None
                time.sleep(0.2)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        src = touched(total, random=True)
        dst = touched(total, random=False)
        src_v, dst_v = memoryview(src).cast("B"), memoryview(dst).cast("B")
        keys = [CacheEngineKey("peer-bench", 1, 0, i + 1, torch.uint8) for i in range(count)]
        shape = torch.Size([size])
        put_hdr = [ClientMetaMessage(ClientCommand.PUT, k, size, MemoryFormat.BINARY, torch.uint8, shape).serialize()
                   for k in keys]
        get_hdr = [ClientMetaMessage(ClientCommand.GET, k, 0, MemoryFormat.BINARY, torch.uint8, shape).serialize()
                   for k in keys]
        exist_last = ClientMetaMessage(ClientCommand.EXIST, keys[-1], 0, MemoryFormat.BINARY, torch.uint8,
                                       shape).serialize()
        reply = memoryview(bytearray(ServerMetaMessage.packlength()))
        puts, gets, ok = [], [], True
        for r in range(reps + 1):  # pass 0 warms the connection and the server; not counted
            t = time.perf_counter()
            for i in range(count):
                sock.sendall(put_hdr[i])
                sock.sendall(src_v[i * size:(i + 1) * size])
            sock.sendall(exist_last)  # answered once every PUT before it is stored
            recv_exact(sock, reply)
            t_put = time.perf_counter() - t
            if ServerMetaMessage.deserialize(bytes(reply)).code != ServerReturnCode.SUCCESS:
                raise RuntimeError("lmcache_server lost the last PUT")
            dst[:] = 0
            t = time.perf_counter()
            for i in range(count):
                sock.sendall(get_hdr[i])
                recv_exact(sock, reply)
                meta = ServerMetaMessage.deserialize(bytes(reply))
                if meta.code != ServerReturnCode.SUCCESS or meta.length != size:
                    raise RuntimeError(f"lmcache_server GET failed ({meta.code}, {meta.length} bytes)")
                recv_exact(sock, dst_v[i * size:(i + 1) * size])
            t_get = time.perf_counter() - t
            ok = ok and bool(np.array_equal(src, dst))
            if r:
                puts.append(total / t_put / 1e9)
                gets.append(total / t_get / 1e9)
        return {"put_gbps": statistics.median(puts), "get_gbps": statistics.median(gets), "put_runs": puts,
                "get_runs": gets, "verified": ok}
    finally:
        if sock is not None:
            sock.close()
        stop_process(proc)


def measure_disk(job: dict, workdir: str) -> dict:
    import torch
    from lmcache.utils import CacheEngineKey
    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.metadata import LMCacheMetadata
    from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend
    from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

    size, count, reps = job["block_bytes"], job.get("disk_count", job["count"]), job["reps"]
    total = size * count
    path = os.path.join(job["dir"], "lmcache-disk")
    shutil.rmtree(path, ignore_errors=True)
    gib = 1024 ** 3
    config = LMCacheEngineConfig.from_defaults(
        chunk_size=256, local_cpu=False, max_local_cpu_size=(2 * total + (256 << 20)) / gib,
        local_disk=path + "/", max_local_disk_size=(2 * total + (256 << 20)) / gib,
        extra_config={"use_odirect": True})
    metadata = LMCacheMetadata(model_name="peer-bench", world_size=1, local_world_size=1, worker_id=0,
                               local_worker_id=0, kv_dtype=torch.uint8, kv_shape=(1, 2, 256, 1, size // 512))
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    cpu = disk = None
    try:
        cpu = LocalCPUBackend(config, metadata)
        disk = LocalDiskBackend(config, loop, cpu, "cpu", None, metadata)
        src = touched(total, random=True)
        dst = touched(total, random=False)
        shape = torch.Size([2, 1, 256, size // 512])  # KV_2LTD, as an engine stores a chunk: `size` bytes of uint8
        res = {"put": [], "get": [], "put_backend": [], "get_backend": []}
        ok = True
        done = threading.Semaphore(0)
        for r in range(reps + 1):  # pass 0 warms the allocator, the threads and the directory; not counted
            keys = [CacheEngineKey("peer-bench", 1, 0, (r + 1) * 1_000_003 + i, torch.uint8) for i in range(count)]
            t0 = time.perf_counter()
            objs = []
            for i in range(count):
                mo = cpu.allocate(shape, torch.uint8, MemoryFormat.KV_2LTD)
                if mo is None:
                    raise RuntimeError("LMCache CPU allocator is full")
                np.copyto(np.frombuffer(mo.byte_array, dtype=np.uint8, count=size), src[i * size:(i + 1) * size])
                objs.append(mo)
            t1 = time.perf_counter()
            disk.batched_submit_put_task(keys, objs, on_complete_callback=lambda _k: done.release())
            for mo in objs:
                mo.ref_count_down()  # the backend holds its own reference until the write is done
            for _ in range(count):
                if not done.acquire(timeout=WAIT_S):
                    raise TimeoutError("LMCache disk writes did not complete")
            t2 = time.perf_counter()
            if not all(disk.contains(k) for k in keys):
                raise RuntimeError("LMCache disk backend lost a put")
            dst[:] = 0
            t3 = time.perf_counter()
            got = disk.batched_get_blocking(keys)
            t4 = time.perf_counter()
            for i, mo in enumerate(got):
                if mo is None:
                    raise RuntimeError("LMCache disk backend missed a get")
                np.copyto(dst[i * size:(i + 1) * size], np.frombuffer(mo.byte_array, dtype=np.uint8, count=size))
                mo.ref_count_down()
            t5 = time.perf_counter()
            ok = ok and bool(np.array_equal(src, dst))
            for k in keys:
                disk.remove(k)
            if r:
                res["put"].append(total / (t2 - t0) / 1e9)
                res["put_backend"].append(total / (t2 - t1) / 1e9)
                res["get"].append(total / (t5 - t3) / 1e9)
                res["get_backend"].append(total / (t4 - t3) / 1e9)
        return {"put_gbps": statistics.median(res["put"]), "get_gbps": statistics.median(res["get"]),
                "put_backend_gbps": statistics.median(res["put_backend"]),
                "get_backend_gbps": statistics.median(res["get_backend"]),
                "put_runs": res["put"], "get_runs": res["get"], "verified": ok,
                "o_direct": bool(disk.use_odirect and size % disk.os_disk_bs == 0)}
    finally:
        if disk is not None:
            disk.close()
        if cpu is not None:
            try:
                cpu.close()
            except Exception:  # noqa: BLE001
                pass
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join(10)
        shutil.rmtree(path, ignore_errors=True)


def main() -> int:
    job_path, result_path = sys.argv[1], sys.argv[2]
    with open(job_path) as f:
        job = json.load(f)
    workdir = os.path.dirname(os.path.abspath(result_path))
    from importlib.metadata import version

    out: dict = {"version": version("lmcache")}
    for mode in job["modes"]:
        try:
            out[mode] = (measure_server if mode == "server" else measure_disk)(job, workdir)
        except Exception as e:  # noqa: BLE001 - reported per mode, the other mode still runs
            out[mode] = {"error": f"{type(e).__name__}: {e}"}
    with open(result_path, "w") as f:
        json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
