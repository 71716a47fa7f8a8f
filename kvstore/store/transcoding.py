"""Codec glue: which codec each tier stores a namespace's blocks with, and the re-encoding a copy
needs when it moves between tiers (demotion, write-through, flush, promotion).

A tier's configured codec applies only to namespaces whose layout it understands (decided once
per tier and namespace, refusals counted); a block whose encoding would not shrink it, or that a
codec refuses (NaN/Inf), stays raw. ``kvstore.codecs`` is imported lazily: it pulls in torch.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from kvstore.buffers import as_bytes
from kvstore.errors import CodecError
from kvstore.store.config import StoreConfig
from kvstore.store.index import Entry
from kvstore.store.namespaces import NamespaceRegistry
from kvstore.tiers.base import BlockRecord, Tier


class Transcoder:
    def __init__(self, tiers: Sequence[Tier], config: StoreConfig, namespaces: NamespaceRegistry,
                 counters: dict[str, int]) -> None:
        self.tiers = tiers
        self.config = config
        self.namespaces = namespaces
        self.counters = counters
        self._choice: dict[tuple[int, bytes], str] = {}

    def codec_for(self, t: int, namespace_id: bytes) -> str:
        """The codec tier ``t`` stores this namespace's blocks with: its configured codec if the
        codec can interpret the namespace's layout, else raw (decided once per namespace)."""
        name = self.config.tier_codecs.get(self.tiers[t].name, "raw")
        if name == "raw":
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
                self._choice[key] = "raw"
                self.counters["codec_layout_refusals"] += 1
        return self._choice[key]

    def decode(self, entry: Entry, record: BlockRecord, payload, out=None) -> np.ndarray:
        """Raw block bytes of an encoded copy (into ``out`` when given)."""
        from kvstore import codecs
        layout = self.namespaces.get(entry.namespace_id).layout
        dst = np.empty(entry.raw_size, dtype=np.uint8) if out is None else out[:entry.raw_size]
        codecs.decode_block(record.codec, payload, layout, out=dst)
        return dst

    def transcode(self, entry: Entry, t: int, like: BlockRecord, data) -> tuple[BlockRecord, object]:
        """The record and payload a copy of ``data`` (encoded as ``like`` says) gets in tier ``t``."""
        want = self.codec_for(t, entry.namespace_id)
        from_codec = like.codec
        if want == "raw" and from_codec == 0:
            return dataclasses.replace(like), data
        from kvstore import codecs
        if from_codec != 0:
            if codecs.CODEC_IDS.get(want) == from_codec:
                return dataclasses.replace(like), data
            data = self.decode(entry, like, as_bytes(data)[:like.stored_size])
        raw = dataclasses.replace(like, codec=0, stored_size=entry.raw_size, checksum=0)
        if want == "raw":
            return raw, data
        try:
            codec_id, payload = codecs.encode_block(want, data, self.namespaces.get(entry.namespace_id).layout)
        except CodecError:
            self.counters["codec_fallbacks_raw"] += 1  # NaN/Inf or similar: keep the exact bytes
            return raw, data
        if payload.nbytes >= entry.raw_size:
            return raw, data
        self.counters[f"encoded_{want}"] += 1
        return dataclasses.replace(raw, codec=codec_id, stored_size=payload.nbytes), payload
