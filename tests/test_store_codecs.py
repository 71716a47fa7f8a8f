"""Per-tier codecs inside the store: blocks are encoded when they move into a tier configured
with a codec (demotion, write-through, flush), decoded on every read, promoted back raw, and
survive a warm restart with their codec recorded in the NVMe header."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.keys import ChainHasher, KVLayout, Namespace
from kvstore.store import Store, StoreConfig
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.nvme import NvmeTier

LAYOUT = KVLayout(model="test/codec-model", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=32, layout="kv,layer,token,head,dim")


def kv_block(seed: int) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(LAYOUT.block_bytes // 2, generator=g).to(torch.bfloat16)
    return x.view(torch.uint8).numpy().copy()


def as_floats(raw: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(raw.copy()).view(torch.bfloat16).float()


def make_store(tmp_path, codec: str, cpu_blocks: int = 2, **cfg) -> Store:
    return Store([CpuTier(cpu_blocks * LAYOUT.block_bytes, slot_bytes=LAYOUT.block_bytes),
                  NvmeTier(str(tmp_path / "nvme"), 64 * LAYOUT.block_bytes)],
                 StoreConfig(tier_codecs={"nvme": codec}, **cfg))


@pytest.mark.parametrize("codec, max_rel_rmse", [("fp8", 0.05), ("int4_g64", 0.2), ("zstd", 0.0)])
def test_demoted_blocks_are_encoded_and_read_back_close(tmp_path, codec, max_rel_rmse):
    store = make_store(tmp_path, codec, promote_on_hit=False)
    ns = store.register_namespace(Namespace(LAYOUT))
    hashes = ChainHasher().chain(np.arange(8 * 32), 32)
    blocks = [kv_block(i) for i in range(len(hashes))]
    store.put(ns, hashes, blocks)
    nvme = store.tiers[1]
    assert nvme.stats()["blocks"] >= 6
    encoded = nvme.records()  # inspecting what hit disk
    assert all(r.codec != 0 for r in encoded)
    if codec != "zstd":  # lossy codecs shrink bf16 noise; zstd barely does
        assert all(r.stored_size < LAYOUT.block_bytes * 0.6 for r in encoded)
    for h, want in zip(hashes, store.get(ns, hashes)):
        assert want is not None and len(want) == LAYOUT.block_bytes
    for got, want in zip(store.get(ns, hashes), blocks):
        a, b = as_floats(np.frombuffer(got, np.uint8)), as_floats(want)
        rel = float((a - b).norm() / b.norm())
        assert rel <= max_rel_rmse, rel
    store.close()


def test_codec_survives_restart_and_promotion_stores_raw(tmp_path):
    store = make_store(tmp_path, "fp8", write_through=True)
    ns = store.register_namespace(Namespace(LAYOUT))
    hashes = ChainHasher().chain(np.arange(4 * 32), 32)
    blocks = [kv_block(100 + i) for i in range(len(hashes))]
    assert store.put(ns, hashes, blocks) == ["persisted"] * 4
    store.close()

    again = make_store(tmp_path, "fp8")
    assert again.lookup(ns, hashes, lease=False).num_hit == 4
    got = again.get(ns, hashes)
    for g, want in zip(got, blocks):
        rel = float((as_floats(np.frombuffer(g, np.uint8)) - as_floats(want)).norm() / as_floats(want).norm())
        assert rel < 0.05
    cpu = again.tiers[0]
    promoted = cpu.stats()["blocks"]
    assert promoted, "hits on NVMe are promoted into the CPU arena"
    # the CPU copy is raw (the CPU tier has no codec): it equals the decoded bytes exactly
    assert again.get(ns, hashes[-1:])[0] == got[-1]
    again.close()


def test_blocks_a_codec_cannot_represent_are_stored_exactly(tmp_path):
    store = make_store(tmp_path, "int4_g32", cpu_blocks=1, promote_on_hit=False)
    ns = store.register_namespace(Namespace(LAYOUT))
    hashes = ChainHasher().chain(np.arange(3 * 32), 32)
    bad = as_floats(kv_block(7))
    bad[5] = float("nan")
    blocks = [bad.to(torch.bfloat16).view(torch.uint8).numpy().copy(), kv_block(8), kv_block(9)]
    store.put(ns, hashes, blocks)
    assert store.get(ns, hashes[:1])[0] == blocks[0].tobytes()  # NaN block kept raw, bit-exact
    assert store.stats()["counters"].get("codec_fallbacks_raw", 0) >= 1
    store.close()


def test_layouts_a_codec_cannot_read_stay_raw(tmp_path):
    opaque = KVLayout(model="test/opaque", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                      block_tokens=32, layout="opaque")
    store = Store([CpuTier(opaque.block_bytes, slot_bytes=opaque.block_bytes),
                   NvmeTier(str(tmp_path / "nvme"), 16 * opaque.block_bytes)],
                  StoreConfig(tier_codecs={"nvme": "fp8"}, promote_on_hit=False))
    ns = store.register_namespace(Namespace(opaque))
    hashes = ChainHasher().chain(np.arange(3 * 32), 32)
    blocks = [kv_block(i) for i in range(3)]
    store.put(ns, hashes, blocks)
    assert store.get(ns, hashes) == [b.tobytes() for b in blocks]
    assert store.stats()["counters"]["codec_layout_refusals"] == 1
    store.close()


@pytest.mark.parametrize("settings", ["codecs:\n  nvme: fp8\npromote_on_hit: false\n",
                                      "codecs:\n  cpu: fp8\n  nvme: fp8\n"], ids=["nvme-fp8", "cpu-and-nvme-fp8"])
def test_daemon_with_tier_codecs_serves_decoded_blocks_over_every_transport(tmp_path, settings):
    """Codecs in a real daemon: demoted blocks sit on disk as FP8 (and, with a CPU codec, hits are
    promoted into the arena as FP8); every transport — including the zero-copy ones that read the
    arena directly — hands the client decoded bf16 blocks of the namespace's size."""
    from daemon_util import start_daemon

    config = tmp_path / "kvstore.yaml"
    config.write_text(settings)
    d = start_daemon(tmp_path, "--config", str(config), cpu_bytes="1MiB", nvme_bytes="64MiB")  # 4 slots
    try:
        hashes = ChainHasher().chain(np.arange(10 * 32), 32)
        blocks = [kv_block(200 + i) for i in range(len(hashes))]
        with d.client() as writer:
            ns = writer.register_namespace(Namespace(LAYOUT))
            writer.put(ns, hashes, blocks)
            assert writer.stats()["counters"].get("encoded_fp8", 0) >= 4
        for transport in ("grpc", "shm", "bulk", "shm"):  # the second shm round reads promoted copies
            with d.client(transport=transport) as c:
                c.register_namespace(Namespace(LAYOUT))
                got = c.get(ns, hashes)
                for g, want in zip(got, blocks):
                    assert g is not None and len(g) == LAYOUT.block_bytes
                    a, b = as_floats(np.frombuffer(g, np.uint8)), as_floats(want)
                    assert float((a - b).norm() / b.norm()) < 0.05
    finally:
        assert d.stop() == 0


# -- codecs where configured: puts, promotions, demotions, tallies (issue #16) ----------------------

LOSSY = ["fp8", "fp8_head", "int4_g32", "int4_g64", "int4_g128", "int4_g64_k16", "int8", "int8_had", "int4_g64_k16_had",
         "int8_kchan", "int4_g64_t0"]


def codec_view(codec: str, raw: np.ndarray) -> tuple[int, np.ndarray, bytes]:
    """What a tier with ``codec`` keeps of ``raw``: (codec id, payload, the bytes it decodes to)."""
    from kvstore.codecs import decode_block, encode_block
    codec_id, payload = encode_block(codec, raw, LAYOUT)
    return codec_id, payload, decode_block(codec_id, payload, LAYOUT).numpy().tobytes()


def cpu_codec_store(tmp_path, codec: str, cpu_blocks: int = 8, slot: int = 4096, **cfg) -> Store:
    return Store([CpuTier(cpu_blocks * LAYOUT.block_bytes, slot_bytes=slot, shm_dir=str(tmp_path)),
                  NvmeTier(str(tmp_path / "nvme"), 64 * LAYOUT.block_bytes)],
                 StoreConfig(tier_codecs={"cpu": codec}, **cfg))


@pytest.mark.parametrize("codec", LOSSY)
def test_a_put_into_a_cpu_tier_with_a_codec_is_stored_encoded(tmp_path, codec):
    """The block reads back as the codec's decoded bytes (not the raw ones) and takes the codec's
    share of the arena; the per-tier tally says so."""
    store = cpu_codec_store(tmp_path, codec)
    ns = store.register_namespace(Namespace(LAYOUT))
    hashes = ChainHasher().chain(np.arange(3 * 32), 32)
    blocks = [kv_block(300 + i) for i in range(3)]
    assert store.put(ns, hashes, blocks) == ["stored"] * 3
    views = [codec_view(codec, b) for b in blocks]
    cpu = store.tiers[0]
    assert cpu.used_bytes == sum(cpu.footprint(p.nbytes) for _, p, _ in views) < 3 * LAYOUT.block_bytes
    got = store.get(ns, hashes)
    assert got == [decoded for _, _, decoded in views] and got != [b.tobytes() for b in blocks]
    # as stored, for a reader that decodes the codec itself
    outs = [np.empty(LAYOUT.block_bytes, np.uint8) for _ in hashes]
    stored = store.get_payloads_into(ns, hashes, outs, accept={views[0][0]})
    assert [(n, c) for n, c in stored] == [(p.nbytes, cid) for cid, p, _ in views]
    assert all(o[:n].tobytes() == p.tobytes() for o, (n, _), (_, p, _) in zip(outs, stored, views))
    tally = store.stats()["tiers"]["cpu"]["codec"]
    assert tally["configured"] == codec and tally["encoded_blocks"] == 3 and tally["held_encoded_blocks"] == 3
    assert tally["encoded_stored_bytes"] == sum(p.nbytes for _, p, _ in views)
    assert store.stats()["counters"][f"encoded_{codec}"] == 3
    store.close()


def test_a_same_host_writer_s_slots_are_encoded_at_complete_store(tmp_path):
    store = cpu_codec_store(tmp_path, "int4_g64")
    ns = store.register_namespace(Namespace(LAYOUT))
    hashes = ChainHasher().chain(np.arange(2 * 32), 32)
    blocks = [kv_block(400 + i) for i in range(2)]
    lease = store.leases.prepare_store(ns, hashes)
    cpu = store.tiers[0]
    assert cpu.used_bytes == 2 * LAYOUT.block_bytes            # raw slots while the writer fills them
    for ext, block in zip(lease.extents, blocks):
        pos = 0
        for off, length in ext:
            cpu.arena[off:off + length] = block[pos:pos + length]
            pos += length
    assert store.leases.complete_store(lease.id) == ["stored"] * 2
    views = [codec_view("int4_g64", b) for b in blocks]
    assert cpu.used_bytes == sum(cpu.footprint(p.nbytes) for _, p, _ in views)   # the rest was freed
    assert store.get(ns, hashes) == [d for _, _, d in views]
    store.close()


def test_demotion_keeps_the_encoding_and_promotion_back_copies_it_as_is(tmp_path):
    """CPU fp8, NVMe raw: a demoted block stays FP8 on disk (same payload, same checksum a fleet
    published) and comes back into the arena as the same payload."""
    store = cpu_codec_store(tmp_path, "fp8", cpu_blocks=2, slot=LAYOUT.block_bytes)
    ns = store.register_namespace(Namespace(LAYOUT))
    hashes = ChainHasher().chain(np.arange(6 * 32), 32)
    blocks = [kv_block(500 + i) for i in range(6)]
    store.put(ns, hashes, blocks)
    nvme = store.tiers[1]
    on_disk = nvme.records()  # inspecting what hit disk
    assert on_disk and all(r.codec == codec_view("fp8", blocks[0])[0] for r in on_disk)
    assert store.get(ns, hashes) == [codec_view("fp8", b)[2] for b in blocks]
    assert store.stats()["counters"]["promotions"] >= 1
    assert store.stats()["tiers"]["cpu"]["codec"]["held_raw_blocks"] == 0
    store.close()


def test_blocks_kept_raw_are_counted_per_tier_with_the_reason(tmp_path):
    opaque = KVLayout(model="test/opaque", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                      block_tokens=32, layout="opaque")
    store = cpu_codec_store(tmp_path, "fp8")
    known = store.register_namespace(Namespace(LAYOUT))
    unknown = store.register_namespace(Namespace(opaque))
    bad = as_floats(kv_block(7))
    bad[3] = float("inf")
    nonfinite = bad.to(torch.bfloat16).view(torch.uint8).numpy().copy()
    store.put(known, ChainHasher().chain(np.arange(32), 32), [nonfinite])
    hashes = ChainHasher(seed=1).chain(np.arange(2 * 32), 32)
    store.put(unknown, hashes, [kv_block(1), kv_block(2)])
    assert store.get(unknown, hashes) == [kv_block(1).tobytes(), kv_block(2).tobytes()]
    tally = store.stats()["tiers"]["cpu"]["codec"]
    assert tally["raw_kept"] == {"layout": {"blocks": 2, "bytes": 2 * LAYOUT.block_bytes},
                                 "nonfinite": {"blocks": 1, "bytes": LAYOUT.block_bytes}}
    assert tally["raw_kept_blocks"] == 3 and tally["encoded_blocks"] == 0
    assert store.stats()["counters"]["codec_layout_refusals"] == 1
    store.close()


@pytest.mark.parametrize("codec", ["fp8", "int4"])
def test_the_planner_s_capacity_model_matches_a_store_that_encodes(tmp_path, codec):
    """The same trace through the planner's model (metadata tiers, blocks of the codec's stored
    size) and through a store that really encodes with ``codecs.cpu``: same used bytes per tier,
    same hits per tier, same demotions and promotions."""
    from kvstore.ops import plan, workload

    layout = KVLayout(model="tiny", num_layers=2, num_kv_heads=1, head_dim=64, dtype="bfloat16",
                      block_tokens=16, layout="kv,layer,token,head,dim")   # 8 KiB blocks
    spec = "chat:system_prompts=3,system_tokens=64,user_tokens=16,reply_tokens=16,turns=6,rate=4,think_s=2"
    reqs = list(workload.generate(spec, layout.block_tokens, requests=150, seed=7))
    slot, cpu_bytes, nvme_bytes = 1024, 40 * 1024, 40 * 8192
    cand = plan.Candidate("prefix", codec, cpu_bytes, nvme_bytes)
    real_tiers = [CpuTier(cpu_bytes, slot_bytes=slot, shm_dir=str(tmp_path)), NvmeTier(str(tmp_path / "nvme"), nvme_bytes)]
    real = plan.replay(reqs, layout, cand, tiers=real_tiers, keep_hit_tiers=True, real_codec=True)
    for t in real_tiers:
        t.close()
    model = plan.replay(reqs, layout, cand, slot_bytes=slot, keep_hit_tiers=True)
    assert real.counters.get("encoded_fp8" if codec == "fp8" else "encoded_int4_g64", 0) > 0
    assert real.hit_blocks["cpu"] > 0 and real.hit_blocks["nvme"] > 0 and real.counters.get("promotions", 0) > 0
    assert real.used_bytes == model.used_bytes
    assert real.hit_tiers == model.hit_tiers
    for name in ("hits_cpu", "hits_nvme", "misses", "puts", "demotions", "evictions", "promotions"):
        assert real.counters.get(name, 0) == model.counters.get(name, 0), name
