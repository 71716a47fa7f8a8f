"""Bounded decoding against a real ``kvstore serve`` (issue 35, item 3).

A client sends its own zstd payload with a valid codec header whose frame declares far more than
a block: a few KiB that decompress (or claim to decompress) to 1 GiB. The daemon must refuse it
naming the block without ever allocating more than a block for it: before the fix it allocated
the declared size first (peak RSS +1 GiB, seconds) and refused only afterwards. A client's fp8 or
int4 payload whose header (its CRC recomputed) declares another shape or group size than the
namespace's layout is refused before anything is decoded.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np
import pytest
import zstandard

import codec_blocks
from daemon_util import wait_codecs_warm
from kvstore import codecs
from kvstore.codecs.header import HEADER_BYTES, make_header, parse_header
from kvstore.errors import InvalidArgument
from kvstore.keys import KVLayout, Namespace
from kvstore.ops.local_daemon import start_local_daemon

MiB, GiB = 1 << 20, 1 << 30
LAYOUT = KVLayout(model="test/zstd-bomb", num_layers=8, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=32, layout="kv,layer,token,head,dim")   # 128 KiB blocks: a bomb (33 KB) is smaller, so the client sends it
#: the most the daemon's peak RSS may rise while refusing the bombs (a block is 128 KiB; the rest is
#: the request itself and allocator noise)
PEAK_SLACK = 96 * MiB


@functools.cache
def bomb(declared: bool) -> np.ndarray:
    """A codec payload (valid header, valid checksum) whose zstd frame decompresses to 1 GiB of
    zeros; ``declared``: the frame header says so. Built by streaming: nothing here holds 1 GiB."""
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=declared)
    stream = compressor.compressobj(size=GiB if declared else -1)
    zeros = bytes(8 * MiB)
    body = b"".join(stream.compress(zeros) for _ in range(GiB // len(zeros))) + stream.flush()
    assert len(body) < 128 * 1024 and zstandard.frame_content_size(body) == (GiB if declared else -1)
    planes = codecs.get_codec("zstd").header_param(LAYOUT)
    header = make_header(codecs.CODEC_IDS["zstd"], planes, LAYOUT, memoryview(body))
    return np.frombuffer(header + body, dtype=np.uint8)


def peak_rss(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def raw_daemon(tmp_path_factory):
    """A daemon whose CPU tier keeps blocks raw: a client's zstd payload is decoded on the way in."""
    workdir = tmp_path_factory.mktemp("zstd-bomb")
    d = start_local_daemon(workdir, "--shm-dir", str(workdir), cpu_bytes="16MiB", nvme_bytes="64MiB")
    wait_codecs_warm(d)   # its peak RSS is measured: not while a codec warm-up loads torch and the kernels
    yield d
    assert d.stop() == 0


@pytest.mark.parametrize("transport", ["grpc", "bulk", "shm"])
def test_a_zstd_bomb_is_refused_without_allocating_what_it_declares(raw_daemon, transport, monkeypatch):
    hashes, blocks = codec_blocks.chain(LAYOUT, 2, seed=71 + ["grpc", "bulk", "shm"].index(transport))
    real = codecs.encode_block
    bombs = {declared: bomb(declared) for declared in (True, False)}   # built before any call's deadline runs
    with raw_daemon.client(transport=transport, timeout_s=30) as c:   # a loaded CI host: no deadline races
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt="bomb"))
        assert c.put(ns, hashes[:1], blocks[:1], encode="zstd") == ["stored"]   # an honest payload decodes
        before = peak_rss(raw_daemon.pid)
        for declared in (True, False):
            monkeypatch.setattr(codecs, "encode_block", lambda name, raw, layout: (6, bombs[declared]))
            # a declared size is refused as the put is checked (naming the block); an unsaid one
            # once decoding passes a block's bytes
            with pytest.raises(InvalidArgument if declared else codecs.CodecError) as e:
                c.put(ns, hashes[1:], blocks[1:], parent=hashes[0], encode="zstd")
            monkeypatch.setattr(codecs, "encode_block", real)
            assert "zstd" in str(e.value), e.value
            if declared:
                assert e.value.field == "blocks[0]", e.value
        grown = peak_rss(raw_daemon.pid) - before
        assert grown < PEAK_SLACK, f"peak RSS rose {grown / MiB:.0f} MiB refusing a 1 GiB zstd bomb"
        assert c.exists(ns, hashes) == [True, False]
        # the daemon serves on: an honest payload after the bombs decodes (other hashes: over shared
        # memory a CompleteStore that failed keeps its lease's hashes until the lease runs out)
        again, blocks2 = codec_blocks.chain(LAYOUT, 2, seed=81 + ["grpc", "bulk", "shm"].index(transport))
        assert c.put(ns, again, blocks2, encode="zstd") == ["stored"] * 2
        assert c.get(ns, [hashes[0], *again]) == [b.tobytes() for b in (blocks[0], *blocks2)]
        assert c.active_transport == transport


def test_the_bound_holds_in_the_codec_itself():
    """``decode_block`` refuses both bombs from a 128 KiB block's budget (here, in-process)."""
    for declared in (True, False):
        with pytest.raises(codecs.CodecError, match="zstd"):
            codecs.decode_block(6, bomb(declared), LAYOUT)
    codec_id, payload = codecs.encode_block("zstd", codec_blocks.kv_block(LAYOUT, 5), LAYOUT)
    assert codecs.decode_block(codec_id, payload, LAYOUT).numpy().tobytes() == \
        codec_blocks.kv_block(LAYOUT, 5).tobytes()


def forged(codec: str, **fields) -> np.ndarray:
    """An honest ``codec`` payload of a block of LAYOUT whose header is rewritten to ``fields``
    (a shape or parameter far from the layout's), its CRC recomputed: what a client can send."""
    _, payload = codecs.encode_block(codec, codec_blocks.kv_block(LAYOUT, 9), LAYOUT)
    payload = np.asarray(payload, dtype=np.uint8)
    header = dataclasses.replace(parse_header(memoryview(payload)), **fields)
    return np.concatenate([np.frombuffer(header.pack(), np.uint8), payload[HEADER_BYTES:]])


@pytest.mark.parametrize("codec,fields,why", [
    ("fp8", {"tokens": 1 << 24}, "encoded for"),            # 1 << 24 tokens: 64 GiB if decoded as declared
    ("int4_g32", {"layers": 1 << 20, "heads": 1 << 10}, "encoded for"),
    ("int4_g32", {"param": 1}, "parameter"),                # a group of 1: a scale per element
])
def test_fp8_and_int4_headers_are_held_to_the_layout_not_to_what_they_declare(raw_daemon, codec, fields, why,
                                                                              monkeypatch):
    hashes, blocks = codec_blocks.chain(LAYOUT, 2, seed=91)
    bad = forged(codec, **fields)
    with raw_daemon.client(transport="grpc", timeout_s=30) as c:
        ns = c.register_namespace(Namespace(LAYOUT, cache_salt=f"forged-{codec}-{sorted(fields)}"))
        assert c.put(ns, hashes[:1], blocks[:1], encode=codec) == ["stored"]   # an honest payload is stored
        before = peak_rss(raw_daemon.pid)
        monkeypatch.setattr(codecs, "encode_block", lambda name, raw, layout: (codecs.CODEC_IDS[codec], bad))
        with pytest.raises((InvalidArgument, codecs.CodecError)) as e:
            c.put(ns, hashes[1:], blocks[1:], parent=hashes[0], encode=codec)
        monkeypatch.undo()
        assert why in str(e.value), e.value
        assert peak_rss(raw_daemon.pid) - before < PEAK_SLACK
        assert c.exists(ns, hashes) == [True, False]
