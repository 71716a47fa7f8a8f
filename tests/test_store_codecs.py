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
    encoded = [nvme.record(k) for k in list(nvme._files)]  # noqa: SLF001 - inspecting what hit disk
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
    promoted = [k for k in cpu.slots._blocks]  # noqa: SLF001
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
