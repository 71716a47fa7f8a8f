"""What each tier's codec did: blocks that entered the tier encoded, and blocks it kept raw, why.

Counted when a copy is placed in a tier (put, promotion, demotion, write-through, flush, staging
for a same-host read), so an operator can see whether ``codecs.<tier>`` is doing anything and,
when it is not, the reason: ``layout`` (the codec does not understand the namespace's layout),
``nonfinite`` (the block holds NaN/Inf), ``codec_error`` (any other refusal) or ``no_gain`` (the
encoding was not smaller). Callers hold the store lock.
"""

from __future__ import annotations

import collections

#: why a block entering a tier with a codec was kept raw (part of the Stats surface: never rename)
RAW_KEPT_REASONS = ("layout", "nonfinite", "codec_error", "no_gain")


class CodecTally:
    def __init__(self, configured: dict[str, str]) -> None:
        self.configured = configured   # tier name -> codec name ("raw" when none)
        self._encoded: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0, 0])
        self._raw_kept: dict[str, dict[str, list[int]]] = collections.defaultdict(
            lambda: {reason: [0, 0] for reason in RAW_KEPT_REASONS})

    def encoded(self, tier: str, raw_bytes: int, stored_bytes: int) -> None:
        counts = self._encoded[tier]
        counts[0] += 1
        counts[1] += raw_bytes
        counts[2] += stored_bytes

    def raw_kept(self, tier: str, reason: str, raw_bytes: int) -> None:
        counts = self._raw_kept[tier][reason]
        counts[0] += 1
        counts[1] += raw_bytes

    def tier_stats(self, tier: str, held_encoded: int, held_raw: int) -> dict:
        """One tier's figures: the copies it holds now, and what entered it since start."""
        blocks, raw_bytes, stored_bytes = self._encoded.get(tier, (0, 0, 0))
        kept = self._raw_kept.get(tier, {})
        return {
            "configured": self.configured.get(tier, "raw"),
            "held_encoded_blocks": held_encoded,
            "held_raw_blocks": held_raw,
            "encoded_blocks": blocks,
            "encoded_raw_bytes": raw_bytes,
            "encoded_stored_bytes": stored_bytes,
            "raw_kept_blocks": sum(c[0] for c in kept.values()),
            "raw_kept_bytes": sum(c[1] for c in kept.values()),
            "raw_kept": {reason: {"blocks": c[0], "bytes": c[1]} for reason, c in kept.items() if c[0]},
        }
