"""Why a codec left a block raw: a ``CodecError`` that carries a short, stable reason.

The store counts blocks and bytes kept raw per tier and reason (``Refused.reason`` is the label);
messages say the same thing for people. Reasons are part of the stats surface: never rename one.
"""

from __future__ import annotations

from kvstore.errors import CodecError

#: reason -> what it means (docs/codecs.md lists them too)
REASONS = {
    "unknown_layout": "the layout name is not one codecs understand (no axes, an engine layout not described)",
    "mla_kv_axis": "kv_per_token=1 (MLA latent) but the layout names a K/V axis or is vllm_cpu",
    "kv_per_token": "kv_per_token is neither 1 (latent) nor 2 (K and V)",
    "dtype": "the element dtype is not bfloat16, float16 or float32 (e.g. an FP8 or int8 KV cache)",
    "padded": "block_bytes differs from what the layout's axes add up to",
    "segment_count": "an SGLang segment layout whose segment count does not match its layers",
    "group": "an INT4 group size does not divide block_tokens / head_dim, or an odd element count",
    "no_gain": "the encoded payload would not be smaller than the block (e.g. INT4 over pages of 1-2 tokens)",
    "nonfinite": "the block holds NaN or Inf (decided per block, at encode)",
}


class Refused(CodecError):
    """A codec cannot represent this block or layout; the caller stores it raw."""

    def __init__(self, reason: str, message: str) -> None:
        assert reason in REASONS, reason
        self.reason = reason
        super().__init__(message)


def reason_of(error: CodecError) -> str:
    """The stable reason of a codec refusal (``"other"`` for a ``CodecError`` without one)."""
    return getattr(error, "reason", "other")
