"""The vLLM connector's copies between paged KV tensors and host buffers (issue #13, GPU-ready):
the same calls on the CPU (CI, vLLM's CPU build: plain synchronous copies) and on CUDA (page-locked
host buffers, non-blocking copies on the copy stream, a per-layer event the compute stream waits
on). The CUDA case skips without a GPU and runs in benchmarks/gpu_check.sh."""

from __future__ import annotations

import pytest
import torch

from kvstore.connectors.vllm.paged_blocks import PagedBlocks

NB, BS, H, D, LAYERS = 8, 16, 2, 64, 3
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(),
                                                                 reason="needs a CUDA device"))]


def caches(device: str, seed: int | None) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed) if seed is not None else None
    make = (lambda: torch.randn(2, NB, BS, H, D, generator=g)) if g else (lambda: torch.zeros(2, NB, BS, H, D))
    return {f"layer.{i}": make().to(torch.bfloat16).to(device) for i in range(LAYERS)}


@pytest.mark.parametrize("device", DEVICES)
def test_blocks_go_out_and_back_through_host_buffers_layer_by_layer(device):
    src_kv = caches(device, seed=7)
    names = list(src_kv)
    out = PagedBlocks(src_kv, names, NB)
    staging = out.host_buffer(3)
    assert staging.device.type == "cpu" and staging.is_pinned() == (device == "cuda")
    out.gather([5, 1, 6], staging)                       # returns with the bytes in the host buffer
    dst_kv = caches(device, seed=None)
    back = PagedBlocks(dst_kv, names, NB)
    rows = back.to_device(staging, keep=[0, 2])           # blocks 5 and 6 arrived, block 1 did not
    for i in range(LAYERS):                               # as wait_for_layer_load places them
        back.scatter_layer(i, [2, 3], rows)
        back.wait_layer(i)
    back.settle()
    if device == "cuda":
        torch.cuda.synchronize()
    for name in names:
        assert torch.equal(dst_kv[name][:, 2], src_kv[name][:, 5])
        assert torch.equal(dst_kv[name][:, 3], src_kv[name][:, 6])
        untouched = [b for b in range(NB) if b not in (2, 3)]
        assert not dst_kv[name][:, untouched].any()


@pytest.mark.parametrize("device", DEVICES)
def test_a_gather_sees_what_the_compute_stream_wrote_before_it(device):
    """Saves copy pages out on the copy stream: it must wait for compute queued before it."""
    kv = caches(device, seed=None)
    names = list(kv)
    paged = PagedBlocks(kv, names, NB)
    for name in names:
        kv[name][:, 4].fill_(1.5)                          # compute stream (queued, not waited for)
    staging = paged.host_buffer(1)
    paged.gather([4], staging)
    assert torch.equal(staging[0].view(torch.bfloat16), torch.full((LAYERS * 2 * BS * H * D,), 1.5,
                                                                  dtype=torch.bfloat16))


@pytest.mark.parametrize("device", DEVICES)
def test_rows_that_arrive_a_layer_range_at_a_time_are_placed_per_layer(device):
    """Layer-wise loads from a remote daemon: each group of layers' byte range of the rows lands
    in the host buffer, goes to the device (``to_device_columns``) and is placed before the next
    group has arrived."""
    src_kv = caches(device, seed=3)
    names = list(src_kv)
    src = PagedBlocks(src_kv, names, NB)
    full = src.host_buffer(2)
    src.gather([4, 7], full)
    dst_kv = caches(device, seed=None)
    dst = PagedBlocks(dst_kv, names, NB)
    arriving = dst.host_buffer(2)
    arriving.zero_()
    rows = None
    for a, b in ((0, 1), (1, 3)):                         # layer 0, then layers 1 and 2
        lo, hi = dst.offsets[a], dst.offsets[b]
        arriving[:, lo:hi] = full[:, lo:hi]                # what the ranged get wrote
        rows = dst.to_device_columns(arriving, lo, hi, rows)
        for i in range(a, b):
            dst.scatter_layer(i, [0, 5], rows)
            dst.wait_layer(i)
    dst.settle()
    if device == "cuda":
        torch.cuda.synchronize()
        assert rows.device.type == "cuda"
    for name in names:
        assert torch.equal(dst_kv[name][:, 0], src_kv[name][:, 4])
        assert torch.equal(dst_kv[name][:, 5], src_kv[name][:, 7])


@pytest.mark.parametrize("device", DEVICES)
def test_layer_by_layer_gathers_equal_a_whole_gather(device):
    """Per-layer saves: layer i's pages are copied out right after it is computed (on CUDA the copy
    is queued behind that computation, not waited for), and once settled the rows equal a
    whole-block gather of the same pages."""
    kv = caches(device, seed=11)
    names = list(kv)
    paged = PagedBlocks(kv, names, NB)
    ids = [6, 0, 3]
    idx = torch.tensor(ids, dtype=torch.long, device=paged.device)
    rows = paged.host_buffer(len(ids))
    for i, name in enumerate(names):
        kv[name].mul_(2).add_(1)            # "computing" layer i (on the compute stream) ...
        paged.gather_layer(i, idx, rows)    # ... then saving it
    paged.settle()
    whole = paged.host_buffer(len(ids))
    paged.gather(ids, whole)
    assert torch.equal(rows, whole)
