"""CPU tier: one pre-allocated shared-memory arena carved into fixed slots.

The arena is a file in ``shm_dir`` (``/dev/shm`` by default) mapped once, so a same-host client
can map the same file and copy blocks in and out without the bytes crossing a socket (see
``kvstore.transport.shm``; the Store describes the segment through ``Store.shared_arena``). Pages
are touched once at start-up: first touch of fresh memory runs at about 1.5 GB/s here, a touched
page at memcpy speed. With a GPU tier configured (and a CUDA device present) the daemon also page-locks *its own* mapping
(``cudaHostRegister``), so the daemon's copies between this arena and a GPU tier can run as DMA;
the registration is per process, so a client that maps the segment gets ordinary pageable memory
(tenant segments, below, are not registered: the daemon's copies to a GPU tier from them are pageable).
Segments left by dead daemons are swept at start-up (``sweep_stale_segments``).

Tenant segments (``segment_bytes``, the daemon's choice when authentication is on): the arena is
then no file at all but one sealed ``memfd`` per segment, each holding one tenant's blocks only
(``SlotTable`` owned segments). Nothing can open them by path; the daemon hands a tenant's
client the descriptors of that tenant's segments after checking its ticket
(``kvstore.transport.segments``). Seals forbid shrinking or growing them, so a client
holding one cannot make the daemon's own mapping fault. A segment that passes to another tenant
gets fresh memory first (``renew``): a mapping taken earlier keeps only the old memory, whose pages
the daemon releases then (a client that touches them again gets zeros, in pages of its own making).

What a tenant's clients can hold is bounded: every segment handed to them, current or replaced
(``replaced_segments``: until its last descriptor and mapping are gone), counts at its full size,
and a request that would take them past ``held_limit`` bytes is refused (``QuotaExceeded``
naming ``max_held_segment_bytes_per_tenant``).
"""

from __future__ import annotations

import contextlib
import fcntl
import mmap
import os
import re
import secrets
import sys
from collections.abc import Callable

import numpy as np

from kvstore import dead_owners
from kvstore.buffers import BYTE_DTYPE, Extent, as_bytes, gather, scatter
from kvstore.errors import QuotaExceeded, TierIOError
from kvstore.tiers.base import BlockRecord, Tier
from kvstore.tiers.replaced_segments import Replaced, ReplacedSegments
from kvstore.tiers.slots import SlotTable


#: the arena's copies of one slot of at most this many bytes run through memoryviews (a plain
#: memcpy, the GIL held); larger ones through numpy's copyto, which releases the GIL around the
#: copy so that other threads run meanwhile, but copies a byte range slower and costs more per
#: call: small blocks are bound by those costs, large ones should not hold the GIL for the whole
#: copy. (A same-host client's copies stay numpy's at every size: its other threads wait on the
#: lease socket while it copies a put window.)
HELD_COPY_BYTES = 256 << 10


class CpuTier(Tier):
    name = "cpu"
    durable = False
    in_memory = True

    def __init__(self, capacity_bytes: int, slot_bytes: int = 256 * 1024, shm_dir: str = "/dev/shm",
                 pretouch: bool = True, segment_name: str | None = None, segment_bytes: int | None = None,
                 page_lock: bool = True, held_limit: int | None = None,
                 on_filled: Callable[[int, int], None] | None = None) -> None:
        """``page_lock``: page-lock the arena when a CUDA device is present (the daemon asks for it
        only with a GPU tier: without one, the registration would create a CUDA context for nothing).
        ``held_limit``: the segment bytes one tenant's clients may hold (None: the arena's size).
        ``on_filled``: told the bytes of arena allocated (and touched) so far and the arena's size,
        a chunk at a time (seconds for a large arena: the daemon shows it as progress)."""
        self.slots = SlotTable(capacity_bytes, slot_bytes, self.name, segment_bytes=segment_bytes,
                               on_reassign=self._renew_segment)
        super().__init__(self.slots.capacity_bytes)
        self.stale_segments_removed = sweep_stale_segments(shm_dir)
        self._owner_of: Callable[[bytes], str | None] = lambda _namespace_id: None
        self.page_locked = False   # this process's mapping is page-locked (cudaHostRegister)
        #: the arena as a memoryview, for copies of one slot of at most ``HELD_COPY_BYTES``
        #: (None for tenant segments: those copy through numpy)
        self._bytes: memoryview | None = None
        if segment_bytes is not None:
            self.segment_path = None
            self.arena = SegmentedArena(self.slots.num_segments, self.slots.segment_bytes,
                                        max(self.capacity_bytes, mmap.PAGESIZE), pretouch, on_filled)
            self.held_limit = self.arena.nbytes if held_limit is None else held_limit
            self._handed: list[str | None] = [None] * self.slots.num_segments   # whose clients got its memory
            self.replaced = ReplacedSegments()
            return
        self.segment_name = segment_name or f"kvstore-{os.getpid()}-{secrets.token_hex(4)}"
        self.segment_path = os.path.join(shm_dir, self.segment_name)
        size = max(self.capacity_bytes, mmap.PAGESIZE)
        try:
            fd = os.open(self.segment_path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise TierIOError(f"cpu tier: cannot create shared segment {self.segment_path}: {e.strerror}") from e
        try:
            os.ftruncate(fd, size)
            self._mmap = mmap.mmap(fd, size)
            self.arena = np.frombuffer(self._mmap, dtype=np.uint8)
            fill(fd, self.arena, pretouch, on_filled)
        except OSError as e:
            os.close(fd)
            os.unlink(self.segment_path)
            raise TierIOError(f"cpu tier: {self.segment_path} cannot hold {size} bytes ({e.strerror}); "
                              "lower cpu_bytes or point shm_dir at a larger tmpfs") from e
        os.close(fd)
        self._bytes = memoryview(self.arena)
        self.page_locked = page_lock and _register_with_cuda(self.arena)

    @property
    def segmented(self) -> bool:
        """Tenant segments (see the module docstring) rather than one shared file."""
        return self.slots.owned

    @property
    def segment_bytes(self) -> int:
        """Bytes of one tenant segment (0: no segments)."""
        return self.slots.segment_bytes if self.segmented else 0

    def segments_of(self, keys) -> set[int]:
        """The tenant segments holding any of the blocks ``keys`` (those held here)."""
        return self.slots.segments_of(keys) if self.segmented else set()

    def assign_owners(self, owner_of: Callable[[bytes], str | None]) -> None:
        """Tell the tier whose a namespace's blocks are (the Store: its tenant)."""
        self._owner_of = owner_of

    def free_bytes_for(self, namespace_id: bytes) -> int:
        return self.slots.free_bytes_for(self._owner_of(namespace_id) if self.segmented else None)

    def segment_descriptor(self, s: int, owner: str) -> tuple[int, int] | None:
        """A new descriptor of segment ``s`` (the caller closes it) and its generation, only if
        the segment holds ``owner``'s blocks now; None otherwise. Raises ``QuotaExceeded`` when
        handing it would let ``owner``'s clients hold more than ``held_limit`` bytes of segments."""
        def dup() -> tuple[int, int]:
            if self._handed[s] != owner:
                held = self.held_bytes(owner) + self.arena.size_of(s)
                if held > self.held_limit:
                    raise QuotaExceeded(
                        f"max_held_segment_bytes_per_tenant: tenant {owner!r}'s clients would hold {held} bytes of "
                        f"CPU segments, over its limit of {self.held_limit} (replaced segments count until their "
                        "clients unmap them)")
                self._handed[s] = owner
            return os.dup(self.arena.descriptor(s)), self.slots.generations[s]
        return self.slots.if_owned_by(s, owner, dup)  # type: ignore[return-value]

    def held_bytes(self, owner: str) -> int:
        """Segment bytes ``owner``'s clients may hold: current segments handed to them, and
        replaced ones still mapped or open somewhere."""
        current = sum(self.arena.size_of(s) for s, who in enumerate(self._handed) if who == owner)
        return current + sum(r.nbytes for r in self.replaced.held_by(owner))

    def replaced_for(self, owner: str) -> list[tuple[int, int]]:
        """``(segment, generation)`` of each replaced segment ``owner``'s clients still hold."""
        return [(r.segment, r.generation) for r in self.replaced.held_by(owner)] if self.segmented else []

    def generation_at(self, offset: int) -> int:
        return self.slots.generations[self.slots.segment_of(offset)] if self.segmented else 0

    def _renew_segment(self, s: int) -> None:
        """Segment ``s`` passes to another owner (``SlotTable``, under its lock; ``generations[s]``
        is still the old one): fresh memory, and the old one counted while the clients it was
        handed to hold it."""
        old = self.arena.renew(s)
        try:
            if self._handed[s] is not None:
                self.replaced.add(old, Replaced(self._handed[s], s, self.slots.generations[s], self.arena.size_of(s)))
        finally:
            os.close(old)
        self._handed[s] = None

    def footprint(self, nbytes: int) -> int:
        return self.slots.footprint(nbytes)

    def keep_slots_in(self, holders) -> None:
        """Keep each block's slot in its holder in ``holders`` (``SlotTable.keep_slots_in``)."""
        self.slots.keep_slots_in(holders)

    def let_go(self, key: bytes, holder) -> None:
        """``holder`` leaves the mapping ``keep_slots_in`` gave (``SlotTable.let_go``)."""
        self.slots.let_go(key, holder)

    def allocate(self, record: BlockRecord) -> None:
        owner = self._owner_of(record.namespace_id) if self.segmented else None
        self.slots.allocate(record.key, record.stored_size, owner)
        self.used_bytes += self.slots.footprint(record.stored_size)

    def allocate_run(self, records: list[BlockRecord]) -> int:
        """One slice of the free list for a run of one-slot blocks (``SlotTable.allocate_run``);
        any other run block by block."""
        if not records:
            return 0
        size = records[0].stored_size
        if not self.slots.takes_runs(size) or any(r.stored_size != size for r in records):
            return super().allocate_run(records)
        done = self.slots.allocate_run([r.key for r in records], size)
        self.used_bytes += done * self.slots.footprint(size)
        return done

    def allocate_keys(self, keys: list[bytes], nbytes: int) -> int:
        """One slice of the free list where the blocks take one slot each (``SlotTable.allocate_run``)."""
        if not keys:
            return 0
        if not self.slots.takes_runs(nbytes):
            return super().allocate_keys(keys, nbytes)
        done = self.slots.allocate_run(keys, nbytes)
        self.used_bytes += done * self.slots.footprint(nbytes)
        return done

    def write_key(self, key: bytes, data) -> None:
        if type(data) is not np.ndarray or data.dtype is not BYTE_DTYPE or data.ndim != 1:
            data = as_bytes(data)
        at = self.slots.span(key)
        if at is not None:   # most blocks: one slot, one copy
            off, n = at
            if n <= HELD_COPY_BYTES and self._bytes is not None:
                self._bytes[off:off + n] = data if data.nbytes == n else data[:n]
            else:
                np.copyto(self.arena[off:off + n], data if data.nbytes == n else data[:n])
        else:
            scatter(self.arena, self.slots.lookup(key)[0], data)

    def write_keys(self, keys, datas) -> tuple[int, Exception | None]:
        """``write_key`` for each key in order, in one loop: a block in one slot (most), given
        as exactly its bytes (a flat byte array), is one copy."""
        held = self._bytes
        limit = HELD_COPY_BYTES if held is not None else -1
        for k, (key, data, at) in enumerate(zip(keys, datas, self.slots.spans(keys))):
            try:
                if type(at) is tuple and at[1] <= limit:
                    off, n = at
                    try:
                        held[off:off + n] = data
                        continue
                    except (TypeError, ValueError):   # not ``n`` flat bytes: ``write_key`` takes it
                        pass
                self.write_key(key, data)
            except Exception as e:  # noqa: BLE001 - handed to the caller (``Tier.write_keys``)
                return k, e
        return len(keys), None

    def write_unsynced(self, record: BlockRecord, data, durable: bool = True) -> None:
        """``write``: nothing to sync in memory."""
        self.write_key(record.key, data)

    write = write_unsynced

    def read_into(self, key: bytes, out) -> int:
        extents, nbytes = self.slots.lookup(key)
        out = as_bytes(out)
        if len(extents) == 1:
            off = extents[0][0]
            if nbytes <= HELD_COPY_BYTES and self._bytes is not None:
                memoryview(out)[:nbytes] = self._bytes[off:off + nbytes]
            else:
                np.copyto(out[:nbytes], self.arena[off:off + nbytes])
        else:
            gather(self.arena, extents, out)
        return nbytes

    def read_many_into(self, keys, outs) -> list:
        """``read_into`` for each key, in one loop: a block in one slot (most), read into a flat
        byte array, is one copy."""
        got: list = []
        arena, held = self.arena, self._bytes
        limit = HELD_COPY_BYTES if held is not None else -1
        for key, out, at in zip(keys, outs, self.slots.spans(keys)):
            if type(at) is not tuple:   # several extents, or not held (its KeyError)
                got.append(at if at is not None else self.read_into(key, out))
                continue
            off, n = at
            if n <= limit:
                try:
                    memoryview(out)[:n] = held[off:off + n]
                    got.append(n)
                    continue
                except (TypeError, ValueError):   # not a flat byte array: through its byte view
                    pass
            out = as_bytes(out)
            np.copyto(out if out.nbytes == n else out[:n], arena[off:off + n])
            got.append(n)
        return got

    def view(self, key: bytes) -> list[np.ndarray]:
        """Zero-copy views of a block's pieces (valid while the block is pinned)."""
        return [self.arena[off:off + length] for off, length in self.slots.lookup(key)[0]]

    def extents(self, key: bytes) -> list[Extent]:
        return self.slots.lookup(key)[0]

    def extents_many(self, keys) -> list[list[Extent]]:
        """``extents`` of each key, in one loop (a lease's blocks)."""
        return [[at] if type(at) is tuple else self.extents(key) for key, at in zip(keys, self.slots.spans(keys))]

    def drop(self, key: bytes) -> None:
        self.used_bytes -= self.slots.release(key)

    def drop_many(self, keys) -> None:
        self.used_bytes -= self.slots.release_many(keys)

    def close(self) -> None:
        if self.segment_path is None:
            self.arena.close()
            self.replaced.close()
        else:
            try:
                os.unlink(self.segment_path)
            except FileNotFoundError:
                pass
        self.arena = self._bytes = None  # the mmap closes once no view of it is left

    def stats(self) -> dict[str, int]:
        out = {**super().stats(), "blocks": len(self.slots), "slot_bytes": self.slots.slot_bytes,
               "payload_bytes": self.slots.payload_bytes, "slack_bytes": self.used_bytes - self.slots.payload_bytes}
        if self.segmented:
            out["segments"] = self.slots.num_segments
            out["segment_bytes"] = self.slots.segment_bytes
            out.update(self.replaced.stats())
        return out


#: the arena is allocated and touched this much at a time (a progress step: ~0.05 s here)
FILL_CHUNK_BYTES = 64 * 1024 * 1024


def fill(fd: int, array: np.ndarray, pretouch: bool, on_filled: Callable[[int, int], None] | None) -> None:
    """Allocate the memory behind ``fd`` (mapped as ``array``) and touch its pages, a chunk at a
    time: allocated now, a full tmpfs fails here (OSError), not with SIGBUS on a later copy."""
    size = array.nbytes
    for start in range(0, size, FILL_CHUNK_BYTES):
        n = min(FILL_CHUNK_BYTES, size - start)
        os.posix_fallocate(fd, start, n)
        if pretouch:
            array[start:start + n:mmap.PAGESIZE] = 0
        if on_filled is not None:
            on_filled(start + n, size)


class SegmentedArena:
    """The arena as separately mapped ``memfd`` segments addressed by one offset space: slicing
    ``[off:off + n]`` (never across a segment: ``SlotTable`` extents do not) gives a view into the
    segment that holds it, so gather/scatter and views work as on one array."""

    def __init__(self, num_segments: int, segment_bytes: int, nbytes: int, pretouch: bool,
                 on_filled: Callable[[int, int], None] | None = None) -> None:
        self.nbytes = nbytes
        self.segment_bytes = segment_bytes
        self._pretouch = pretouch
        self._sizes = [min(nbytes, (s + 1) * segment_bytes) - s * segment_bytes for s in range(num_segments)]
        self._fds: list[int] = []
        self._maps: list[mmap.mmap] = []
        self._arrays: list[np.ndarray] = []
        for s, size in enumerate(self._sizes):
            before = sum(self._sizes[:s])
            fd, m = self._create(s, size, None if on_filled is None else lambda n, _: on_filled(before + n, nbytes))
            self._fds.append(fd)
            self._maps.append(m)
            self._arrays.append(np.frombuffer(m, dtype=np.uint8))

    def _create(self, s: int, size: int, on_filled: Callable[[int, int], None] | None = None) -> tuple[int, mmap.mmap]:
        fd = os.memfd_create(f"kvstore-cpu-segment-{s}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, size)
            m = mmap.mmap(fd, size)
            fill(fd, np.frombuffer(m, dtype=np.uint8), self._pretouch, on_filled)
            # a client holding the descriptor must not shrink it under the daemon's mapping (SIGBUS)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL)
        except OSError as e:
            os.close(fd)
            raise TierIOError(f"cpu tier: cannot allocate a {size}-byte segment ({e.strerror}); lower cpu_bytes") from e
        return fd, m

    def __getitem__(self, window: slice) -> np.ndarray:
        start, stop = window.start or 0, window.stop
        s = start // self.segment_bytes
        base = s * self.segment_bytes
        if stop - base > self._sizes[s]:
            raise IndexError(f"arena[{start}:{stop}] crosses segment {s}")
        return self._arrays[s][start - base:stop - base]

    def descriptor(self, s: int) -> int:
        """The segment's file descriptor (the daemon keeps ownership; send a copy)."""
        return self._fds[s]

    def size_of(self, s: int) -> int:
        return self._sizes[s]

    def renew(self, s: int) -> int:
        """Give segment ``s`` fresh memory and release the old memory's pages, whoever still maps
        it (``MADV_REMOVE``: a mapping touched again gets zeroed pages); returns the old
        descriptor, which the caller closes."""
        fd, m = self._create(s, self._sizes[s])
        old, old_map = self._fds[s], self._maps[s]
        self._fds[s], self._maps[s], self._arrays[s] = fd, m, np.frombuffer(m, dtype=np.uint8)
        with contextlib.suppress(OSError, ValueError):
            old_map.madvise(mmap.MADV_REMOVE)
        return old

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds, self._maps, self._arrays = [], [], []


_SEGMENT_NAME = re.compile(r"^kvstore-(\d+)-[0-9a-f]{8}$")


def sweep_stale_segments(shm_dir: str) -> int:
    """Unlink arenas left by daemons that died without closing (kill -9, OOM): shared memory is
    RAM, and nothing else would ever free it. Only our own naming pattern, only dead owners."""
    return dead_owners.sweep(shm_dir, _SEGMENT_NAME)


def _register_with_cuda(arena: np.ndarray) -> bool:
    """Page-lock this process's mapping of the arena when a CUDA device is present (host<->device
    copies made here become DMA); a no-op on CPU-only hosts."""
    if "torch" not in sys.modules and not os.path.exists("/dev/nvidiactl"):
        return False  # no NVIDIA driver: do not pay seconds of `import torch` at daemon start
    try:
        import torch
    except ImportError:
        return False
    if not torch.cuda.is_available():
        return False
    rc = torch.cuda.cudart().cudaHostRegister(arena.ctypes.data, arena.nbytes, 0)
    return int(rc) == 0 if not isinstance(rc, tuple) else int(rc[0]) == 0
