"""Checks of kvstore's SGLang HiCache backend against SGLang's real storage code, run INSIDE the
SGLang venv (tests/test_sglang_backend.py launches it; the full Engine does not run on CPU).

    python tests/engines/sglang_hicache.py --url HOST:PORT [--only CHECK ...]

Every check builds SGLang's own host pools (MHA in all four layouts, MLA), loads the backend
through SGLang's dynamic backend factory, and moves pages through a real kvstore daemon. It
prints one JSON object {check: {"ok": bool, "detail": str}} as its last line; a check that
raises reports ok=false with the traceback.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import threading
import time
import traceback

import torch

from ports import closed_port   # tests/engines/ is sys.path[0]: the script runs as a file

MODEL = "test-org/tiny-model"
MHA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
PAGE = 4          # tokens per page
LAYERS = 3
DEVICE_TOKENS = 64


def extra_config(url: str, **more) -> dict:
    return {"backend_name": "kvstore", "module_path": "kvstore.connectors.sglang",
            "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "url": url,
            "timeout_s": 2.0, **more}


def storage_config(url: str, *, mla: bool = False, tp_rank: int = 0, tp_size: int = 1,
                   model: str = MODEL, **more):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=False,
                                is_page_first_layout=True, model_name=model,
                                extra_config=extra_config(url, **more))


def host_budget():
    """SGLang refuses a host pool unless ~10 GB of RAM stays free beyond it (sized for GPU
    servers); these pools are a few KiB, so book them against an explicit 1 GiB budget instead
    of the shared machine's momentary free memory."""
    from sglang.srt.mem_cache.pool_host.base import host_memory_budget_scope

    return host_memory_budget_scope(1 << 30)


def mha_host_pool(layout: str, dtype=torch.bfloat16, heads: int = 2, head_dim: int = 8):
    with host_budget():
        return _mha_host_pool(layout, dtype, heads, head_dim)


def _mha_host_pool(layout: str, dtype, heads: int, head_dim: int):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    dev = MHATokenToKVPool(DEVICE_TOKENS, PAGE, dtype, heads, head_dim, LAYERS, "cpu", False,
                           start_layer=0, end_layer=LAYERS)
    return MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer,
                                write_back_staging=dev.hicache_write_back_staging)


def mla_host_pool(layout: str, dtype=torch.bfloat16):
    with host_budget():
        return _mla_host_pool(layout, dtype)


def _mla_host_pool(layout: str, dtype):
    from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    dev = MLATokenToKVPool(DEVICE_TOKENS, PAGE, dtype, 16, 8, LAYERS, "cpu", False, 0, LAYERS)
    return MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                start_layer=dev.start_layer, end_layer=dev.end_layer,
                                target_layer_num=dev.layer_num, override_kv_cache_dim=dev.kv_cache_dim)


def backend_for(cfg, pool):
    """The backend exactly as SGLang's controller makes it: factory, then pool registration."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    b = StorageBackendFactory.create_backend("dynamic", cfg, pool)
    b.register_mem_pool_host(pool)
    return b


def fill_random(pool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    raw = pool.kv_buffer.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=g))


def page_indices(first_page: int, n: int) -> torch.Tensor:
    return torch.arange(first_page * PAGE, (first_page + n) * PAGE, dtype=torch.int64)


def page_bytes(pool, first_page: int, n: int) -> list[bytes]:
    return [bytes(pool.get_data_page((first_page + i) * PAGE, flat=True).contiguous().view(torch.uint8)
                  .numpy()) for i in range(n)]


RUN = os.urandom(8).hex()  # a daemon may outlive one run: keys are fresh every run


def keys_for(tag: str, n: int) -> list[str]:
    """SGLang-shaped page keys: chained sha256 hex digests."""
    keys, prev = [], hashlib.sha256(f"{RUN}-{tag}".encode()).digest()
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "little")).digest()
        keys.append(prev.hex())
    return keys


def expect(cond: bool, what: str) -> None:
    if not cond:
        raise AssertionError(what)


# ---- checks ----------------------------------------------------------------------------------
def check_roundtrip(url: str, kind: str, layout: str) -> str:
    """v1 set -> exists -> v1 get into other host pages, byte-exact; legacy get/set agree with v1."""
    make = mha_host_pool if kind == "mha" else mla_host_pool
    src, dst = make(layout), make(layout)
    fill_random(src, 1)
    b_src = backend_for(storage_config(url, mla=kind == "mla"), src)
    b_dst = backend_for(storage_config(url, mla=kind == "mla"), dst)
    n = 5
    keys = keys_for(f"rt-{kind}-{layout}", n)
    expect(b_src.batch_exists(keys) == 0, "fresh keys reported present")
    res = b_src.batch_set_v1(keys, page_indices(2, n))
    expect(res == [True] * n, f"batch_set_v1 -> {res}")
    expect(b_dst.batch_exists(keys) == n, f"batch_exists -> {b_dst.batch_exists(keys)}")
    expect(b_dst.batch_exists(keys + keys_for("absent", 2)) == n, "exists counted missing pages")
    got = b_dst.batch_get_v1(keys, page_indices(7, n))
    expect(got == [True] * n, f"batch_get_v1 -> {got}")
    expect(page_bytes(dst, 7, n) == page_bytes(src, 2, n), "v1 round trip not byte-exact")
    # Legacy (copying) path reads the same blocks: flat pages equal the pool's own flat pages.
    flats = b_dst.batch_get(keys, [dst.get_dummy_flat_data_page() for _ in keys])
    expect(all(f is not None for f in flats), "legacy batch_get missed")
    expect([bytes(f.view(torch.uint8).numpy()) for f in flats] == page_bytes(src, 2, n),
           "legacy batch_get bytes differ from the pool's flat pages")
    # Legacy set, v1 get.
    keys2 = keys_for(f"legacy-{kind}-{layout}", 2)
    expect(b_src.batch_set(keys2, [src.get_data_page(p * PAGE, flat=True) for p in (10, 11)]),
           "legacy batch_set failed")
    expect(b_dst.exists(keys2[0]) and b_dst.exists(keys2[1]), "legacy set not visible")
    expect(b_dst.batch_get_v1(keys2, page_indices(20, 2)) == [True, True], "v1 get of legacy pages")
    expect(page_bytes(dst, 20, 2) == page_bytes(src, 10, 2), "legacy set -> v1 get not byte-exact")
    one = b_dst.get(keys2[1], dst.get_dummy_flat_data_page())
    expect(one is not None and bytes(one.view(torch.uint8).numpy()) == page_bytes(src, 11, 1)[0],
           "legacy get")
    g = b_src.geometry
    return f"{g.segments_per_page} segments x {g.segment_bytes} B per page"


CODECS = ("fp8", "fp8_head", "int4_g32", "int4_g64", "zstd")


def fill_kv_like(pool, seed: int) -> None:
    """KV-like values (channel outliers, magnitudes varying by row): random bytes would hold NaNs,
    which codecs refuse."""
    g = torch.Generator().manual_seed(seed)
    buf = pool.kv_buffer
    x = torch.randn(buf.shape, generator=g) * torch.rand(*buf.shape[:-1], 1, generator=g).mul(3).add(0.1)
    x[..., :1] = x[..., :1] * 4 + 20
    buf.copy_(x.to(buf.dtype))


def check_codec_roundtrip(url: str, kind: str, layout: str) -> str:
    """Codecs understand the namespace layout this backend builds for a real SGLang host pool:
    every segment of two pages, encoded from the pool's memory and decoded straight into another
    pool's memory (the zero-copy path), comes back within the codec's error: per (token, head) row
    for fp8 (rows are head_dim wide in every layout), by norm for the rest, exact for zstd."""
    from kvstore import codecs

    make = (lambda lay: mha_host_pool(lay, head_dim=64)) if kind == "mha" else mla_host_pool
    src, dst = make(layout), make(layout)
    fill_kv_like(src, 21)
    b_src = backend_for(storage_config(url, mla=kind == "mla"), src)
    b_dst = backend_for(storage_config(url, mla=kind == "mla"), dst)
    ns_layout = b_src.namespace.layout
    segs_src = b_src.geometry.segment_views(page_indices(2, 2), 2)
    segs_dst = b_dst.geometry.segment_views(page_indices(5, 2), 2)
    ratios, no_gain = {}, []
    for codec in CODECS:
        try:
            codecs.check_layout(codec, ns_layout)
        except codecs.Refused as e:   # these test pages are tiny: a codec may not shrink them
            expect(e.reason == "no_gain", f"{codec} refused the backend's layout: {e}")
            no_gain.append(codec)
        stored = 0
        for a, b in zip(segs_src, segs_dst):
            cid, payload = codecs.encode_block(codec, a, ns_layout)
            stored += payload.nbytes
            codecs.decode_block(cid, payload, ns_layout, out=b)
        ratios[codec] = round(sum(s.size for s in segs_src) / stored, 2)
        for p_src, p_dst in zip((2, 3), (5, 6)):
            x = src.get_data_page(p_src * PAGE, flat=True).float()
            y = dst.get_data_page(p_dst * PAGE, flat=True).float()
            if codec == "zstd":
                expect(torch.equal(x, y), f"{codec}: not exact")
                continue
            rel = ((y - x).norm() / x.norm()).item()
            expect(rel < (0.04 if codec.startswith("fp8") else 0.12), f"{codec}: relative error {rel:.4f}")
            if codec == "fp8":
                rows_x, rows_y = x.view(-1, int(ns_layout.head_dim)), y.view(-1, int(ns_layout.head_dim))
                amax = rows_x.abs().amax(dim=1, keepdim=True)
                bound = rows_x.abs() / 16 + amax / 448 * 2 ** -9 * 1.01 + rows_y.abs() * torch.finfo(torch.bfloat16).eps
                expect(bool(((rows_y - rows_x).abs() <= bound).all()), f"{codec}: a row outside its e4m3 step")
    return f"{ns_layout.layout}: ratios {ratios}" + (f"; no gain (stored raw): {no_gain}" if no_gain else "")


def check_layout_mismatch(url: str) -> str:
    """A page stored from one layout (or dtype, or model) is never read into another."""
    writer = mha_host_pool("page_first")
    fill_random(writer, 2)
    b = backend_for(storage_config(url), writer)
    keys = keys_for("mismatch", 3)
    expect(b.batch_set_v1(keys, page_indices(0, 3)) == [True] * 3, "set failed")
    readers = {
        "page_head": (mha_host_pool("page_head"), storage_config(url)),
        "layer_first": (mha_host_pool("layer_first"), storage_config(url)),
        "float16": (mha_host_pool("page_first", dtype=torch.float16), storage_config(url)),
        "other model": (mha_host_pool("page_first"), storage_config(url, model="other/model")),
        "tp rank 1 of 2": (mha_host_pool("page_first"), storage_config(url, tp_rank=1, tp_size=2)),
    }
    for name, (pool, cfg) in readers.items():
        before = bytes(pool.kv_buffer.view(-1).view(torch.uint8).numpy())
        r = backend_for(cfg, pool)
        expect(r.batch_exists(keys) == 0, f"{name}: exists saw another layout's pages")
        expect(r.batch_get_v1(keys, page_indices(0, 3)) == [False] * 3, f"{name}: get hit")
        expect(bytes(pool.kv_buffer.view(-1).view(torch.uint8).numpy()) == before,
               f"{name}: a refused get changed the host pool")
    same = backend_for(storage_config(url), mha_host_pool("page_first"))
    expect(same.batch_exists(keys) == 3, "same layout must still hit")
    return f"refused: {', '.join(readers)}"


def check_unsupported_layout(url: str) -> str:
    """A layout whose pages the backend cannot describe is refused at attach, by name."""
    pool = mha_host_pool("page_unified")
    try:
        backend_for(storage_config(url), pool)
    except ValueError as e:
        expect("page_unified" in str(e), f"error does not name the layout: {e}")
        return str(e)
    raise AssertionError("page_unified pool accepted")


def check_mla_one_writer(url: str) -> str:
    """MLA: only the designated rank writes; every rank reads the same pages."""
    pools = [mla_host_pool("page_first") for _ in range(2)]
    for i, p in enumerate(pools):
        fill_random(p, 10 + i)
    backends = [backend_for(storage_config(url, mla=True, tp_rank=r, tp_size=2), pools[r]) for r in range(2)]
    expect(backends[0].config.is_storage_writer and not backends[1].config.is_storage_writer,
           "SGLang's writer rank should be rank 0")
    keys = keys_for("mla-writer", 4)
    # The non-writer acknowledges (SGLang must not treat it as a failure) but stores nothing.
    expect(backends[1].batch_set_v1(keys, page_indices(0, 4)) == [True] * 4, "non-writer set")
    expect(backends[0].batch_exists(keys) == 0, "the non-writer rank stored pages")
    expect(backends[0].batch_set_v1(keys, page_indices(0, 4)) == [True] * 4, "writer set")
    for r in range(2):
        expect(backends[r].batch_exists(keys) == 4, f"rank {r} does not see the writer's pages")
    expect(backends[1].batch_get_v1(keys, page_indices(12, 4)) == [True] * 4, "rank 1 get")
    expect(page_bytes(pools[1], 12, 4) == page_bytes(pools[0], 0, 4), "rank 1 read other bytes")
    return "rank 0 wrote, ranks 0 and 1 read"


def check_daemon_down(url: str) -> str:
    """No daemon: misses and False, never an exception; recovers when a daemon is reachable."""
    pool = mha_host_pool("page_first")
    fill_random(pool, 3)
    before = bytes(pool.kv_buffer.view(-1).view(torch.uint8).numpy())
    b = backend_for(storage_config(f"127.0.0.1:{closed_port()}", timeout_s=0.5), pool)
    keys = keys_for("down", 3)
    expect(b.batch_set_v1(keys, page_indices(0, 3)) == [False] * 3, "set reported success")
    expect(b.batch_exists(keys) == 0, "exists with no daemon")
    expect(b.batch_get_v1(keys, page_indices(4, 3)) == [False] * 3, "get with no daemon")
    expect(b.exists(keys[0]) is False, "legacy exists")
    expect(b.get(keys[0], pool.get_dummy_flat_data_page()) is None, "legacy get")
    expect(b.set(keys[0], pool.get_data_page(0)) is False, "legacy set")
    expect(b.batch_set(keys, [pool.get_data_page(0)] * 3) is False, "legacy batch_set")
    expect(bytes(pool.kv_buffer.view(-1).view(torch.uint8).numpy()) == before, "pool changed")
    expect(b.get_stats()["daemon_errors"] > 0, "failures not counted")
    # The same backend object starts working once it points at a live daemon.
    b.client.close()
    from kvstore.client import Client

    b.client = Client(url=url, timeout_s=2.0)
    expect(b.batch_set_v1(keys, page_indices(0, 3)) == [True] * 3, "no recovery after the daemon is back")
    return "all calls returned misses/False"


def check_failure_injector(url: str) -> str:
    """SGLang's own failure injector around the backend: failures are clean, hits are exact."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageFailureInjector

    os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"] = "0.3"
    try:
        src, dst = mha_host_pool("page_head"), mha_host_pool("page_head")
        fill_random(src, 4)
        b = backend_for(storage_config(url), src)
        r = backend_for(storage_config(url), dst)
    finally:
        del os.environ["SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE"]
    expect(isinstance(b, HiCacheStorageFailureInjector), f"factory did not wrap: {type(b)}")
    fails = hits = 0
    for i in range(40):
        keys = keys_for(f"inject-{i}", 2)
        set_ok = b.batch_set_v1(keys, page_indices(0, 2))
        got = r.batch_get_v1(keys, page_indices(8, 2))
        fails += set_ok.count(False) + got.count(False)
        for j, ok in enumerate(got):
            if ok:
                hits += 1
                expect(page_bytes(dst, 8 + j, 1) == page_bytes(src, j, 1), "an injected run returned wrong bytes")
    expect(fails > 0 and hits > 0, f"injector had no effect (fails={fails}, hits={hits})")
    return f"{hits} exact hits, {fails} injected failures"


def check_concurrent_threads(url: str) -> str:
    """One backend used by a writer and a reader thread at once (SGLang's backup and prefetch
    threads share it): every read that reports success is byte-exact."""
    src, dst = mha_host_pool("page_first"), mha_host_pool("page_first")
    fill_random(src, 7)
    b = backend_for(storage_config(url), src)
    r = backend_for(storage_config(url), dst)
    errors: list[str] = []
    rounds = 20

    def writer():
        for i in range(rounds):
            if b.batch_set_v1(keys_for(f"conc-{i}", 2), page_indices(2 * (i % 8), 2)) != [True, True]:
                errors.append(f"set {i} failed")

    def reader(slot: int):
        for i in range(rounds):
            k = keys_for(f"conc-{i}", 2)
            while r.batch_exists(k) < 2:
                time.sleep(0.001)
            got = r.batch_get_v1(k, page_indices(16 + 2 * slot, 2))
            if got != [True, True]:
                errors.append(f"get {i} -> {got}")
            elif page_bytes(dst, 16 + 2 * slot, 2) != page_bytes(src, 2 * (i % 8), 2):
                errors.append(f"get {i}: wrong bytes")

    threads = [threading.Thread(target=writer)] + [threading.Thread(target=reader, args=(s,)) for s in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    expect(not any(t.is_alive() for t in threads), "threads hung")
    expect(not errors, "; ".join(errors[:5]))
    return f"{rounds} writes, {2 * rounds} concurrent reads, all exact (transport {b.client.active_transport})"


def check_controller(url: str) -> str:
    """SGLang's HiCacheController: backup thread -> batch_set_v1, prefetch thread -> exists + get_v1."""
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{closed_port()}", rank=0, world_size=1)
    group = dist.group.WORLD
    from sglang.srt.runtime_context import get_parallel

    # One rank of everything, as a single-GPU server publishes it.
    get_parallel().override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1,
                                        attn_dcp_rank=0, attn_dcp_size=1)

    def controller(seed: int):
        dev = MHATokenToKVPool(DEVICE_TOKENS, PAGE, torch.bfloat16, 2, 8, LAYERS, "cpu", False,
                               start_layer=0, end_layer=LAYERS)
        alloc = TokenToKVPoolAllocator(DEVICE_TOKENS, torch.bfloat16, "cpu", dev, False)
        with host_budget():
            host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
                                        pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                        start_layer=dev.start_layer, end_layer=dev.end_layer,
                                        write_back_staging=dev.hicache_write_back_staging)
        fill_random(host, seed)
        ctl = HiCacheController(alloc, host, PAGE, group, threading.Event(), write_policy="write_through",
                                io_backend="direct", storage_backend="dynamic", prefetch_threshold=PAGE,
                                model_name=MODEL, storage_backend_extra_config=extra_config(url))
        return ctl, host

    from sglang.srt.mem_cache.utils import get_storage_hash_str

    n = 6
    tokens = list(range(1000, 1000 + n * PAGE))
    keys = get_storage_hash_str(tokens, None, page_size=PAGE)  # SGLang's own page keys
    expect(len(keys) == n, f"{len(keys)} page keys for {n} pages")

    writer, wpool = controller(5)
    writer.write_storage(page_indices(3, n), tokens, hash_value=keys)
    ack = writer.ack_backup_queue.get(timeout=60)       # the backup thread ran batch_set_v1
    backed_up = ack.completed_tokens
    writer.detach_storage_backend()
    expect(backed_up == n * PAGE, f"backup stored {backed_up} of {n * PAGE} tokens")

    reader, rpool = controller(6)
    op = reader.prefetch("req-1", tokens, None, None)   # prefetch thread: hashes + batch_exists
    hit = reader.prefetch_hit_queue.get(timeout=60)
    expect(hit is op and op.storage_hit_count == n * PAGE, f"storage hit {op.storage_hit_count} tokens")
    op.host_indices = page_indices(11, n)               # what the scheduler does on a hit
    reader.prefetch_buffer.put(op)                      # io thread: batch_get_v1
    deadline = time.monotonic() + 60
    while True:
        ack = reader.ack_prefetch_queue.get(timeout=max(0.1, deadline - time.monotonic()))
        if getattr(ack, "completed_req", False):
            break
    reader.detach_storage_backend()
    expect(page_bytes(rpool, 11, n) == page_bytes(wpool, 3, n), "controller round trip not byte-exact")
    return f"backup thread stored {backed_up} tokens; prefetch hit {op.storage_hit_count} tokens, byte-exact"


def _accepts(fn, name: str) -> bool:
    import inspect

    return name in inspect.signature(fn).parameters


def all_checks(url: str) -> dict:
    checks = {}
    for layout in MHA_LAYOUTS:
        checks[f"roundtrip_mha_{layout}"] = lambda layout=layout: check_roundtrip(url, "mha", layout)
    for layout in MLA_LAYOUTS:
        checks[f"roundtrip_mla_{layout}"] = lambda layout=layout: check_roundtrip(url, "mla", layout)
    for layout in MHA_LAYOUTS:
        checks[f"codecs_mha_{layout}"] = lambda layout=layout: check_codec_roundtrip(url, "mha", layout)
    for layout in MLA_LAYOUTS:
        checks[f"codecs_mla_{layout}"] = lambda layout=layout: check_codec_roundtrip(url, "mla", layout)
    checks["layout_mismatch"] = lambda: check_layout_mismatch(url)
    checks["unsupported_layout"] = lambda: check_unsupported_layout(url)
    checks["mla_one_writer"] = lambda: check_mla_one_writer(url)
    checks["daemon_down"] = lambda: check_daemon_down(url)
    checks["failure_injector"] = lambda: check_failure_injector(url)
    checks["concurrent_threads"] = lambda: check_concurrent_threads(url)
    checks["controller"] = lambda: check_controller(url)
    return checks


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", required=True)
    ap.add_argument("--only", nargs="*")
    args = ap.parse_args()
    results = {}
    for name, fn in all_checks(args.url).items():
        if args.only and name not in args.only:
            continue
        t0 = time.monotonic()
        try:
            detail = fn()
            results[name] = {"ok": True, "detail": detail}
        except BaseException:
            results[name] = {"ok": False, "detail": traceback.format_exc()}
        results[name]["seconds"] = round(time.monotonic() - t0, 2)
        print(f"{name}: {'ok' if results[name]['ok'] else 'FAILED'}", file=sys.stderr, flush=True)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
