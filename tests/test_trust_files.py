"""Planted files and loose permissions in the NVMe directory (issue 17, item 4).

Threat: another local user or a stale process plants a symlink where the tier writes (a slab or
probe file), a FIFO or a symlink where recovery reads (``slab-*.kvs``, and the older layout's
``*.kvb``), or reads cached KV bytes because the directory is loose. Each case runs against the real tier and, where it matters at start-up or
on the write path, against a real ``kvstore serve`` daemon. Planted files are real symlinks and FIFOs.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import threading
import time

import numpy as np
import pytest

from daemon_util import start_daemon
from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.errors import TierIOError
from kvstore.tiers.base import BlockRecord
from kvstore.tiers.nvme import HEADER_BYTES, NvmeTier, find_blocks
from kvstore.tiers.slabs import SLAB_NAME

NS = b"T" * 16
LAYOUT = KVLayout(model="test/trust-files", num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16",
                  block_tokens=16)
VICTIM_BYTES = b"the victim's own bytes, which nothing may overwrite\n"
NOBODY = 65534


def _rec(i: int, size: int = 20_000) -> BlockRecord:
    return BlockRecord(NS, i.to_bytes(16, "little"), None, size, size)


def _payload(i: int, size: int = 20_000) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, size=size, dtype=np.uint8)


def _private_dir(path) -> str:
    """A directory the daemon would accept (0700, ours): what a stale process could plant into."""
    os.makedirs(path, mode=0o700)
    os.chmod(path, 0o700)
    return str(path)


def _victim(tmp_path, name: str = "victim") -> str:
    path = str(tmp_path / name)
    with open(path, "wb") as f:
        f.write(VICTIM_BYTES)
    return path


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _mode(path: str) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _recover_within(tier: NvmeTier, fifo: str, seconds: float = 5.0) -> list[BlockRecord]:
    """Run ``recover()`` with a deadline: a recovery that blocks on the FIFO fails the test (the
    FIFO is then opened for writing so the stuck thread can finish)."""
    found: list = []
    t = threading.Thread(target=lambda: found.extend(tier.recover()), daemon=True)
    t.start()
    t.join(seconds)
    if t.is_alive():
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        pytest.fail(f"recover() blocked for {seconds}s on the FIFO {fifo}")
    return found


def _slab_files(directory: str) -> list[str]:
    return sorted(os.path.join(directory, n) for n in os.listdir(directory) if SLAB_NAME.fullmatch(n))


def _slab_name(footprint: int, tag: str = "0badf00d") -> str:
    """A name the tier would accept as one of its slabs (it picks its own at random)."""
    return f"slab-{footprint}-{tag}.kvs"


def _blocks(n: int, seed: int) -> tuple[list[bytes], list[np.ndarray]]:
    hashes = ChainHasher(seed=seed).chain(np.arange(16 * n), 16)
    rng = np.random.default_rng(seed)
    return hashes, [rng.integers(0, 256, LAYOUT.block_bytes, dtype=np.uint8) for _ in range(n)]


# -- permissions ----------------------------------------------------------------------------------

def test_tier_creates_its_directory_0700_and_block_files_0600(tmp_path):
    with _umask(0):  # even a process with no umask must not hand cached KV to other users
        tier = NvmeTier(str(tmp_path / "parent" / "nvme"), 8 << 20)
        r = _rec(1)
        tier.allocate(r)
        tier.write(r, _payload(1))
    assert _mode(tier.path) == 0o700
    assert _mode(tier.location(r.key)[0]) == 0o600


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o750, 0o1777])
def test_tier_refuses_a_loose_directory_that_is_not_empty(tmp_path, mode):
    d = tmp_path / "loose"
    d.mkdir()
    (d / "left-by-someone").write_bytes(b"x")
    os.chmod(d, mode)
    with pytest.raises(TierIOError) as e:
        NvmeTier(str(d), 8 << 20)
    msg = str(e.value)
    assert str(d) in msg and f"mode {mode:04o}" in msg and "chmod 700" in msg, msg
    assert ("may write" in msg) == bool(mode & 0o022), msg
    assert _mode(str(d)) == mode  # refused without touching it


@pytest.mark.parametrize("mode", [0o777, 0o755, 0o1777])
def test_tier_tightens_an_empty_loose_directory_it_owns(tmp_path, mode):
    """A fresh mount point (tmpfs is 1777) or an empty directory made by hand: nothing can have
    been planted or read yet, so the tier makes it 0700 and uses it."""
    d = tmp_path / "empty"
    d.mkdir()
    os.chmod(d, mode)
    tier = NvmeTier(str(d), 8 << 20)
    assert _mode(tier.path) == 0o700


def test_tier_refuses_a_directory_owned_by_another_user(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("chown to another uid needs root")
    d = tmp_path / "theirs"
    d.mkdir(mode=0o700)
    os.chown(d, NOBODY, NOBODY)
    with pytest.raises(TierIOError) as e:
        NvmeTier(str(d), 8 << 20)
    msg = str(e.value)
    assert str(d) in msg and f"uid {NOBODY}" in msg and "mode 0700" in msg, msg


# -- planted symlinks on the write path ------------------------------------------------------------

def test_tier_writes_never_follow_planted_symlinks(tmp_path):
    d = _private_dir(tmp_path / "nvme")
    victims = {name: _victim(tmp_path, f"victim-{i}") for i, name in
               enumerate([".write-probe", f".odirect-probe-{os.getpid()}"])}
    for name, victim in victims.items():
        os.symlink(victim, os.path.join(d, name))
    tier = NvmeTier(d, 8 << 20)
    r = _rec(7)
    fp = tier.footprint(r.stored_size)
    slab_victim = _victim(tmp_path, "victim-slab")
    os.symlink(slab_victim, os.path.join(d, _slab_name(fp)))  # planted after start: recovery cannot see it
    tier.allocate(r)
    tier.write(r, _payload(7))
    for victim in [*victims.values(), slab_victim]:
        assert _read(victim) == VICTIM_BYTES, victim
    out = np.empty(20_000, np.uint8)
    assert tier.read_into(r.key, out) == 20_000 and np.array_equal(out, _payload(7))
    path = tier.location(r.key)[0]
    assert not os.path.islink(path) and _mode(path) == 0o600


def test_daemon_planted_slab_and_probe_symlinks_do_not_redirect_writes(tmp_path):
    """Symlinks under the probe's name and under slab names the daemon could take, planted before
    it starts: recovery skips the slab-named ones, the daemon writes its own slab beside them."""
    d_path = _private_dir(tmp_path / "nvme")
    probe_victim = _victim(tmp_path, "probe-victim")
    os.symlink(probe_victim, os.path.join(d_path, ".write-probe"))
    fp = HEADER_BYTES + LAYOUT.block_bytes
    slab_victims = [_victim(tmp_path, f"slab-victim-{i}") for i in range(3)]
    for i, victim in enumerate(slab_victims):
        os.symlink(victim, os.path.join(d_path, _slab_name(fp, f"{i:08x}")))
    d = start_daemon(tmp_path / "daemon", "--write-through", nvme_path=d_path, timeout=60)
    try:
        hashes, blocks = _blocks(3, seed=3)
        with d.client(transport="grpc") as c:
            ns = c.register_namespace(Namespace(LAYOUT, cache_salt="planted-slab"))
            assert c.put(ns, hashes, blocks) == ["persisted"] * 3
            assert c.get(ns, hashes) == [b.tobytes() for b in blocks]
            assert c.stats()["tiers"]["nvme"]["recovery_skipped_not_regular"] == 3
        for victim in [probe_victim, *slab_victims]:
            assert _read(victim) == VICTIM_BYTES, victim
        slots = find_blocks(d_path)
        assert all(ns + h in slots for h in hashes)
        for path, _ in slots.values():
            assert stat.S_ISREG(os.lstat(path).st_mode) and _mode(path) == 0o600
    finally:
        d.stop()


# -- planted FIFOs and symlinks on the recovery path -----------------------------------------------

def test_tier_recovery_skips_and_counts_what_is_not_a_regular_file(tmp_path):
    elsewhere = NvmeTier(str(tmp_path / "elsewhere"), 8 << 20)
    r = _rec(5)
    elsewhere.allocate(r)
    elsewhere.write(r, _payload(5))
    target = elsewhere.location(r.key)[0]
    fp = elsewhere.footprint(r.stored_size)
    d = _private_dir(tmp_path / "nvme")
    fifo = os.path.join(d, _slab_name(fp, "00000001"))
    os.mkfifo(fifo)
    os.symlink(target, os.path.join(d, os.path.basename(target)))  # a valid slab's own name
    os.mkdir(os.path.join(d, _slab_name(fp, "00000002")))
    legacy_fifo = os.path.join(d, "ab" * 24 + ".kvb")                 # the older layout's block name
    os.mkfifo(legacy_fifo)
    records_fifo = os.path.join(d, _slab_name(fp, "00000003")[:-4] + ".kvi")   # a record file without its slab
    os.mkfifo(records_fifo)
    real = os.path.join(d, _slab_name(fp, "00000004"))   # a real slab whose record file is a FIFO
    shutil.copyfile(target, real)
    os.mkfifo(real[:-4] + ".kvi")
    tier = NvmeTier(d, 8 << 20)
    assert _recover_within(tier, fifo) == []
    assert tier.stats()["recovery_skipped_not_regular"] == 6
    assert stat.S_ISFIFO(os.lstat(records_fifo).st_mode) and os.path.exists(real)   # left in place
    assert tier.corrupt_dropped == 0 and tier.used_bytes == 0
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stat.S_ISFIFO(os.lstat(legacy_fifo).st_mode)  # never ours
    assert _read(target)[:8] == b"KVSBLK02"        # the link's target is untouched
    tier.allocate(r)                                 # and the tier still works, in a slab of its own
    tier.write(r, _payload(5))
    assert os.path.dirname(tier.location(r.key)[0]) == d and not os.path.islink(tier.location(r.key)[0])


def test_daemon_starts_past_a_planted_fifo_and_counts_it(tmp_path):
    d_path = _private_dir(tmp_path / "nvme")
    fifo = os.path.join(d_path, _slab_name(HEADER_BYTES + LAYOUT.block_bytes))
    os.mkfifo(fifo)
    t0 = time.monotonic()
    try:
        d = start_daemon(tmp_path / "daemon", "--write-through", nvme_path=d_path, timeout=20)
    finally:  # a recovery that opened it would block in open(); let a stuck daemon go
        with contextlib.suppress(OSError):
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    try:
        assert time.monotonic() - t0 < 20
        hashes, blocks = _blocks(2, seed=5)
        with d.client(transport="grpc") as c:
            assert c.stats()["tiers"]["nvme"]["recovery_skipped_not_regular"] == 1
            ns = c.register_namespace(Namespace(LAYOUT, cache_salt="planted-fifo"))
            assert c.put(ns, hashes, blocks) == ["persisted"] * 2   # blocks of the planted name's size too
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
    finally:
        d.stop()


def test_daemon_does_not_follow_a_symlink_named_like_a_slab(tmp_path):
    """A symlink named exactly as a valid slab file, pointing at a real slab of another daemon's
    directory: not followed, not indexed, not served, counted."""
    hashes, blocks = _blocks(1, seed=4)
    a = start_daemon(tmp_path / "a", "--write-through", timeout=60)
    try:
        with a.client(transport="grpc") as c:
            ns = c.register_namespace(Namespace(LAYOUT, cache_salt="planted-link"))
            assert c.put(ns, hashes, blocks) == ["persisted"]
    finally:
        a.stop()
    (target,) = _slab_files(a.nvme_path)
    before = _read(target)
    d_path = _private_dir(tmp_path / "nvme")
    os.symlink(target, os.path.join(d_path, os.path.basename(target)))
    b = start_daemon(tmp_path / "b", nvme_path=d_path, timeout=60)
    try:
        with b.client(transport="grpc") as c:
            assert c.register_namespace(Namespace(LAYOUT, cache_salt="planted-link")) == ns
            assert c.lookup(ns, hashes, lease=False).num_hit == 0
            assert c.get(ns, hashes) == [None]
            stats = c.stats()
        assert stats["tiers"]["nvme"]["recovery_skipped_not_regular"] == 1
        assert stats["tiers"]["nvme"]["blocks"] == 0
        assert _read(target) == before
    finally:
        b.stop()


# -- a real daemon refuses a loose or foreign directory --------------------------------------------

@pytest.mark.parametrize("case", ["mode-0777", "owned-by-nobody"])
def test_daemon_refuses_a_loose_or_foreign_directory_naming_path_and_mode(tmp_path, case):
    d_path = tmp_path / "nvme"
    d_path.mkdir()
    (d_path / "namespaces.json").write_text("[]")  # a directory in use, not a fresh one
    if case == "mode-0777":
        os.chmod(d_path, 0o777)
        want = "mode 0777"
    else:
        if os.geteuid() != 0:
            pytest.skip("chown to another uid needs root")
        os.chmod(d_path, 0o700)
        os.chown(d_path, NOBODY, NOBODY)
        want = f"uid {NOBODY}"
    with pytest.raises(RuntimeError) as e:
        start_daemon(tmp_path / "daemon", nvme_path=str(d_path), timeout=60).stop()
    msg = str(e.value)
    assert "cannot start" in msg and "nvme tier" in msg and str(d_path) in msg and want in msg, msg


@pytest.mark.parametrize("plant", ["directory", "fifo", "symlink"])
def test_a_slab_file_replaced_while_serving_changes_nothing_served(tmp_path, plant):
    """A directory, FIFO or symlink put under a slab's name while the store runs: the tier reads
    the slab it opened, never the name again, so every block is served exactly, with no hang, no
    error and no block left pinned. A restart then skips the planted thing and counts it."""
    from kvstore.store import Store, StoreConfig

    d = _private_dir(tmp_path / "nvme")
    tier = NvmeTier(d, 64 << 20)
    store = Store([tier], StoreConfig())
    ns = store.register_namespace(Namespace(LAYOUT))
    hashes = ChainHasher().chain(np.arange(6 * 16), 16)
    blocks = [_payload(i, LAYOUT.block_bytes) for i in range(6)]
    store.put(ns, hashes, blocks)
    (path,) = _slab_files(d)
    os.unlink(path)
    {"directory": lambda: os.mkdir(path), "fifo": lambda: os.mkfifo(path),
     "symlink": lambda: os.symlink(_victim(tmp_path), path)}[plant]()
    got: list = []
    reader = threading.Thread(target=lambda: got.append(store.get(ns, hashes)), daemon=True)
    reader.start()
    reader.join(20)
    assert not reader.is_alive(), "the read hung on the planted file"
    assert got and got[0] == [b.tobytes() for b in blocks]
    assert tier.corrupt_dropped == 0
    assert all(s.pins == 0 for s in store.block_states())
    store.close()
    again = NvmeTier(d, 64 << 20)
    assert _recover_within(again, path) == []
    assert again.stats()["recovery_skipped_not_regular"] == 1
