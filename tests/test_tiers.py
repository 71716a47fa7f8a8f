"""Each tier on its own against the Tier contract (tiers/base.py): real shm, real files, real torch."""

from __future__ import annotations

import os
import tempfile

import numpy as np
import pytest
import xxhash

from kvstore.errors import BlockCorrupt, BlockTooLarge, TierFull, TierIOError
from kvstore.tiers.base import BlockRecord
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.gpu import GpuTier
from kvstore.tiers.nvme import HEADER_BYTES, MAX_SLABS, READ_RUN_BYTES, NvmeTier, encode_header
from kvstore.tiers.slabs import RECORD_BYTES, SLAB_NAME, records_path
from kvstore.tiers.slots import SlotTable
from mounts import mounted
from proc_io import process_write_calls

NS = b"N" * 16
KIB = 1024


def rec(i: int, size: int, parent: int | None = None) -> BlockRecord:
    return BlockRecord(NS, i.to_bytes(16, "little"), None if parent is None else parent.to_bytes(16, "little"),
                       size, size)


def payload(i: int, size: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size=size, dtype=np.uint8)


def roundtrip(tier, r: BlockRecord, data: np.ndarray) -> None:
    tier.allocate(r)
    tier.write(r, data)
    out = np.zeros(r.stored_size + 100, dtype=np.uint8)
    assert tier.read_into(r.key, out) == r.stored_size
    assert np.array_equal(out[:r.stored_size], data)


def write_all(tier, records) -> None:
    """Allocate and write each record, its payload ``payload(first hash byte, stored_size)``."""
    for r in records:
        tier.allocate(r)
        tier.write(r, payload(r.block_hash[0], r.stored_size))


def fill_then_free_every_other(tier, slots: int, slot_bytes: int) -> list[BlockRecord]:
    """Fill ``slots`` one-slot blocks, then drop every other one: the free space is all holes, so a
    block of several slots must span several extents. Returns the blocks written."""
    blocks = [rec(i, slot_bytes) for i in range(slots)]
    write_all(tier, blocks)
    for r in blocks[::2]:
        tier.drop(r.key)
    return blocks


# -- slots -----------------------------------------------------------------------------------------

def test_slot_table_accounting_and_errors():
    st = SlotTable(10 * 4096, 4096, "t")
    assert st.footprint(1) == 4096 and st.footprint(4097) == 8192
    with pytest.raises(BlockTooLarge, match="exceeds the t tier"):
        st.footprint(11 * 4096)
    assert st.allocate(b"a", 3 * 4096) == [(0, 3 * 4096)]
    assert st.allocate(b"b", 4096 + 10) == [(3 * 4096, 4096 + 10)]
    with pytest.raises(KeyError):
        st.allocate(b"a", 1)
    with pytest.raises(TierFull, match="5 free slots, needs 6"):
        st.allocate(b"c", 6 * 4096)
    assert b"c" not in st and len(st) == 2  # a failed allocation changes nothing
    assert st.release(b"a") == 3 * 4096 and st.release(b"a") == 0


class Holder:
    """A ``SlotHolder``: what a store's index entry is to its CPU tier's slot table."""
    slot = None


def test_slot_table_keeps_slots_in_the_holders_it_is_given_and_in_its_own_dict_for_other_keys():
    st = SlotTable(10 * 4096, 4096, "t")
    st.allocate(b"x", 10)   # before any holders: the table's own dict
    holders = {b"a": Holder(), b"big": Holder()}
    st.keep_slots_in(holders)
    assert st.allocate(b"a", 100) == [(4096, 100)] and holders[b"a"].slot == 1
    assert st.allocate(b"big", 2 * 4096) == [(2 * 4096, 2 * 4096)] and holders[b"big"].slot is not None
    assert st.allocate_run([b"y"], 10) == 1 and b"y" not in holders   # no holder: the own dict
    assert len(st) == 4 and all(k in st for k in (b"a", b"big", b"x", b"y")) and b"zz" not in st
    assert st.lookup(b"a") == ([(4096, 100)], 100) and st.span(b"x") == (0, 10) and st.span(b"big") is None
    spans = st.spans([b"a", b"big", b"zz"])
    assert spans[:2] == [(4096, 100), None] and isinstance(spans[2], KeyError)
    with pytest.raises(KeyError):
        st.allocate(b"a", 1)
    with pytest.raises(KeyError):
        st.allocate_run([b"a"], 1)
    assert st.release(b"a") == 4096 and holders[b"a"].slot is None and b"a" not in st and len(st) == 3
    assert st.allocate(b"a", 7) == [(4096, 7)] and holders[b"a"].slot == 1   # the freed slot, again
    holders[b"y2"] = gone = Holder()
    st.allocate(b"y2", 5)
    del holders[b"y2"]
    st.let_go(b"y2", gone)   # its holder leaves the mapping: the table keeps it by key
    assert gone.slot is None and b"y2" in st and st.release(b"y2") == 4096
    st.keep_slots_in({})   # a new mapping: blocks held in the old holders move into the own dict
    assert holders[b"big"].slot is None and holders[b"a"].slot is None
    assert st.lookup(b"big") == ([(2 * 4096, 2 * 4096)], 2 * 4096) and st.lookup(b"a") == ([(4096, 7)], 7)
    assert len(st) == 4 and st.release(b"big") == 2 * 4096 and len(st) == 3


# -- CPU tier --------------------------------------------------------------------------------------

@pytest.fixture
def cpu():
    tier = CpuTier(16 * 64 * KIB, slot_bytes=64 * KIB)
    yield tier
    tier.close()


def test_cpu_tier_roundtrip_and_shared_segment(cpu):
    assert os.path.exists(cpu.segment_path) and cpu.segment_path.startswith("/dev/shm/")
    r = rec(1, 100 * KIB)
    roundtrip(cpu, r, payload(1, 100 * KIB))
    assert cpu.used_bytes == 2 * 64 * KIB  # slot rounding is accounted
    # a second process mapping the segment sees the very same bytes at the given extents
    (off, length), = cpu.extents(r.key)
    with open(cpu.segment_path, "rb") as f:
        f.seek(off)
        assert f.read(length) == payload(1, 100 * KIB).tobytes()
    cpu.drop(r.key)
    cpu.drop(r.key)  # idempotent
    assert cpu.used_bytes == 0
    with pytest.raises(KeyError):
        cpu.read_into(r.key, np.zeros(100 * KIB, np.uint8))
    cpu.close()
    assert not os.path.exists(cpu.segment_path)


def test_cpu_tier_multi_extent_blocks_after_churn(cpu):
    small = fill_then_free_every_other(cpu, 16, 64 * KIB)   # a 4-slot block must then span 4 extents
    big = rec(100, 4 * 64 * KIB - 123)
    data = payload(100, big.stored_size)
    roundtrip(cpu, big, data)
    ext = cpu.extents(big.key)
    assert len(ext) == 4 and sum(n for _, n in ext) == big.stored_size
    assert np.array_equal(np.concatenate(cpu.view(big.key)), data)
    for r in small[1::2]:  # neighbours untouched
        out = np.empty(64 * KIB, np.uint8)
        cpu.read_into(r.key, out)
        assert np.array_equal(out, payload(r.block_hash[0], 64 * KIB))
    with pytest.raises(TierFull):
        cpu.allocate(rec(200, 5 * 64 * KIB))  # 4 free slots left


def test_cpu_tier_sweeps_arenas_of_dead_daemons():
    import subprocess
    import sys
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        stale = os.path.join(d, f"kvstore-{dead_pid}-0badf00d")
        alive = os.path.join(d, f"kvstore-{os.getpid()}-00c0ffee")
        other = os.path.join(d, f"someone-{dead_pid}-0badf00d")
        for path in (stale, alive, other):
            open(path, "wb").close()
        tier = CpuTier(64 * KIB, slot_bytes=64 * KIB, shm_dir=d)
        try:
            assert tier.stale_segments_removed == 1
            assert not os.path.exists(stale)
            assert os.path.exists(alive) and os.path.exists(other)  # live owner / not ours: kept
        finally:
            tier.close()


def test_cpu_tier_too_large_and_too_big_for_shm():
    tier = CpuTier(4 * 64 * KIB, slot_bytes=64 * KIB)
    try:
        with pytest.raises(BlockTooLarge, match="cpu tier"):
            tier.footprint(5 * 64 * KIB)
    finally:
        tier.close()
    with tempfile.TemporaryDirectory() as d:
        not_a_dir = os.path.join(d, "file")
        open(not_a_dir, "w").close()
        with pytest.raises(TierIOError, match="cannot create shared segment"):
            CpuTier(64 * KIB, slot_bytes=64 * KIB, shm_dir=not_a_dir)


# -- NVMe tier -------------------------------------------------------------------------------------

def _slabs(d: str) -> list[str]:
    return sorted(n for n in os.listdir(d) if SLAB_NAME.fullmatch(n))


def test_nvme_roundtrip_uses_o_direct_on_a_disk(tmp_path):
    tier = NvmeTier(str(tmp_path / "n"), 64 << 20)
    if not tier.o_direct:
        pytest.skip(f"{tmp_path} does not support O_DIRECT")
    for i, size in enumerate((1, 4096, 100_000, 1 << 20)):
        roundtrip(tier, rec(i, size), payload(i, size))
    assert tier.stats()["o_direct"] == 1
    # one slab per footprint: 1 and 4096 bytes both take a header page and one payload page
    assert len(_slabs(tier.path)) == 3 == tier.stats()["slab_files"]
    path, offset = tier.location(rec(2, 1).key)
    assert offset == 0 and os.path.getsize(path) == HEADER_BYTES + 102_400
    assert tier.location(rec(0, 1).key)[1] == 0 and tier.location(rec(1, 1).key)[1] == 2 * 4096


def _buffered_fallback(d: str) -> None:
    tier = NvmeTier(d, 8 << 20)
    assert tier.o_direct is False and tier.stats()["o_direct"] == 0
    for i, size in enumerate((7, 65536, 300_001)):
        roundtrip(tier, rec(i, size), payload(i, size))
    assert len(list(NvmeTier(d, 8 << 20).recover())) == 3


def test_nvme_falls_back_to_buffered_io_where_o_direct_is_refused():
    # tmpfs refused O_DIRECT until Linux 6.6; ramfs still does. Use whichever refuses it here.
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        if not NvmeTier(d, 1 << 20).o_direct:
            _buffered_fallback(d)
            return
    with mounted("ramfs") as d:
        _buffered_fallback(d)


def test_nvme_on_tmpfs(tmp_path):
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        tier = NvmeTier(d, 8 << 20)  # O_DIRECT or not, depending on the kernel: both must work
        for i, size in enumerate((7, 65536, 300_001)):
            roundtrip(tier, rec(i, size), payload(i, size))
        assert len(list(NvmeTier(d, 8 << 20).recover())) == 3
    assert NvmeTier(str(tmp_path), 1 << 20, use_o_direct=False).o_direct is False


def _aligned(nbytes: int) -> np.ndarray:
    import mmap
    return np.frombuffer(mmap.mmap(-1, nbytes), dtype=np.uint8)


def _slot_bytes(tier: NvmeTier, key: bytes, start: int = 0, n: int | None = None) -> bytes:
    path, offset = tier.location(key)
    with open(path, "rb") as f:
        f.seek(offset + start)
        return f.read(n if n is not None else tier.footprint(tier.record(key).stored_size) - start)


def test_nvme_zero_copy_paths_for_page_aligned_buffers(tmp_path):
    """Aligned payloads go to disk without staging, aligned outputs are filled by the disk; both
    must produce and verify the same slots as the staged path."""
    tier = NvmeTier(str(tmp_path), 64 << 20)
    size = 256 * KIB
    src = _aligned(size)
    src[:] = payload(5, size)
    a, b = rec(1, size), rec(2, size)
    tier.allocate(a)
    tier.write(a, src)                  # direct write
    tier.allocate(b)
    tier.write(b, payload(5, size))     # staged write of the same bytes
    assert _slot_bytes(tier, a.key, HEADER_BYTES) == _slot_bytes(tier, b.key, HEADER_BYTES)
    out = _aligned(size)
    assert tier.read_into(a.key, out) == size  # direct read
    assert np.array_equal(out, src)
    _flip(*tier.location(b.key), HEADER_BYTES + 100)
    with pytest.raises(BlockCorrupt):
        tier.read_into(b.key, _aligned(size))  # a direct read verifies too
    assert tier.corrupt_dropped == 1


def test_nvme_a_chain_lies_in_adjacent_slots_and_a_dropped_slot_is_reused(tmp_path):
    tier = NvmeTier(str(tmp_path), 64 << 20)
    fp = tier.footprint(50_000)
    records = [rec(i, 50_000) for i in range(6)]
    write_all(tier, records)
    assert [tier.location(r.key)[1] for r in records] == [i * fp for i in range(6)]
    tier.drop(records[2].key)
    tier.finish_drops()   # its slot erased: free for the next block
    assert _slot_bytes(tier, records[3].key, 0, 8) == b"KVSBLK02"
    late = rec(9, 50_000)
    tier.allocate(late)
    tier.write(late, payload(9, 50_000))
    assert tier.location(late.key)[1] == 2 * fp   # the lowest free slot
    for r in [*records[:2], late, *records[3:]]:
        out = np.empty(50_000, np.uint8)
        assert tier.read_into(r.key, out) == 50_000 and np.array_equal(out, payload(r.block_hash[0], 50_000))
    assert tier.used_bytes == 6 * fp


def test_nvme_a_dropped_block_does_not_come_back_after_a_restart(tmp_path):
    d = str(tmp_path)
    tier = NvmeTier(d, 64 << 20)
    records = [rec(i, 20_000) for i in range(4)]
    write_all(tier, records)
    tier.drop(records[1].key)
    tier.sync()
    tier.close()
    again = NvmeTier(d, 64 << 20)
    assert sorted(r.key for r in again.recover()) == sorted(r.key for r in records if r is not records[1])
    assert again.corrupt_dropped == 0 and again.used_bytes == 3 * again.footprint(20_000)


def test_nvme_drops_in_runs_are_erased_together_and_only_theirs(tmp_path):
    """Dropped blocks in neighbouring slots are erased a run at a time (``Slab.punch``: one
    record write a run, where one a block took 37 here): each dropped slot reads back as zeros,
    the blocks between and around them keep every byte, and a restart brings back exactly those
    kept."""
    d = str(tmp_path)
    tier = NvmeTier(d, 64 << 20)
    records = [rec(i, 20_000) for i in range(40)]
    write_all(tier, records)
    gone = (1, 2, 3, 5, *range(7, 40))   # three runs
    for k in gone:
        tier.drop(records[k].key)
    kept = [r for k, r in enumerate(records) if k not in gone]
    slots = {r.key: tier.location(r.key)[1] for r in kept}
    path = tier.location(kept[0].key)[0]   # (one size: one slab)
    before = process_write_calls()
    tier.finish_drops()
    assert process_write_calls() - before <= 3
    fp = tier.footprint(20_000)
    with open(path, "rb") as f:
        raw = f.read()
    for k in gone:
        assert raw[k * fp:(k + 1) * fp].count(0) == min(fp, max(0, len(raw) - k * fp)), k
    for r in kept:
        assert raw[slots[r.key]:slots[r.key] + 8] == b"KVSBLK02"
        out = np.empty(20_000, np.uint8)
        assert tier.read_into(r.key, out) == 20_000 and np.array_equal(out, payload(r.block_hash[0], 20_000))
    tier.sync()
    tier.close()
    again = NvmeTier(d, 64 << 20)
    assert sorted(r.key for r in again.recover()) == sorted(r.key for r in kept)
    assert again.corrupt_dropped == 0


def test_nvme_recover_never_takes_a_header_planted_in_a_payload(tmp_path):
    """A client controls payload bytes, and each payload page starts on a 4 KiB boundary. It puts
    block A whose first payload page is a valid header, for a key it chose and the same
    footprint, with the checksum of the 7 pages that follow it on disk (the rest of A and the
    header of its next block B, which it can compute: B is its own). After a restart only A and
    B are found, never the forged block: headers are read only at slot starts."""
    d = str(tmp_path)
    tier = NvmeTier(d, 64 << 20)
    size = 7 * 4096   # footprint 8 pages
    a, b = rec(1, size), rec(2, size)
    body_b = payload(2, size)
    b.checksum = xxhash.xxh3_64_intdigest(body_b)
    b_header = np.zeros(4096, np.uint8)
    b_header[:len(encode_header(b))] = np.frombuffer(encode_header(b), np.uint8)
    body_a = payload(1, size)
    forged = rec(66, size)
    forged.checksum = xxhash.xxh3_64_intdigest(np.concatenate([body_a[4096:], b_header]))
    page = encode_header(forged)
    body_a[:4096] = 0
    body_a[:len(page)] = np.frombuffer(page, np.uint8)
    assert xxhash.xxh3_64_intdigest(np.concatenate([body_a[4096:], b_header])) == forged.checksum
    for r, body in ((a, body_a), (b, body_b)):
        tier.allocate(r)
        tier.write(r, body)
    assert tier.location(b.key)[1] == tier.location(a.key)[1] + 8 * 4096   # laid out as planned
    tier.close()
    again = NvmeTier(d, 64 << 20, verify_on_recover=True)
    assert sorted(x.key for x in again.recover()) == sorted([a.key, b.key])
    with pytest.raises(KeyError):
        again.record(forged.key)
    out = np.empty(size, np.uint8)
    assert again.read_into(a.key, out) == size and np.array_equal(out, body_a)


def test_nvme_holds_recovered_blocks_as_rows_read_dropped_and_stored_again(tmp_path):
    """A restarted tier holds what it found as rows of its slabs' columns (``RecoveredRows``):
    each block's record is made when asked, neighbours are read in one run, a dropped one can be
    stored again (a held one cannot), and the next restart finds exactly what is held."""
    d = str(tmp_path)
    tier = NvmeTier(d, 64 << 20)
    records = [rec(i, 8192, parent=i - 1 if i else None) for i in range(8)] + [rec(20, 5000)]
    write_all(tier, records)
    tier.close()
    again = NvmeTier(d, 64 << 20)
    batches = list(again.recover_blocks())
    assert sorted(k for b in batches for k in b.keys) == sorted(r.key for r in records)
    for b in batches:
        for key, parent in zip(b.keys, b.parent_keys):
            assert parent is None or parent in b.keys   # a parent's key is its parent's key object
            assert parent is None or any(parent is k for k in b.keys)
    assert again.stats()["blocks"] == 9 and again.used_bytes == tier.used_bytes
    for r in records:
        assert again.record(r.key) == r.replace(checksum=0) and again.checksum(r.key) == r.checksum
    outs = [np.zeros(r.stored_size, np.uint8) for r in records[:8]]
    assert again.read_many_into([r.key for r in records[:8]], outs) == [8192] * 8
    assert all(np.array_equal(o, payload(i, 8192)) for i, o in enumerate(outs))
    with pytest.raises(KeyError):
        again.allocate(rec(3, 8192))   # held already
    again.drop(records[3].key)
    again.drop(records[3].key)   # idempotent
    again.drop(records[8].key)   # the last of its slab's rows
    with pytest.raises(KeyError):
        again.record(records[3].key)
    assert again.stats()["blocks"] == 7 and len(again.records()) == 7
    again.finish_drops()
    r3 = rec(3, 8192, parent=2)
    roundtrip(again, r3, payload(3, 8192))
    again.close()
    third = NvmeTier(d, 64 << 20)
    assert sorted(r.key for r in third.recover()) == sorted(r.key for r in records[:8])
    out = np.zeros(8192, np.uint8)
    assert third.read_into(r3.key, out) == 8192 and np.array_equal(out, payload(3, 8192))


def test_nvme_recover_rebuilds_the_index_and_cleans_leftovers(tmp_path):
    d = str(tmp_path)
    tier = NvmeTier(d, 64 << 20)
    records = [rec(i, 50_000, parent=i - 1 if i else None) for i in range(5)]
    write_all(tier, records)
    open(os.path.join(d, "deadbeef.kvb.tmp"), "wb").write(b"half a block of the older layout")
    open(os.path.join(d, "deadbeef.kvb"), "wb").write(b"a block file of the older layout")
    open(os.path.join(d, "unrelated.txt"), "w").write("not ours")
    again = NvmeTier(d, 64 << 20)
    found = {r.key: r for r in again.recover()}
    assert set(found) == {r.key for r in records}
    assert found[records[3].key].parent_hash == records[2].block_hash
    assert found[records[0].key].parent_hash is None
    assert again.used_bytes == tier.used_bytes
    assert not any(n.endswith((".kvb", ".tmp")) for n in os.listdir(d))
    assert os.path.exists(os.path.join(d, "unrelated.txt"))  # never deletes what is not ours
    out = np.empty(50_000, np.uint8)
    again.read_into(records[4].key, out)
    assert np.array_equal(out, payload(4, 50_000))
    late = rec(7, 50_000)   # new blocks go after the recovered ones
    again.allocate(late)
    again.write(late, payload(7, 50_000))
    assert again.location(late.key)[1] == 5 * again.footprint(50_000)


def _flip(path: str, base: int, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(base + offset)
        b = f.read(1)
        f.seek(base + offset)
        f.write(bytes([b[0] ^ 0x01]))


def _copy_slot(tier: NvmeTier, src: bytes, dst: bytes) -> None:
    data = _slot_bytes(tier, src)
    path, offset = tier.location(dst)
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


@pytest.mark.parametrize("damage", ["payload-bit", "header-bit", "truncate", "zeroed", "swap"])
def test_nvme_read_detects_damage_and_drops_the_block(tmp_path, damage):
    tier = NvmeTier(str(tmp_path), 64 << 20)
    b, a = rec(2, 20_000), rec(1, 20_000)   # a in the last slot, so a truncation cuts only a
    write_all(tier, (b, a))
    path, offset = tier.location(a.key)
    if damage == "payload-bit":
        _flip(path, offset, HEADER_BYTES + 12_345)
    elif damage == "header-bit":
        _flip(path, offset, 40)
    elif damage == "truncate":
        os.truncate(path, offset + HEADER_BYTES + 10_000)
    elif damage == "zeroed":
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(bytes(HEADER_BYTES))
    else:  # another block's (intact) slot copied over this one
        _copy_slot(tier, b.key, a.key)
    used = tier.used_bytes
    with pytest.raises(BlockCorrupt, match="dropped"):
        tier.read_into(a.key, np.empty(20_000, np.uint8))
    assert tier.corrupt_dropped == 1
    assert tier.used_bytes < used
    with pytest.raises(KeyError):
        tier.read_into(a.key, np.empty(20_000, np.uint8))
    out = np.empty(20_000, np.uint8)
    assert tier.read_into(b.key, out) == 20_000 and np.array_equal(out, payload(2, 20_000))


def _record_at(tier: NvmeTier, key: bytes) -> tuple[str, int]:
    """(record file, offset of ``key``'s record in it)."""
    path, offset = tier.location(key)
    return records_path(path), offset // tier.footprint(tier.record(key).stored_size) * RECORD_BYTES


@pytest.mark.parametrize("damage", ["truncate", "record-bit", "record-copied", "record-file-cut"])
def test_nvme_recover_never_yields_a_damaged_record(tmp_path, damage):
    tier = NvmeTier(str(tmp_path), 64 << 20)
    b, a = rec(2, 20_000), rec(1, 20_000)
    write_all(tier, (b, a))
    path, offset = tier.location(a.key)
    records, at = _record_at(tier, a.key)
    if damage == "truncate":
        os.truncate(path, offset + HEADER_BYTES + 4096)
    elif damage == "record-bit":
        _flip(records, at, 17)
    elif damage == "record-file-cut":   # a's record lost (a crash before it was written): a is not found
        os.truncate(records, at)
    else:   # the same block twice: only the first slot's copy is taken
        with open(records, "r+b") as f:
            f.seek(_record_at(tier, b.key)[1])
            row = f.read(RECORD_BYTES)
            f.seek(at)
            f.write(row)
    tier.close()
    again = NvmeTier(str(tmp_path), 64 << 20)
    assert [r.key for r in again.recover()] == [b.key]
    assert again.corrupt_dropped == (1 if damage in ("record-bit", "record-copied") else 0)
    assert again.used_bytes == again.footprint(20_000)
    late = rec(3, 20_000)   # the damaged slot is free again
    again.allocate(late)
    again.write(late, payload(3, 20_000))
    assert again.location(late.key)[1] == offset


def _two_blocks_one_slot_damaged(d: str, damage: str) -> tuple[BlockRecord, BlockRecord]:
    """Blocks b then a written to a tier in ``d``, then a's slot (not its record) damaged."""
    tier = NvmeTier(d, 64 << 20)
    b, a = rec(2, 20_000), rec(1, 20_000)
    write_all(tier, (b, a))
    path, offset = tier.location(a.key)
    if damage == "header-bit":
        _flip(path, offset, 17)
    elif damage == "zeroed":
        with open(path, "r+b") as f:
            f.seek(offset)
            f.write(bytes(HEADER_BYTES))
    else:
        _copy_slot(tier, b.key, a.key)
    tier.close()
    return a, b


@pytest.mark.parametrize("damage", ["header-bit", "copied", "zeroed"])
def test_nvme_a_slot_damaged_behind_its_record_is_a_counted_miss(tmp_path, damage):
    """Recovery reads the records, not the slots: a block whose slot was damaged is found, and its
    first read verifies the slot's header and payload, drops it and counts it. Recovery with
    ``verify_on_recover`` reads each slot and never yields it."""
    a, b = _two_blocks_one_slot_damaged(str(tmp_path / "verified"), damage)
    verified = NvmeTier(str(tmp_path / "verified"), 64 << 20, verify_on_recover=True)
    assert [r.key for r in verified.recover()] == [b.key] and verified.corrupt_dropped == 1
    a, b = _two_blocks_one_slot_damaged(str(tmp_path / "plain"), damage)
    again = NvmeTier(str(tmp_path / "plain"), 64 << 20)
    assert sorted(r.key for r in again.recover()) == sorted([a.key, b.key])
    with pytest.raises(BlockCorrupt, match="dropped"):
        again.read_into(a.key, np.empty(20_000, np.uint8))
    assert again.corrupt_dropped == 1
    out = np.empty(20_000, np.uint8)
    assert again.read_into(b.key, out) == 20_000 and np.array_equal(out, payload(2, 20_000))


def test_nvme_a_slab_without_its_record_file_is_recovered_from_its_slots(tmp_path):
    """A slab whose record file is gone (or one written before record files) is read slot by slot
    once, damaged slots dropped and counted, and its record file written again from what it holds."""
    d = str(tmp_path)
    tier = NvmeTier(d, 64 << 20)
    records = [rec(i, 20_000) for i in range(4)]
    write_all(tier, records)
    path, offset = tier.location(records[2].key)
    tier.close()
    _flip(path, offset, 17)
    os.unlink(records_path(path))
    again = NvmeTier(d, 64 << 20)
    want = sorted(r.key for r in records if r is not records[2])
    assert sorted(r.key for r in again.recover()) == want and again.corrupt_dropped == 1
    again.close()
    assert os.path.exists(records_path(path))
    third = NvmeTier(d, 64 << 20)
    assert sorted(r.key for r in third.recover()) == want and third.corrupt_dropped == 0


def test_nvme_recover_with_verification_catches_payload_rot(tmp_path):
    tier = NvmeTier(str(tmp_path), 64 << 20)
    a = rec(1, 20_000)
    tier.allocate(a)
    tier.write(a, payload(1, 20_000))
    _flip(*tier.location(a.key), HEADER_BYTES + 5)
    assert len(list(NvmeTier(str(tmp_path), 64 << 20).recover())) == 1  # header-only scan: cheap
    assert list(NvmeTier(str(tmp_path), 64 << 20, verify_on_recover=True).recover()) == []


def test_nvme_capacity_and_bad_directory(tmp_path):
    tier = NvmeTier(str(tmp_path / "n"), 3 * (HEADER_BYTES + 8192))
    for i in range(3):
        tier.allocate(rec(i, 8192))
    with pytest.raises(TierFull, match="nvme tier"):
        tier.allocate(rec(9, 1))
    with pytest.raises(BlockTooLarge, match="nvme tier"):
        tier.footprint(1 << 20)
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(TierIOError, match="not writable"):
        NvmeTier(str(blocker / "sub"), 1 << 20)


def test_nvme_holds_at_most_max_slabs_block_sizes(tmp_path):
    tier = NvmeTier(str(tmp_path), 1 << 30)
    for i in range(MAX_SLABS):
        tier.allocate(rec(i, (i + 1) * 4096))
    with pytest.raises(TierFull, match=f"{MAX_SLABS} different sizes"):
        tier.allocate(rec(999, (MAX_SLABS + 1) * 4096))
    tier.allocate(rec(998, 4096))   # a size it holds already still fits
    tier.drop(rec(MAX_SLABS - 1, 1).key)   # the only block of the largest size: its slab goes
    tier.finish_drops()
    tier.allocate(rec(999, (MAX_SLABS + 1) * 4096))


def test_nvme_a_slab_left_empty_is_deleted_and_its_size_starts_afresh(tmp_path):
    d = str(tmp_path)
    tier = NvmeTier(d, 64 << 20)
    small, big = [rec(i, 8192) for i in range(3)], [rec(10 + i, 50_000) for i in range(2)]
    write_all(tier, [*small, *big])
    assert len(_slabs(d)) == 2
    big_slab = tier.location(big[0].key)[0]
    for r in big:
        tier.drop(r.key)
    tier.finish_drops()
    assert _slabs(d) == [os.path.basename(tier.location(small[0].key)[0])] and not os.path.exists(big_slab)
    assert tier.stats()["slab_files"] == 1
    again = rec(20, 50_000)
    tier.allocate(again)
    tier.write(again, payload(20, 50_000))
    assert tier.location(again.key)[1] == 0 and tier.location(again.key)[0] != big_slab
    path, offset = tier.location(again.key)
    tier.close()
    with open(records_path(path), "r+b") as f:   # its only record erased: a slab found empty at recovery goes too
        f.seek(offset)
        f.write(bytes(RECORD_BYTES))
    restarted = NvmeTier(d, 64 << 20)
    assert sorted(x.key for x in restarted.recover()) == sorted(r.key for r in small)
    assert not os.path.exists(path) and len(_slabs(d)) == 1
    for r in small:
        restarted.drop(r.key)
    restarted.finish_drops()
    assert _slabs(d) == []


# -- GPU tier (device-agnostic torch) --------------------------------------------------------------

def _gpu_roundtrip(device: str) -> None:
    import torch

    tier = GpuTier(8 * 64 * KIB, slot_bytes=64 * KIB, device=device)
    assert tier.pool.device.type == torch.device(device).type
    blocks = fill_then_free_every_other(tier, 8, 64 * KIB)
    big = rec(50, 3 * 64 * KIB + 1)
    src = torch.from_numpy(payload(50, big.stored_size))
    tier.allocate(big)
    tier.write(big, src.to(device))  # a tensor on the device
    assert len(tier.extents(big.key)) == 4
    out = torch.zeros(big.stored_size, dtype=torch.uint8, device=device)
    assert tier.read_into(big.key, out) == big.stored_size
    assert torch.equal(out.cpu(), src)
    host = np.zeros(64 * KIB, np.uint8)  # numpy in and out work too
    tier.read_into(blocks[1].key, host)
    assert np.array_equal(host, payload(1, 64 * KIB))
    with pytest.raises(TierFull):
        tier.allocate(rec(99, 64 * KIB))


def test_gpu_tier_on_cpu_device():
    _gpu_roundtrip("cpu")


def test_gpu_tier_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    _gpu_roundtrip("cuda")


def test_cpu_arena_is_page_locked_with_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    tier = CpuTier(4 * 64 * KIB, slot_bytes=64 * KIB)
    try:
        assert tier.page_locked
    finally:
        tier.close()


def _read_calls() -> int:
    with open("/proc/thread-self/io") as f:
        return int(next(line for line in f if line.startswith("syscr:")).split()[1])


def test_nvme_reads_neighbouring_slots_in_runs_and_judges_each_block_alone(tmp_path):
    """A chain stored in one go lies in neighbouring slots; ``read_many_into`` reads it with a
    few preadv calls (counted by the kernel: /proc/thread-self/io), into aligned and unaligned
    buffers alike, and still finds the one damaged block among them, the cut-off tail and a key
    it does not hold, each in its own place."""
    tier = NvmeTier(str(tmp_path), 64 << 20)
    size = 64 * KIB
    records = [rec(i, size) for i in range(40)]
    write_all(tier, records)
    keys = [r.key for r in records]
    outs = [_aligned(size) if i % 3 else np.zeros(size + 1, np.uint8)[1:] for i in range(40)]   # some unaligned
    before = _read_calls()
    assert tier.read_many_into(keys[:32], outs[:32]) == [size] * 32
    in_runs = _read_calls() - before
    before = _read_calls()
    for key, out in zip(keys[:32], outs[:32]):
        tier.read_into(key, out)
    one_by_one = _read_calls() - before
    assert one_by_one >= 32 and in_runs <= -(-32 // (READ_RUN_BYTES // tier.footprint(size))) + 2   # + reading io
    assert all(np.array_equal(o, payload(i, size)) for i, o in enumerate(outs[:32]))
    path, offset = tier.location(keys[5])
    _flip(path, offset, HEADER_BYTES + 999)
    os.truncate(path, tier.location(keys[38])[1] + HEADER_BYTES + 100)   # 38 cut, 39 gone
    missing = rec(77, size).key
    got = tier.read_many_into([*keys, missing], [*(np.zeros(size, np.uint8) for _ in keys), np.zeros(size, np.uint8)])
    assert isinstance(got[5], BlockCorrupt) and isinstance(got[38], BlockCorrupt) and isinstance(got[39], BlockCorrupt)
    assert isinstance(got[40], KeyError)
    assert [g for i, g in enumerate(got[:38]) if i != 5] == [size] * 37
    assert tier.corrupt_dropped == 3 and tier.stats()["blocks"] == 37
    back = list(reversed(keys[10:20]))   # not neighbours in this order: read one by one, still exact
    outs = [np.zeros(size, np.uint8) for _ in back]
    assert tier.read_many_into(back, outs) == [size] * 10
    assert all(np.array_equal(o, payload(19 - k, size)) for k, o in enumerate(outs))


def _write_calls() -> int:
    with open("/proc/thread-self/io") as f:
        return int(next(line for line in f if line.startswith("syscw:")).split()[1])


def test_nvme_writes_neighbouring_slots_in_runs(tmp_path):
    """Blocks reserved together lie in neighbouring slots; ``write_many_unsynced`` writes them
    with one pwritev per run (and one write of their records), from aligned and unaligned buffers
    alike, and each reads back exact and is found again after a restart."""
    tier = NvmeTier(str(tmp_path), 64 << 20)
    size = 16 * KIB
    records = [rec(i, size) for i in range(24)]
    for r in records:
        tier.allocate(r)
    datas = [payload(r.block_hash[0], size) if i % 2 else _aligned(size) for i, r in enumerate(records)]
    for i, d in enumerate(datas):
        if not i % 2:
            d[:] = payload(records[i].block_hash[0], size)
    tier.write(records[0], datas[0])   # the slab and its record file exist before counting
    before = _write_calls()
    assert tier.write_many_unsynced(records[1:], datas[1:], durable=False) == [None] * 23
    assert _write_calls() - before <= 3   # one pwritev, one write of the records (+ a slack of one)
    tier.sync()
    for r, d in zip(records, datas):
        out = np.empty(size, np.uint8)
        assert tier.read_into(r.key, out) == size and np.array_equal(out, d)
    tier.close()
    again = NvmeTier(str(tmp_path), 64 << 20)
    assert sorted(r.key for r in again.recover()) == sorted(r.key for r in records)


def test_nvme_a_failed_run_write_drops_its_blocks_only(tmp_path):
    tier = NvmeTier(str(tmp_path), 64 << 20)
    small, big = [rec(i, 8192) for i in range(3)], [rec(10 + i, 20_000) for i in range(3)]
    for r in [*small, *big]:
        tier.allocate(r)
    tier.write(small[0], payload(0, 8192))
    os.unlink(tier.location(small[0].key)[0])   # the small blocks' slab is gone: their writes fail
    got = tier.write_many_unsynced([*small[1:], *big], [payload(r.block_hash[0], r.stored_size)
                                                       for r in [*small[1:], *big]])
    assert [isinstance(g, TierIOError) for g in got] == [True, True, False, False, False]
    assert tier.stats()["blocks"] == 4 and all(tier.read_into(r.key, np.empty(20_000, np.uint8)) == 20_000 for r in big)
