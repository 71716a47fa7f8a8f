"""Codec glue: which codec each tier stores a namespace's blocks with, and the form a copy takes
when it enters a tier.

* A copy entering a tier by put (a client's, or a peer fetch's), by promotion or by staging for
  a same-host read is stored in that tier's codec: encoded when the tier names one, decoded when
  the tier is raw (a raw tier is where reads are fastest).
* A copy made for a slower tier (demotion, write-through, flush) keeps the encoding it has unless
  that tier names *another* codec: the block is already lossy, decoding would only take room, and
  re-encoding would change the bytes whose checksum the fleet directory holds.

A tier's codec applies only to namespaces whose layout it understands (decided once per tier and
namespace); a block the codec refuses (NaN/Inf) or whose encoding would not be smaller stays raw.
Every placement is tallied per tier (``Transcoder.count``, shown by ``tier_stats``), so an operator
can see whether ``codecs.<tier>`` is doing anything and, when it is not, why: ``layout`` (the codec
does not understand the namespace's layout), ``nonfinite`` (the block holds NaN/Inf),
``codec_error`` (any other refusal) or ``no_gain`` (the encoding was not smaller).
``kvstore.codecs`` is imported lazily: it pulls in torch, which a daemon without codecs never needs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from kvstore.buffers import as_bytes
from kvstore.errors import CodecError
from kvstore.store.config import StoreConfig
from kvstore.store.index import Entry
from kvstore.store.namespaces import NamespaceRegistry
from kvstore.tiers.base import BlockRecord, Tier

RAW = "raw"
#: why a block entering a tier with a codec was kept raw (part of the Stats surface: never rename)
RAW_KEPT_REASONS = ("layout", "nonfinite", "codec_error", "no_gain")


@dataclasses.dataclass
class Placement:
    """A copy's form in one tier: its record (codec, stored size), its payload, and why."""

    record: BlockRecord
    payload: object
    outcome: str      # "encoded" / "raw" (as configured), or why a codec tier kept it raw


class Transcoder:
    def __init__(self, tiers: Sequence[Tier], config: StoreConfig, namespaces: NamespaceRegistry,
                 count: Callable[..., None]) -> None:
        """``count(name)``: adds one to a store counter (the books' own, so no increment is lost)."""
        self.tiers = tiers
        self.config = config
        self.namespaces = namespaces
        self._count = count
        self._choice: dict[tuple[int, bytes], str] = {}
        # per tier, what entered it since start: encoded (blocks, raw bytes, stored bytes), and kept
        # raw by reason (blocks, raw bytes)
        self._encoded = [[0, 0, 0] for _ in tiers]
        self._raw_kept = [{reason: [0, 0] for reason in RAW_KEPT_REASONS} for _ in tiers]

    def configured(self, t: int) -> str:
        return self.config.tier_codecs.get(self.tiers[t].name, RAW)

    def stored_codecs(self) -> list[int]:
        """Ids of the codecs some tier is configured with (what a reader may be sent)."""
        names = {name for name in self.config.tier_codecs.values() if name != RAW}
        if not names:
            return []
        from kvstore import codecs
        return sorted(codecs.CODEC_IDS[name] for name in names)

    def codec_for(self, t: int, namespace_id: bytes) -> str:
        """The codec tier ``t`` stores this namespace's blocks with: its configured codec if the
        codec can interpret the namespace's layout, else raw (decided once per namespace)."""
        name = self.configured(t)
        if name == RAW:
            return name
        key = (t, namespace_id)
        if key not in self._choice:
            from kvstore import codecs
            ns = self.namespaces.find(namespace_id)
            try:
                if ns is None:
                    raise KeyError(namespace_id)
                codecs.check_layout(name, ns.layout)
                self._choice[key] = name
            except (KeyError, CodecError):
                self._choice[key] = RAW
                self._count("codec_layout_refusals")
        return self._choice[key]

    def decode(self, namespace_id: bytes, raw_size: int, record: BlockRecord, payload, out=None) -> np.ndarray:
        """Raw block bytes of an encoded copy (into ``out`` when given)."""
        from kvstore import codecs
        layout = self.namespaces.get(namespace_id).layout
        dst = np.empty(raw_size, dtype=np.uint8) if out is None else out[:raw_size]
        codecs.decode_block(record.codec, as_bytes(payload)[:record.stored_size], layout, out=dst)
        return dst

    def place(self, namespace_id: bytes, raw_size: int, t: int, like: BlockRecord, data, *,
              downward: bool = False, decoded=None) -> Placement:
        """The form a copy of ``data`` (encoded as ``like`` says) takes in tier ``t``. ``downward``:
        the copy is for a slower tier (see the module docstring). ``decoded``: the block's raw
        bytes when the caller has them already (saves a decode)."""
        want = self.codec_for(t, namespace_id)
        have = like.codec
        if have != 0:
            from kvstore import codecs
            if codecs.CODEC_IDS.get(want) == have or (want == RAW and downward):
                return Placement(like.replace(), data, "encoded")
            raw = decoded if decoded is not None else self.decode(namespace_id, raw_size, like, data)
            raw_record = like.replace(codec=0, stored_size=raw_size, checksum=0)
        else:
            raw, raw_record = data, like.replace()
        if want == RAW:
            return Placement(raw_record, raw, "layout" if self.configured(t) != RAW else RAW)
        from kvstore import codecs
        try:
            codec_id, payload = codecs.encode_block(want, raw, self.namespaces.get(namespace_id).layout)
        except CodecError as e:
            self._count("codec_fallbacks_raw")  # NaN/Inf or similar: keep the exact bytes
            return Placement(raw_record, raw, "nonfinite" if getattr(e, "reason", "") == "nonfinite"
                             else "codec_error")
        if payload.nbytes >= raw_size:
            return Placement(raw_record, raw, "no_gain")
        self._count(f"encoded_{want}")
        return Placement(raw_record.replace(codec=codec_id, stored_size=payload.nbytes, checksum=0),
                         payload, "encoded")

    def tier_stats(self, entries: Iterable[Entry]) -> dict[str, dict]:
        """Per tier: the copies it holds encoded and raw now, and what entered it since start."""
        held = [[0, 0] for _ in self.tiers]
        for entry in entries:
            for t, _, codec in entry.copies.sizes_and_codecs():
                held[t][codec == 0] += 1
        out = {}
        for t, tier in enumerate(self.tiers):
            (blocks, raw_bytes, stored_bytes), kept = self._encoded[t], self._raw_kept[t]
            out[tier.name] = {
                "configured": self.configured(t),
                "held_encoded_blocks": held[t][0],
                "held_raw_blocks": held[t][1],
                "encoded_blocks": blocks,
                "encoded_raw_bytes": raw_bytes,
                "encoded_stored_bytes": stored_bytes,
                "raw_kept_blocks": sum(c[0] for c in kept.values()),
                "raw_kept_bytes": sum(c[1] for c in kept.values()),
                "raw_kept": {reason: {"blocks": c[0], "bytes": c[1]} for reason, c in kept.items() if c[0]},
            }
        return out

    def count(self, t: int, placement: Placement, raw_size: int) -> None:
        """Tally a placement made in tier ``t`` (caller holds the store lock)."""
        if placement.record.codec != 0:
            counts = self._encoded[t]
            counts[0] += 1
            counts[1] += raw_size
            counts[2] += placement.record.stored_size
        elif placement.outcome != RAW:
            counts = self._raw_kept[t][placement.outcome]
            counts[0] += 1
            counts[1] += raw_size


class StagedBlock:
    """A block on its way in by put: its placement per tier, worked out (and encoded) at most once
    per tier, so the put can encode for the first tier it tries before taking the store lock. A
    put that falls through to a slower tier (the first is full of pinned blocks) lands there as if
    demoted from the first: in the first tier's form unless the slower tier names another codec."""

    def __init__(self, transcoder: Transcoder, like: BlockRecord, data) -> None:
        self.transcoder = transcoder
        self.like = like
        self.data = data
        self._placements: dict[int, Placement] = {}

    def placement(self, t: int) -> Placement:
        if t not in self._placements:
            ns, raw_size = self.like.namespace_id, self.like.raw_size
            if self._placements:
                first = self._placements[min(self._placements)]
                placed = self.transcoder.place(ns, raw_size, t, first.record, first.payload, downward=True)
            else:
                placed = self.transcoder.place(ns, raw_size, t, self.like, self.data)
            self._placements[t] = placed
        return self._placements[t]
