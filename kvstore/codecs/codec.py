"""What every codec is: a stable name and id, the header parameter it writes, encode and decode.

Torch-free, so the lossless codecs (``lossless.py``) load in the core install; the lossy ones
(``base.SectionCodec`` and its subclasses) compute in torch and need the ``codecs`` extra.
"""

from __future__ import annotations

import numpy as np

from kvstore.codecs.header import Header
from kvstore.keys import KVLayout


class Codec:
    """One encoding. ``codec_id`` is stored with every block: never renumber or reuse one."""

    name: str = ""
    codec_id: int = -1
    param: int = 0          # stored in the header (group size, ...); decode checks it
    lossy: bool = False

    def check_layout(self, layout: KVLayout) -> None:
        """Raise ``CodecError`` if blocks of ``layout`` cannot be encoded (caller stores raw)."""

    def header_param(self, layout: KVLayout) -> int:
        """The parameter this codec writes in headers for ``layout`` (decode insists on it)."""
        return self.param

    def check_body(self, body: np.ndarray, layout: KVLayout) -> None:
        """Refuse (``CodecError``) a body that would decode to more than a block, from what it
        declares alone (sections are sized by the layout: nothing to check for them)."""

    def encode(self, raw, layout: KVLayout) -> np.ndarray:
        """Encode ``raw`` (a flat uint8 block of ``layout.block_bytes``: a torch tensor for a lossy
        codec, host numpy bytes for a lossless one) into header + body."""
        raise NotImplementedError

    def decode(self, header: Header, body: np.ndarray, layout: KVLayout, out) -> None:
        """Write the block into ``out`` (flat uint8, ``layout.block_bytes``: a torch tensor on any
        device, or a numpy array) from ``body`` (the payload after its header: host bytes,
        checksum verified)."""
        raise NotImplementedError
