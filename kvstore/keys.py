"""Block identity: namespaces, chained prefix hashes, and the determinism self-check.

A *block* is the KV of ``block_tokens`` consecutive tokens for every layer of one model shard.
Its key is ``(namespace id, block hash)``:

* the **namespace** pins everything that decides what the bytes mean — model, KV layout descriptor
  (layers, kv heads, head dim, dtype, block_tokens, layout name, TP/PP ranks) and tenant / cache
  salt — so two workers whose layouts differ can never read each other's blocks;
* the **block hash** chains the parent's hash with this block's token ids (and extra keys such as a
  LoRA id or multimodal hashes), so equal hashes mean equal prefixes.

Hashes are seeded and computed from explicit little-endian bytes: the same tokens give the same
hash in every process on every machine (never Python's ``hash()``, which is salted per process).
Hashes computed by an engine itself (vLLM block hashes, SGLang page hashes) are accepted as opaque
bytes: the store never re-derives them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Sequence
from functools import cached_property
from typing import Any

import numpy as np
import xxhash

from kvstore.errors import HashSelfCheckFailed, InvalidArgument

#: bytes per element of every dtype a layout may name
DTYPE_SIZES: dict[str, int] = {
    "float32": 4,
    "bfloat16": 2,
    "float16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}

MAX_HASH_BYTES = 64
HASH_ALGORITHMS = ("xxh3_128", "sha256")


@dataclasses.dataclass(frozen=True)
class KVLayout:
    """What one block's bytes mean. Every field is part of the namespace identity.

    ``layout`` names the byte order inside a block; codecs read it to find K, V and heads
    (see ``kvstore.codecs.layout``) and store the block raw when they do not know it.
    ``kv_per_token`` is 2 for K and V, 1 for MLA's single latent vector.
    ``block_bytes`` is the exact payload size; 0 means "derive it from the shape".
    """

    model: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_tokens: int
    layout: str = "opaque"
    kv_per_token: int = 2
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    block_bytes: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise InvalidArgument("layout.model", "must be a non-empty model id")
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_tokens", "kv_per_token",
                     "tp_size", "pp_size", "cp_size"):
            if int(getattr(self, name)) < 1:
                raise InvalidArgument(f"layout.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.dtype not in DTYPE_SIZES:
            raise InvalidArgument("layout.dtype", f"unknown dtype {self.dtype!r}; one of {sorted(DTYPE_SIZES)}")
        for rank, size in (("tp_rank", "tp_size"), ("pp_rank", "pp_size"), ("cp_rank", "cp_size")):
            if not 0 <= getattr(self, rank) < getattr(self, size):
                raise InvalidArgument(f"layout.{rank}", f"must be in [0, {size}), got {getattr(self, rank)}")
        if self.block_bytes < 0:
            raise InvalidArgument("layout.block_bytes", "must be >= 0")
        if self.block_bytes == 0:
            object.__setattr__(self, "block_bytes", self.shape_bytes)

    @property
    def shape_bytes(self) -> int:
        """Bytes of one block as the shape says: layers x kv x tokens x heads x dim x dtype."""
        return (self.num_layers * self.kv_per_token * self.block_tokens * self.num_kv_heads
                * self.head_dim * DTYPE_SIZES[self.dtype])

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "KVLayout":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise InvalidArgument("layout", f"unknown fields {sorted(unknown)}")
        return cls(**d)


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Model + layout + tenant + cache salt. Its ``id`` is a 16-byte digest of all of them."""

    layout: KVLayout
    tenant: str = ""
    cache_salt: str = ""

    @cached_property
    def id(self) -> bytes:
        canonical = json.dumps({"v": 1, "layout": self.layout.to_dict(), "tenant": self.tenant,
                                "salt": self.cache_salt}, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_digest(canonical.encode(), seed=0x6B7673)

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"layout": self.layout.to_dict(), "tenant": self.tenant, "cache_salt": self.cache_salt}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Namespace":
        return cls(KVLayout.from_dict(d["layout"]), d.get("tenant", ""), d.get("cache_salt", ""))


#: bytes of a namespace id (``Namespace.id``, an xxh3_128 digest): a block key's first bytes
NAMESPACE_ID_BYTES = 16


def block_key(namespace_id: bytes, block_hash: bytes) -> bytes:
    """The store's index key: namespace id (``NAMESPACE_ID_BYTES``) followed by the block hash."""
    return namespace_id + block_hash


class NamedByKey:
    """Something named by a ``block_key`` (``self.key``): its namespace id and block hash are cut
    from the key when asked, so one bytes object is held per block instead of three."""

    __slots__ = ()
    key: bytes

    @property
    def namespace_id(self) -> bytes:
        return self.key[:NAMESPACE_ID_BYTES]

    @property
    def block_hash(self) -> bytes:
        return self.key[NAMESPACE_ID_BYTES:]


def check_block_hash(h: bytes, field: str = "hashes") -> bytes:
    if not isinstance(h, (bytes, bytearray)) or not 1 <= len(h) <= MAX_HASH_BYTES:
        raise InvalidArgument(field, f"a block hash must be 1..{MAX_HASH_BYTES} bytes")
    return bytes(h)


def _encode_extra(extra: Any) -> bytes:
    """Canonical, type-tagged bytes for extra keys (LoRA id, multimodal hashes, ...)."""
    if extra is None:
        return b""
    if isinstance(extra, (bytes, bytearray)):
        return b"b" + len(extra).to_bytes(4, "little") + bytes(extra)
    if isinstance(extra, bool):
        return b"t" if extra else b"f"
    if isinstance(extra, int):
        return b"i" + extra.to_bytes(16, "little", signed=True)
    if isinstance(extra, str):
        raw = extra.encode()
        return b"s" + len(raw).to_bytes(4, "little") + raw
    if isinstance(extra, (list, tuple)):
        return b"l" + len(extra).to_bytes(4, "little") + b"".join(_encode_extra(e) for e in extra)
    raise InvalidArgument("extra_keys", f"unsupported extra key type {type(extra).__name__}")


class ChainHasher:
    """Chained prefix hashing: ``h_i = H(seed; h_{i-1} || extra_i || tokens_i as uint32 LE)``.

    Only full blocks are hashed: a partial tail block is not a reusable prefix.
    """

    def __init__(self, algorithm: str = "xxh3_128", seed: int = 0) -> None:
        if algorithm not in HASH_ALGORITHMS:
            raise InvalidArgument("hash_algorithm", f"one of {HASH_ALGORITHMS}, got {algorithm!r}")
        if not 0 <= seed < 2**64:
            raise InvalidArgument("hash_seed", "must be in [0, 2**64)")
        self.algorithm = algorithm
        self.seed = seed
        self.digest_size = 16 if algorithm == "xxh3_128" else 32
        self.root = self._digest(b"kvstore-root", seed.to_bytes(8, "little"), b"")

    def _digest(self, parent: bytes, extra: bytes, tokens: bytes) -> bytes:
        return self._one_shot(parent + extra + tokens)

    def _one_shot(self, data: bytes) -> bytes:
        if self.algorithm == "xxh3_128":
            return xxhash.xxh3_128_digest(data, self.seed)
        return hashlib.sha256(self.seed.to_bytes(8, "little") + data).digest()

    def chain(self, token_ids: Sequence[int] | np.ndarray, block_tokens: int,
              parent: bytes | None = None, extra_keys: Sequence[Any] | None = None) -> list[bytes]:
        """Hashes of every full block of ``token_ids``, chained from ``parent`` (or the root).

        ``extra_keys`` is None (no extras) or one entry per full block.
        """
        if block_tokens < 1:
            raise InvalidArgument("block_tokens", "must be >= 1")
        tokens = np.ascontiguousarray(token_ids, dtype="<u4")
        n_blocks = len(tokens) // block_tokens
        if extra_keys is not None and len(extra_keys) < n_blocks:
            raise InvalidArgument("extra_keys", f"need one entry per full block ({n_blocks})")
        stride = block_tokens * 4
        raw = tokens[:n_blocks * block_tokens].tobytes()  # one conversion; slices below are tiny copies
        h = self.root if parent is None else parent
        out: list[bytes] = []
        append = out.append
        # The loop runs once per block, so it is kept to one slice, one concatenation, one C call.
        if self.algorithm == "xxh3_128" and extra_keys is None:
            digest, seed = xxhash.xxh3_128_digest, self.seed
            for off in range(0, n_blocks * stride, stride):
                h = digest(h + raw[off:off + stride], seed)
                append(h)
            return out
        for i in range(n_blocks):
            extra = _encode_extra(extra_keys[i]) if extra_keys is not None else b""
            h = self._one_shot(h + extra + raw[i * stride:(i + 1) * stride])
            append(h)
        return out


# Known answers, pinned when the scheme was defined. If these move, every stored block becomes
# unreachable (a silent 0 % hit rate), so start-up refuses to run instead.
_KNOWN_ANSWERS = {
    "xxh3_128": "fdf11eb952b400323d39642e1830e21d",
    "sha256": "2ac39bb708bd8d91debe26c41c99d0f2ae4f5e8a0a80f17f075fd8122edf2882",
}
_KNOWN_NAMESPACE_ID = "9da391017730a74677473b6058c27ff0"


def _known_answer_inputs() -> tuple[list[int], int, list[Any]]:
    tokens = [(i * 2654435761) % 151_936 for i in range(64)]
    return tokens, 16, [None, 7, "lora-a", [b"\x01\x02", 3]]


def _known_answer_namespace() -> Namespace:
    return Namespace(KVLayout(model="selfcheck/model", num_layers=2, num_kv_heads=2, head_dim=32,
                              dtype="bfloat16", block_tokens=16), tenant="t", cache_salt="s")


def known_answers() -> dict[str, str]:
    """What this build computes for the pinned inputs (used by the self-check and its tests)."""
    tokens, bt, extras = _known_answer_inputs()
    out = {}
    for algo in HASH_ALGORITHMS:
        out[algo] = ChainHasher(algo, seed=42).chain(tokens, bt, extra_keys=extras)[-1].hex()
    out["namespace"] = _known_answer_namespace().id.hex()
    return out


def determinism_self_check() -> None:
    """Fail loudly at start-up if hashing would not match other processes and machines."""
    got = known_answers()
    for algo, want in _KNOWN_ANSWERS.items():
        if got[algo] != want:
            raise HashSelfCheckFailed(f"{algo} chain hash is {got[algo]}, expected {want}: this build "
                                      "would not find blocks stored by others")
    if got["namespace"] != _KNOWN_NAMESPACE_ID:
        raise HashSelfCheckFailed(f"namespace id is {got['namespace']}, expected {_KNOWN_NAMESPACE_ID}")
    again = ChainHasher("xxh3_128", seed=42).chain(*_known_answer_inputs()[:2])
    if again != ChainHasher("xxh3_128", seed=42).chain(*_known_answer_inputs()[:2]):
        raise HashSelfCheckFailed("hashing the same tokens twice gave different results")

