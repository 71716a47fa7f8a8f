"""Codecs end to end against real daemons (issue #16): a block put under a CPU-tier codec is stored
encoded whatever the transport (shm slots are encoded at CompleteStore), takes the codec's share
of the arena, reads back as the codec's decoded bytes; a client that decodes receives the payload
as stored over every transport and decodes to exactly what a daemon-decoded get gives; an unknown
layout stays raw and is counted; fleet peers fetch encoded blocks and verify them against the
checksum their owner published, with every tier codec (the lossy ones and zstd)."""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
import codec_blocks
from fleet_util import SECRET, wait_for, write_fleet_config

from kvstore.codecs import CODEC_IDS, decode_block, encode_block
from kvstore.fleet import Directory
from kvstore.keys import KVLayout, Namespace
from kvstore.ops.local_daemon import start_local_daemon

LAYOUT = KVLayout(model="test/codec-transfer", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=32, layout="kv,layer,token,head,dim")   # 32 KiB blocks
SLOT = 4096
LOSSY = ["fp8", "fp8_head", "int4_g32", "int4_g64", "int4_g128", "int4_g64_k16", "int8", "int8_had", "int4_g64_k16_had",
         "int8_kchan", "int4_g64_t0"]
TIER_CODECS = LOSSY + ["zstd"]   # every codec a tier may be configured with (codecs.cpu: ...)
TRANSPORTS = ["shm", "bulk", "grpc"]


kv_block = functools.partial(codec_blocks.kv_block, LAYOUT)
chain = functools.partial(codec_blocks.chain, LAYOUT)


def stored_form(codec: str, raw: np.ndarray) -> tuple[np.ndarray, bytes]:
    """The payload a tier with ``codec`` keeps, and the bytes it decodes to."""
    codec_id, payload = encode_block(codec, raw, LAYOUT)
    return payload, decode_block(codec_id, payload, LAYOUT).numpy().tobytes()


def footprint(nbytes: int) -> int:
    return -(-nbytes // SLOT) * SLOT


def cpu_stats(c) -> dict:
    return c.stats()["tiers"]["cpu"]


@pytest.fixture(scope="module", params=LOSSY)
def codec_daemon(request, tmp_path_factory):
    codec = request.param
    workdir = tmp_path_factory.mktemp(f"codec-{codec}")
    config = workdir / "kvstore.yaml"
    config.write_text(f"codecs:\n  cpu: {codec}\ncpu_slot_bytes: 4KiB\nshm_dir: {workdir}\n")
    d = start_local_daemon(workdir, "--config", str(config), cpu_bytes="8MiB", nvme_bytes="64MiB")
    yield codec, d
    assert d.stop() == 0


def test_a_daemon_with_a_codec_tier_is_ready_only_once_its_kernels_are_compiled(tmp_path):
    """On a cold numba cache the kernels take seconds to compile (9 s here): a daemon that said
    SERVING before then made its first put into a codec tier wait for the compiler past the
    client's deadline. Ready (ready file, health SERVING) now means every kernel is compiled."""
    pytest.importorskip("numba")
    from kvstore.codecs import fast_cpu, fast_kchan, fast_rotated, fast_t0

    cache = tmp_path / "numba-cache"
    config = tmp_path / "kvstore.yaml"
    config.write_text(f"codecs:\n  cpu: int4_g64\nshm_dir: {tmp_path}\n")
    # (a cold compile of every kernel is ~20 s of CPU: minutes of wall time on a loaded host)
    d = start_local_daemon(tmp_path / "d", "--config", str(config), cpu_bytes="8MiB", nvme_bytes="64MiB",
                           env={"NUMBA_CACHE_DIR": str(cache)}, timeout=300)
    try:
        compiled = {p.name.split(".")[1].rsplit("-", 1)[0] for p in cache.rglob("*.nbi")}
        assert compiled == (set(fast_cpu.KERNEL_NAMES) | set(fast_rotated.KERNEL_NAMES) | set(fast_kchan.KERNEL_NAMES)
                            | set(fast_t0.KERNEL_NAMES))
        assert "codec kernels ready" in d.log()
        hashes, blocks = chain(2, seed=5)
        with d.client(timeout_s=2.0) as c:
            ns = c.register_namespace(Namespace(LAYOUT))
            assert c.put(ns, hashes, blocks) == ["stored"] * 2
            assert c.stats()["tiers"]["cpu"]["codec"]["encoded_blocks"] == 2
    finally:
        assert d.stop() == 0


def test_puts_over_every_transport_are_stored_encoded_and_read_back_decoded(codec_daemon):
    codec, d = codec_daemon
    chains = {t: chain(3, seed=10 + i) for i, t in enumerate(TRANSPORTS)}
    with d.client() as admin:
        ns = admin.register_namespace(Namespace(LAYOUT))
        for transport, (hashes, blocks) in chains.items():
            before = cpu_stats(admin)
            with d.client(transport=transport) as c:
                c.register_namespace(Namespace(LAYOUT))
                assert c.put(ns, hashes, blocks) == ["stored"] * 3
                assert c.active_transport == transport
            after = cpu_stats(admin)
            payloads = [stored_form(codec, b)[0] for b in blocks]
            assert after["codec"]["encoded_blocks"] - before["codec"]["encoded_blocks"] == 3, transport
            # the arena holds the payloads, not the raw blocks: used bytes shrink by the codec's ratio
            assert after["used_bytes"] - before["used_bytes"] == sum(footprint(p.nbytes) for p in payloads) \
                < 3 * LAYOUT.block_bytes, transport
        assert cpu_stats(admin)["codec"]["held_raw_blocks"] == 0
    for transport in TRANSPORTS:
        for compressed in (True, False):
            with d.client(transport=transport, compressed_transfer=compressed) as c:
                c.register_namespace(Namespace(LAYOUT))
                for hashes, blocks in chains.values():
                    got = c.get(ns, hashes)
                    assert got == [stored_form(codec, b)[1] for b in blocks], (transport, compressed)
                    assert got != [b.tobytes() for b in blocks]


def test_an_encoded_get_sends_the_payload_as_stored_over_every_transport(codec_daemon):
    codec, d = codec_daemon
    hashes, blocks = chain(4, seed=20)
    with d.client(transport="grpc") as w:
        ns = w.register_namespace(Namespace(LAYOUT))
        w.put(ns, hashes, blocks)
    for transport in TRANSPORTS:
        with d.client(transport=transport) as c:
            c.register_namespace(Namespace(LAYOUT))
            got = c.get_payloads(ns, hashes)
            assert [g[0] for g in got] == [CODEC_IDS[codec]] * 4, transport
            assert [g[1].tobytes() for g in got] == [stored_form(codec, b)[0].tobytes() for b in blocks], transport
            # decoded by the client into a torch tensor, like a raw (daemon-decoded) get
            outs = [torch.empty(LAYOUT.block_bytes, dtype=torch.uint8) for _ in hashes]
            assert c.get_into(ns, hashes, outs) == [LAYOUT.block_bytes] * 4
        with d.client(transport=transport, compressed_transfer=False) as raw:
            raw.register_namespace(Namespace(LAYOUT))
            assert [g[0] for g in raw.get_payloads(ns, hashes)] == [0] * 4   # the daemon decoded them
            assert raw.get(ns, hashes) == [o.numpy().tobytes() for o in outs], transport


def test_the_side_channel_can_decode_each_block_while_the_next_arrives(codec_daemon, monkeypatch):
    """With cores to spare the client decodes side-channel blocks on a worker thread as they land
    (forced here: CI has two cores); the result is the same as decoding at the end."""
    from kvstore.client import stream_paths

    monkeypatch.setattr(stream_paths, "EARLY_DECODE_MIN_CORES", 1)
    codec, d = codec_daemon
    hashes, blocks = chain(5, seed=25)
    with d.client(transport="bulk") as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        c.put(ns, hashes, blocks)
        assert c.get(ns, hashes) == [stored_form(codec, b)[1] for b in blocks]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_destination_decodes_on_its_device(codec_daemon):
    codec, d = codec_daemon
    hashes, blocks = chain(2, seed=30)
    with d.client() as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        c.put(ns, hashes, blocks)
        outs = [torch.empty(LAYOUT.block_bytes, dtype=torch.uint8, device="cuda") for _ in hashes]
        assert c.get_into(ns, hashes, outs) == [LAYOUT.block_bytes] * 2
        assert [o.cpu().numpy().tobytes() for o in outs] == [stored_form(codec, b)[1] for b in blocks]


def test_a_layout_the_codec_cannot_read_stays_raw_and_is_counted(codec_daemon):
    _, d = codec_daemon
    opaque = KVLayout(model="test/codec-transfer-opaque", num_layers=2, num_kv_heads=2, head_dim=64,
                      dtype="bfloat16", block_tokens=32, layout="opaque")
    hashes, blocks = chain(2, seed=40)
    with d.client(transport="bulk") as c:
        ns = c.register_namespace(Namespace(opaque))
        before = cpu_stats(c)["codec"]["raw_kept"].get("layout", {"blocks": 0, "bytes": 0})
        c.put(ns, hashes, blocks)
        assert c.get(ns, hashes) == [b.tobytes() for b in blocks]        # bit-exact
        after = cpu_stats(c)["codec"]["raw_kept"]["layout"]
        assert after["blocks"] - before["blocks"] == 2
        assert after["bytes"] - before["bytes"] == 2 * opaque.block_bytes


# -- fleet: peers fetch encoded payloads and verify the checksum their owner published ----------------

FLEET_NS = Namespace(LAYOUT, tenant="t", cache_salt="codec-fleet")


def fleet_daemon(tmp_path, redis_url: str, prefix: str, node_id: str, codec: str):
    workdir = tmp_path / node_id
    workdir.mkdir()
    path = write_fleet_config(workdir, redis_url, prefix, node_id)
    with open(path, "a") as f:
        f.write(f"codecs:\n  cpu: {codec}\n")
    return start_local_daemon(workdir, "--config", path, cpu_bytes="16MiB", nvme_bytes="0")


@pytest.mark.parametrize("codec", TIER_CODECS)
def test_fleet_peer_fetch_works_with_each_codec(tmp_path, redis_url, prefix, codec):
    d1 = fleet_daemon(tmp_path, redis_url, prefix, "c1", codec)
    d2 = fleet_daemon(tmp_path, redis_url, prefix, "c2", codec)
    try:
        hashes, blocks = chain(5, seed=50)
        directory = Directory(redis_url, prefix, secret=SECRET)
        with d1.client(transport="grpc") as c1, d2.client(transport="grpc") as c2:
            c1.register_namespace(FLEET_NS)
            c2.register_namespace(FLEET_NS)
            c1.put(FLEET_NS.id, hashes, blocks)
            wait_for(lambda: directory.entries(FLEET_NS.id, "c1") == 5, what="c1 to publish")
            assert c2.lookup(FLEET_NS.id, hashes).num_hit == 5        # fetched from c1, verified
            assert c2.get(FLEET_NS.id, hashes) == [stored_form(codec, b)[1] for b in blocks]
            stats = c2.stats()
            assert stats["fleet"]["counters"].get("peer_checksum_mismatch", 0) == 0
            assert stats["fleet"]["counters"]["fetched_blocks"] == 5
            assert stats["tiers"]["cpu"]["codec"]["held_encoded_blocks"] == 5   # kept as the peer stored it
            # the fetched copies publish the very checksum c1 did: c2 is listed as a holder too
            wait_for(lambda: directory.entries(FLEET_NS.id, "c2") == 5, what="c2 to publish its copies")
            assert c2.stats()["fleet"]["counters"].get("checksum_conflicts", 0) == 0
    finally:
        d1.kill()
        d2.kill()
