"""A same-host client that never lets go of tenant segments, run as its own process:
``python segment_holder.py ADDRESS TOKEN MODE`` (benchmarks/reliability.py segments_cycle,
tests/test_trust_segment_memory.py).

It reads one command a line from stdin and answers each with a JSON line:

- ``fill SEED N``: put N blocks of 256 KiB (seeded bytes) over shared memory, then ask the segment
  broker, segment by segment, for the descriptor of every segment its tenant owns, and keep each
  descriptor open and mapped, whatever the broker later says. MODE ``touch`` then writes every
  page of every segment it holds (old ones too), so pages the daemon released come back.
- ``exit``.

Each answer says how many blocks were stored, how many descriptors it holds, how many of its
requests the broker refused (and why), and the bytes its held segments occupy in memory now
(the sum of ``st_blocks`` over the distinct segments it holds).
"""

from __future__ import annotations

import json
import mmap
import os
import sys

import numpy as np

from kvstore import ChainHasher, KVLayout, Namespace
from kvstore.client import Client
from kvstore.errors import KVStoreError
from kvstore.proto import kvstore_pb2 as pb
from kvstore.transport import segments

LAYOUT = KVLayout(model="reliability/segments", num_layers=2, num_kv_heads=2, head_dim=128, dtype="bfloat16",
                  block_tokens=128)   # 256 KiB blocks


def blocks(seed: int, n: int) -> tuple[list[bytes], list[np.ndarray]]:
    hashes = ChainHasher(seed=seed).chain(list(range(n * LAYOUT.block_tokens)), LAYOUT.block_tokens)
    return hashes, [np.full(LAYOUT.block_bytes, (seed + i) % 251, np.uint8) for i in range(n)]


def main(address: str, token: str, mode: str) -> None:
    held: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}   # (segment, generation) -> (fd, mapping)
    refused: dict[str, int] = {}
    with Client(address, token=token, timeout_s=60) as c:
        ns = c.register_namespace(Namespace(LAYOUT))
        hs = c.call("Handshake", pb.HandshakeRequest(nonce=os.urandom(16)))
        every = -(-hs.arena_bytes // hs.segment_bytes)
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "exit":
                break
            seed, n = int(words[1]), int(words[2])
            hashes, data = blocks(seed, n)
            try:
                stored = c.put(ns, hashes, data).count("stored")
                error = None
            except KVStoreError as e:
                stored, error = 0, f"{type(e).__name__}: {e}"
            for s in range(every):
                try:
                    got = segments.ask(hs.segment_socket, hs.segment_ticket, hs.tenant, [s]).handed
                except PermissionError as e:
                    reason = "limit" if "max_held_segment_bytes_per_tenant" in str(e) else "not_ours"
                    refused[reason] = refused.get(reason, 0) + 1
                    continue
                for seg, fd, generation in got:
                    if (seg, generation) in held:
                        os.close(fd)
                    else:
                        held[(seg, generation)] = (fd, mmap.mmap(fd, os.fstat(fd).st_size))
            if mode == "touch":
                for _, m in held.values():
                    m[::mmap.PAGESIZE] = b"\x01" * len(range(0, len(m), mmap.PAGESIZE))
            inodes = {os.fstat(fd).st_ino: os.fstat(fd).st_blocks * 512 for fd, _ in held.values()}
            print(json.dumps({"stored": stored, "error": error, "held_segments": len(held), "refused": refused,
                              "held_bytes": sum(inodes.values()), "shm": c.active_transport}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
