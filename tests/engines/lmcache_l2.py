"""Checks of kvstore's LMCache L2 adapter plugin, run INSIDE the LMCache venv
(tests/test_lmcache_backend.py launches it).

    python tests/engines/lmcache_l2.py --url HOST:PORT

The adapter is created through LMCache's own plugin factory (module path + class name), and
driven the way LMCache's store and prefetch controllers drive it: submit, wait on the task
kind's event fd, poll the result. Prints one JSON object {check: {"ok", "detail"}} last.
"""

from __future__ import annotations

import argparse
import json
import select
import sys
import time
import traceback

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.l2_adapters import create_l2_adapter
from lmcache.v1.distributed.l2_adapters.config import parse_args_to_l2_adapters_config
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.platform.event_notifier import consume_fd

from ports import closed_port   # tests/engines/ is sys.path[0]: the script runs as a file

SHAPE = (2, 4, 16, 64)          # an LMCache chunk: kv, layers/tokens..., as bf16
DTYPE = torch.bfloat16


def plugin_adapter(url: str, **params):
    spec = {"type": "plugin", "module_path": "kvstore.connectors.lmcache",
            "class_name": "KVStoreL2Adapter", "adapter_params": {"url": url, **params}}

    class Args:  # what LMCache's CLI parser would hand over
        l2_adapter = [json.dumps(spec)]

    cfg = parse_args_to_l2_adapters_config(Args())
    return create_l2_adapter(cfg.adapters[0])


def make_obj(fill: int, shape=SHAPE, dtype=DTYPE) -> TensorMemoryObj:
    t = torch.full(shape, 0, dtype=dtype)
    raw = t.view(-1).view(torch.uint8)
    raw.copy_((torch.arange(raw.numel()) * 7 + fill).to(torch.uint8))
    meta = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0,
                             phy_size=raw.numel(), fmt=MemoryFormat.KV_2LTD, ref_count=1)
    return TensorMemoryObj(raw_data=t, metadata=meta, parent_allocator=None)


def wait(fd: int, timeout: float = 30.0) -> None:
    r, _, _ = select.select([fd], [], [], timeout)
    if not r:
        raise TimeoutError("event fd never signalled")
    consume_fd(fd)


def store(adapter, keys, objs) -> bool:
    tid = adapter.submit_store_task(keys, objs)
    deadline = time.monotonic() + 30
    while True:
        wait(adapter.get_store_event_fd(), max(0.1, deadline - time.monotonic()))
        done = adapter.pop_completed_store_tasks()
        if tid in done:
            return done[tid].is_successful()


def lookup(adapter, keys, descs) -> list[bool]:
    tid = adapter.submit_lookup_and_lock_task(keys, descs)
    return _bits(len(keys), adapter.get_lookup_and_lock_event_fd, lambda: adapter.query_lookup_and_lock_result(tid))


def load(adapter, keys, objs) -> list[bool]:
    tid = adapter.submit_load_task(keys, objs)
    return _bits(len(keys), adapter.get_load_event_fd, lambda: adapter.query_load_result(tid))


def _bits(n: int, event_fd, result) -> list[bool]:
    """Wait on the task's event fd until ``result()`` gives its bitmap; one bool per key."""
    while True:
        wait(event_fd())
        bm = result()
        if bm is not None:
            return [bm.test(i) for i in range(n)]


def keys_for(tag: str, n: int, model: str = "org/model", kv_rank: int = 0, salt: str = "") -> list:
    return [ObjectKey(chunk_hash=f"{tag}-{i}".encode().ljust(32, b"\0"), model_name=model,
                      kv_rank=kv_rank, cache_salt=salt) for i in range(n)]


def raw(obj) -> bytes:
    return bytes(obj.raw_tensor.view(-1).view(torch.uint8).numpy())


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


def check_roundtrip(url: str) -> str:
    """Store, then lookup+load from a FRESH adapter (another process's view) with real layouts."""
    a = plugin_adapter(url)
    keys = keys_for("rt", 6)
    objs = [make_obj(i) for i in range(6)]
    expect(store(a, keys, objs), "store failed")
    a.close()
    b = plugin_adapter(url)
    desc = {0: MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[DTYPE])}
    expect(lookup(b, keys + keys_for("absent", 2), desc) == [True] * 6 + [False] * 2, "lookup bitmap")
    outs = [make_obj(200) for _ in range(6)]
    expect(load(b, keys, outs) == [True] * 6, "load bitmap")
    expect([raw(o) for o in outs] == [raw(o) for o in objs], "loaded bytes differ")
    b.submit_unlock(keys)
    b.close()
    return "6 chunks stored, found and loaded byte-exact by a fresh adapter"


def check_isolation(url: str) -> str:
    """Other kv_rank, model, cache salt or object size never hit; a miss leaves the buffer alone."""
    a = plugin_adapter(url)
    keys = keys_for("iso", 3, kv_rank=0)
    expect(store(a, keys, [make_obj(i) for i in range(3)]), "store failed")
    desc = {0: MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[DTYPE])}
    for name, other in {"kv_rank 1": keys_for("iso", 3, kv_rank=1),
                        "other model": keys_for("iso", 3, model="org/other"),
                        "cache salt": keys_for("iso", 3, salt="tenant-b")}.items():
        expect(lookup(a, other, desc) == [False] * 3, f"{name}: lookup hit")
        outs = [make_obj(99) for _ in range(3)]
        expect(load(a, other, outs) == [False] * 3, f"{name}: load hit")
        expect(all(raw(o) == raw(make_obj(99)) for o in outs), f"{name}: a miss wrote the buffer")
    half = [make_obj(5, shape=(2, 4, 8, 64)) for _ in range(3)]   # same keys, smaller object
    expect(load(a, keys, half) == [False] * 3, "an object of another size was loaded")
    fp16 = {0: MemoryLayoutDesc(shapes=[torch.Size((2, 4, 8, 64))], dtypes=[torch.float16])}
    expect(lookup(a, keys, fp16) == [False] * 3, "lookup with another layout's size hit")
    a.close()
    return "kv_rank, model, salt and size all isolate"


def check_daemon_down(url: str) -> str:
    """No daemon: failed store result, zero bitmaps, no exception out of any call."""
    a = plugin_adapter(f"127.0.0.1:{closed_port()}", timeout_s=0.5)
    keys = keys_for("down", 2)
    expect(store(a, keys, [make_obj(1), make_obj(2)]) is False, "store reported success")
    desc = {0: MemoryLayoutDesc(shapes=[torch.Size(SHAPE)], dtypes=[DTYPE])}
    expect(lookup(a, keys, desc) == [False, False], "lookup hit")
    expect(load(a, keys, [make_obj(3), make_obj(4)]) == [False, False], "load hit")
    a.submit_unlock(keys)
    status = a.report_status()
    expect(status["is_healthy"] is False, f"status {status}")
    a.close()
    return "store failed cleanly, lookups and loads missed"


def check_bad_config(url: str) -> str:
    """A wrong adapter_params field is refused by name at creation."""
    try:
        plugin_adapter(url, num_workerz=2)
    except ValueError as e:
        expect("num_workerz" in str(e), f"error does not name the field: {e}")
        return str(e)
    raise AssertionError("unknown field accepted")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    args = ap.parse_args()
    results = {}
    for name, fn in {"roundtrip": check_roundtrip, "isolation": check_isolation,
                     "daemon_down": check_daemon_down, "bad_config": check_bad_config}.items():
        try:
            results[name] = {"ok": True, "detail": fn(args.url)}
        except BaseException:
            results[name] = {"ok": False, "detail": traceback.format_exc()}
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'}", file=sys.stderr, flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
