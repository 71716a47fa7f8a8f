"""The same-host lookup index: a read-only hash table of the blocks a daemon serves, mapped by its
clients, so a scheduler's "how much of this chain is cached?" costs no round trip at all.

Over the Unix socket (``local_lookup``) a lookup is a round trip to a Python thread that competes
for the daemon's GIL with every transfer: a few hundred microseconds idle, over a millisecond under
load. Here the daemon keeps, per tenant, a table of ``(namespace, block) -> fastest tier`` in a
sealed ``memfd`` (``F_SEAL_FUTURE_WRITE``: only the daemon's own mapping can write it; a client gets
the descriptor and can map it read-only, nothing more) and a client probes it with a few numpy
operations. Answers are advisory: a stale or forged hit only makes a later get miss, which the
caller already treats as "recompute"; bytes are never taken from here.

Layout (native-endian ``u64`` words): a 4 KiB header — magic, a sequence counter (odd while the
daemon writes: readers retry, a seqlock), the slot count (a power of two), flags (``INCOMPLETE``:
some served block is not in the table, so a miss here proves nothing and readers ask the daemon;
``CLOSED``: the daemon stopped keeping it; ``LOADING``: not yet filled with what the daemon
already held), the probe bound, a heartbeat (``CLOCK_MONOTONIC`` ns, host-wide: a daemon that
hangs or dies without closing stops stamping it, and a table silent for ``STALE_NS`` is not
trusted), then tier names — and then
``slots x (key_lo, key_hi, meta)``. The key is the block hash's first 16 bytes XOR the 16-byte
namespace id (chain hashes are uniform, so the low word places the slot); ``meta`` is 0 for an
empty slot, else 1 + the fastest tier's index. Linear probing, at most ``MAX_PROBE`` slots from
home, deletion by backward shift (no tombstones), so a probe ends at the first empty slot.

The seqlock relies on x86-64's ordering of stores (TSO); the daemon offers the index only there.
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import platform
import time
from collections.abc import Sequence

import numpy as np

from kvstore.keys import MAX_HASH_BYTES

MAGIC = 0x4B564C4958000001          # "KVLIX", version 1
HEADER_BYTES = 4096
SLOT_WORDS = 3
MAX_PROBE = 32
MAX_TIERS = 16
TIER_NAME_BYTES = 32
MIN_HASH_BYTES = 16                 # hashes narrower than a key cannot be told apart here
INCOMPLETE, CLOSED, LOADING = 1, 2, 4
_MAGIC, _SEQ, _SLOTS, _FLAGS, _LIVE, _PROBE, _BEAT = range(7)
BEAT_S = 0.1                        # the daemon stamps the table this often ...
STALE_NS = 1_000_000_000            # ... and readers stop trusting a table not stamped for this long
_NAMES_AT = 512
_F_SEAL_FUTURE_WRITE = 0x0010       # Linux 5.1; not in Python's fcntl module yet
_RETRIES = 16
#: ``put_many`` writes an array of at least this many keys in one numpy pass: the pass has a fixed
#: cost, so a shorter batch goes faster one key at a time
VECTOR_KEYS = 64


def _slot_of(words, mask: int, lo: int, hi: int) -> int | None:
    """The slot holding key ``(lo, hi)`` in a table's words, or None: a probe ends at the first
    empty slot, and nothing is placed farther than ``MAX_PROBE`` slots from home."""
    i, base = lo & mask, HEADER_BYTES // 8
    for _ in range(MAX_PROBE):
        at = base + i * SLOT_WORDS
        if words[at + 2] == 0:
            return None
        if words[at] == lo and words[at + 1] == hi:
            return i
        i = (i + 1) & mask
    return None


def supported() -> bool:
    """Whether this host's memory ordering lets readers trust the seqlock (x86-64 only)."""
    return platform.machine().lower() in ("x86_64", "amd64")


def key_of(namespace_id: bytes, block_hash: bytes) -> tuple[int, int]:
    lo = int.from_bytes(block_hash[:8], "little") ^ int.from_bytes(namespace_id[:8], "little")
    hi = int.from_bytes(block_hash[8:16], "little") ^ int.from_bytes(namespace_id[8:16], "little")
    return lo, hi


def keys_of(namespace_id: bytes, hashes: Sequence[bytes]):
    """``key_of`` of each hash wide enough to have a key (a narrower one has none): an ``(n, 2)``
    uint64 array made in one numpy pass where the hashes allow (``_keys``), else ``(lo, hi)`` pairs."""
    words = _keys(namespace_id, hashes) if hashes else None
    if words is not None:
        return words
    return [key_of(namespace_id, h) for h in hashes if len(h) >= MIN_HASH_BYTES]


def _keys(namespace_id: bytes, hashes: Sequence[bytes]) -> np.ndarray | None:
    """Each hash's key as a ``(n, 2)`` array of words, or None when a hash is too narrow to key or
    wider than the daemon takes (it is then refused by name), or the namespace id is not 16 bytes.
    Hashes of one width that is a multiple of 8 (xxh128, sha256) are viewed in place."""
    if len(namespace_id) != 16:
        return None
    widths = set(map(len, hashes))
    if min(widths) < MIN_HASH_BYTES or max(widths) > MAX_HASH_BYTES:
        return None
    if len(widths) == 1 and not (width := widths.pop()) % 8:
        words = np.frombuffer(b"".join(hashes), dtype=np.uint64).reshape(-1, width // 8)[:, :2]
    else:
        words = np.frombuffer(b"".join([h[:16] for h in hashes]), dtype=np.uint64).reshape(-1, 2)
    return words ^ np.frombuffer(namespace_id, dtype=np.uint64)


class IndexTable:
    """Daemon side: one tenant's table. Callers serialise writes (the store lock, or this table's
    users' own lock); readers never block it."""

    def __init__(self, slots: int, tier_names: Sequence[str]) -> None:
        if slots < 8 or slots & (slots - 1):
            raise ValueError(f"lookup index slots must be a power of two >= 8, got {slots}")
        if len(tier_names) > MAX_TIERS:
            raise ValueError(f"at most {MAX_TIERS} tiers")
        self.slots, self.mask = slots, slots - 1
        self.nbytes = HEADER_BYTES + slots * SLOT_WORDS * 8
        self.fd = os.memfd_create("kvstore-lookup-index", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(self.fd, self.nbytes)
            self._map = mmap.mmap(self.fd, self.nbytes)
            fcntl.fcntl(self.fd, fcntl.F_ADD_SEALS,
                        fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | _F_SEAL_FUTURE_WRITE | fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(self.fd)
            raise
        self._w = memoryview(self._map).cast("Q")          # word access, cheaper than numpy scalars
        self._rows = np.frombuffer(self._map, dtype=np.uint64, offset=HEADER_BYTES).reshape(slots, SLOT_WORDS)
        for i, name in enumerate(tier_names):
            raw = name.encode()[:TIER_NAME_BYTES]
            at = _NAMES_AT + i * TIER_NAME_BYTES
            self._map[at:at + len(raw)] = raw
        self._w[_SLOTS], self._w[_PROBE], self._w[_MAGIC] = slots, MAX_PROBE, MAGIC
        self.beat()
        self._overflow: dict[tuple[int, int], int] = {}    # served blocks that found no slot
        self.live = 0

    @property
    def complete(self) -> bool:
        """Every block put here has a slot (else readers ask the daemon, see ``INCOMPLETE``)."""
        return not self._overflow

    def descriptor(self) -> int:
        """A new descriptor of the table for one client (the caller closes it after sending)."""
        return os.dup(self.fd)

    # -- writes ----------------------------------------------------------------------------------

    def put(self, key: tuple[int, int], tier: int) -> None:
        """Record (or move) a served block."""
        self.put_many([key], tier)

    def put_many(self, keys, tier: int) -> None:
        """Record (or move) served blocks, all now fastest in ``tier``: ``keys`` are ``(lo, hi)``
        pairs, or an ``(n, 2)`` uint64 array of them (``keys_of``). The keys of an array of at
        least ``VECTOR_KEYS`` whose home slot is empty, or holds them already, are written in one
        numpy pass (one round of the sequence counter); the others, and every key of a shorter
        batch or a list, one write per round, so a reader never spins out a whole batch of probes."""
        if isinstance(keys, np.ndarray):
            keys = self._put_at_home(keys, tier + 1) if len(keys) >= VECTOR_KEYS else keys.tolist()
        w, base, mask, meta_now = self._w, HEADER_BYTES // 8, self.mask, tier + 1
        for lo, hi in keys:
            i = lo & mask
            for _ in range(MAX_PROBE):
                at = base + i * SLOT_WORDS
                meta = w[at + 2]
                if meta == 0:
                    w[_SEQ] += 1   # odd: readers retry
                    w[at], w[at + 1], w[at + 2] = lo, hi, meta_now
                    self.live += 1
                    w[_LIVE] = self.live
                    w[_SEQ] += 1
                    if self._overflow:
                        self._unlist((lo, hi))
                    break
                if w[at] == lo and w[at + 1] == hi:
                    if meta != meta_now:
                        w[_SEQ] += 1
                        w[at + 2] = meta_now
                        w[_SEQ] += 1
                    break
                i = (i + 1) & mask
            else:
                self._overflow[(lo, hi)] = tier
                self.set_flag(INCOMPLETE, True)

    def _put_at_home(self, keys: np.ndarray, meta_now: int) -> list:
        """Write the keys of ``keys`` (``(n, 2)`` uint64) that go in their home slot: it is empty
        (the first key of the batch homed there) or holds the key already. Returns the others as
        ``(lo, hi)`` pairs, in order, for the probing loop. With blocks that found no slot listed
        (``INCOMPLETE``) every key takes the loop, which takes them off that list."""
        if self._overflow or not len(keys):
            return keys.tolist()
        rows = self._rows
        homes = keys[:, 0] & np.uint64(self.mask)
        found = rows[homes]
        empty = found[:, 2] == 0
        same = ~empty & (found[:, 0] == keys[:, 0]) & (found[:, 1] == keys[:, 1])
        order = homes.argsort(kind="stable")   # one key per home slot in this pass: the first
        ranked = homes[order]
        leads = np.empty(len(keys), dtype=bool)
        leads[0] = True
        np.not_equal(ranked[1:], ranked[:-1], out=leads[1:])
        first = np.empty(len(keys), dtype=bool)
        first[order] = leads
        new = empty & first
        moved = same & (found[:, 2] != meta_now)
        if new.any() or moved.any():
            self._begin()
            rows[homes[new], :2] = keys[new]
            rows[homes[new | moved], 2] = meta_now
            self.live += int(new.sum())
            self._w[_LIVE] = self.live
            self._end()
        return keys[~(new | same)].tolist()

    def _unlist(self, key: tuple[int, int]) -> None:
        """``key`` has a slot or is gone: out of the overflow (INCOMPLETE cleared with the last)."""
        if self._overflow and self._overflow.pop(key, None) is not None and not self._overflow:
            self.set_flag(INCOMPLETE, False)

    def remove(self, key: tuple[int, int]) -> None:
        """Forget a block that is no longer served (absent: nothing to do)."""
        slot = _slot_of(self._w, self.mask, *key)
        if slot is None:
            self._unlist(key)
            return
        self._begin()
        self._shift_back(slot)
        self.live -= 1
        self._w[_LIVE] = self.live
        self._end()
        self._refill()

    def _shift_back(self, hole: int) -> None:
        """Empty slot ``hole`` and pull later entries of its run back, so probes still end at the
        first empty slot (every entry moves closer to its home, never past it)."""
        w, base, mask = self._w, HEADER_BYTES // 8, self.mask
        j = hole
        while True:
            j = (j + 1) & mask
            at = base + j * SLOT_WORDS
            if w[at + 2] == 0:
                break
            home = w[at] & mask
            if (j - home) & mask >= (j - hole) & mask:   # home at or before the hole: may move there
                dst = base + hole * SLOT_WORDS
                w[dst], w[dst + 1], w[dst + 2] = w[at], w[at + 1], w[at + 2]
                hole = j
        dst = base + hole * SLOT_WORDS
        w[dst + 2] = 0
        w[dst] = w[dst + 1] = 0

    def _refill(self) -> None:
        """A slot freed up: give it to a block that found none, if any."""
        if not self._overflow:
            return
        key, tier = next(iter(self._overflow.items()))
        self.put(key, tier)   # placed: leaves the overflow (and clears INCOMPLETE with the last)

    def beat(self) -> None:
        """Stamp the table as kept up to date now (one word: readers need no seqlock for it)."""
        self._w[_BEAT] = time.monotonic_ns()

    def set_flag(self, flag: int, on: bool) -> None:
        self._begin()
        self._w[_FLAGS] = (self._w[_FLAGS] | flag) if on else (self._w[_FLAGS] & ~flag)
        self._end()

    def _begin(self) -> None:
        self._w[_SEQ] += 1      # odd: readers retry

    def _end(self) -> None:
        self._w[_SEQ] += 1

    def close(self) -> None:
        """Tell readers the table is no longer kept (they ask the daemon), then let it go."""
        self.set_flag(CLOSED, True)
        self._rows = None
        self._w.release()
        with contextlib.suppress(BufferError):   # a view is still alive somewhere: the mapping goes with it
            self._map.close()
        os.close(self.fd)


class IndexReader:
    """Client side: a table mapped read-only. ``leading_hits`` answers or returns None, and the
    caller asks the daemon instead."""

    def __init__(self, fd: int) -> None:
        size = os.fstat(fd).st_size
        if size < HEADER_BYTES:
            raise OSError("lookup index is smaller than its header")
        self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        words = np.frombuffer(self._map, dtype=np.uint64)
        head = words[:HEADER_BYTES // 8]
        slots = int(head[_SLOTS])
        if int(head[_MAGIC]) != MAGIC or slots & (slots - 1) or HEADER_BYTES + slots * SLOT_WORDS * 8 > size:
            raise OSError("not a lookup index this client understands")
        self._mask = np.uint64(slots - 1)
        self._slots = words[HEADER_BYTES // 8:HEADER_BYTES // 8 + slots * SLOT_WORDS].reshape(slots, SLOT_WORDS)
        self._words = memoryview(self._map).cast("Q")   # scalar reads as Python ints, for the probe's tail
        raw = bytes(self._map[_NAMES_AT:_NAMES_AT + MAX_TIERS * TIER_NAME_BYTES])
        # a present slot's meta is 1 + its fastest tier's index
        self._tier_of_meta = [""] + [raw[i * TIER_NAME_BYTES:(i + 1) * TIER_NAME_BYTES].rstrip(b"\0")
                                     .decode("utf-8", "replace") for i in range(MAX_TIERS)]

    def leading_hits(self, namespace_id: bytes, hashes: Sequence[bytes]) -> tuple[int, list[str]] | None:
        """``(leading blocks served, their fastest tiers)``, or None when the table cannot say
        (it is incomplete, closed or stale, a write kept racing, or a hash is too narrow to key)."""
        if not hashes:
            return 0, []
        keys = _keys(namespace_id, hashes)
        if keys is None:
            return None
        lo, hi = keys[:, 0], keys[:, 1]
        head = self._words   # header words as Python ints (a numpy scalar read costs several times more)
        for _ in range(_RETRIES):
            seq = head[_SEQ]
            if seq & 1:
                continue
            if head[_FLAGS] or time.monotonic_ns() - head[_BEAT] > STALE_NS:
                return None
            n, meta = self._leading(lo, hi)
            if head[_SEQ] == seq:
                break
        else:
            return None
        return n, list(map(self._tier_of_meta.__getitem__, meta[:n].tolist()))

    def _leading(self, lo: np.ndarray, hi: np.ndarray) -> tuple[int, np.ndarray]:
        """How many leading keys are present, and each one's meta. Why two steps: a scheduler's
        lookup pays per numpy call, not per key, so every key's home slot is read in one gather
        (a table a few percent full holds nearly every key there), and only a key found elsewhere
        is probed on, one slot at a time, in plain Python."""
        got = self._slots[lo & self._mask]
        meta = got[:, 2]
        home = (got[:, 0] == lo) & (got[:, 1] == hi) & (meta != 0)
        if home.all():
            return len(lo), meta
        for k in range(int(home.argmin()), len(lo)):
            if not home[k]:
                slot = _slot_of(self._words, int(self._mask), int(lo[k]), int(hi[k]))
                if slot is None:
                    return k, meta
                meta[k] = self._words[HEADER_BYTES // 8 + slot * SLOT_WORDS + 2]
        return len(lo), meta

    def close(self) -> None:
        self._slots = None
        self._words.release()
        with contextlib.suppress(BufferError):
            self._map.close()
