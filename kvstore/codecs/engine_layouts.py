"""Engine layout names that codecs understand, translated into the axis grammar of ``layout``.

Connectors name their blocks' byte order in ``KVLayout.layout``. New connectors should write the
axes themselves (``layer,kv,token,head,dim``); this table covers names already in use, whose
namespace ids must not change:

* ``vllm_cpu`` — handled by ``layout`` itself (K is stored transposed: not a permutation).
* ``sglang_<layout>_segment<N>`` (MHA) and ``sglang_mla_<layout>_segment<N>`` (MLA): one SGLang
  host-pool *segment* per block, as ``get_page_buffer_meta`` reports them (see
  connectors/sglang.py). An MHA segment is K-only or V-only (which one is not in the layout: the
  segment index is in the block hash), so codecs quantise it as one tensor:

  ========================  =====================  ================================
  SGLang layout             segments per page      one segment's axes
  ========================  =====================  ================================
  layer_first (MHA)         2 * layers (K, V per   ``token,head,dim`` (one layer)
                            layer)
  page_first (MHA)          2 (K, V)               ``token,layer,head,dim``
  page_first_direct (MHA)   2                      ``layer,token,head,dim``
  page_head (MHA)           2                      ``head,token,layer,dim``
  layer_first (MLA)         layers                 ``token,dim`` (one layer's latents)
  page_first (MLA)          1                      ``token,layer,dim``
  page_first_direct (MLA)   1                      ``layer,token,dim``
  ========================  =====================  ================================
"""

from __future__ import annotations

import re

from kvstore.codecs.refusal import Refused
from kvstore.keys import KVLayout

VLLM_CPU = "vllm_cpu"

_SGLANG = re.compile(r"sglang_(mla_)?([a-z_]+?)_segment(\d+)")
#: SGLang layout -> (one segment's axes, segments per page as a function of layers)
_SGLANG_MHA = {
    "layer_first": ("token,head,dim", lambda layers: 2 * layers),
    "page_first": ("token,layer,head,dim", lambda layers: 2),
    "page_first_direct": ("layer,token,head,dim", lambda layers: 2),
    "page_head": ("head,token,layer,dim", lambda layers: 2),
}
_SGLANG_MLA = {
    "layer_first": ("token,dim", lambda layers: layers),
    "page_first": ("token,layer,dim", lambda layers: 1),
    "page_first_direct": ("layer,token,dim", lambda layers: 1),
}
_AXIS_HELP = ("name the block's axes, outermost first, from kv,layer,token,head,dim (token and dim "
              "required; an omitted axis means the block holds one index of it, an omitted kv one of "
              "K or V or an MLA latent)")


def axes_of(layout: KVLayout) -> tuple[str, ...] | None:
    """The axes of ``layout``'s blocks, outermost first (None for ``vllm_cpu``), or ``Refused``."""
    name = layout.layout
    if name == VLLM_CPU:
        return None
    m = _SGLANG.fullmatch(name)
    if m:
        return _sglang_axes(layout, bool(m.group(1)), m.group(2), int(m.group(3)))
    if "," in name:
        return tuple(name.split(","))
    hint = (" (a vLLM GPU connector should name the axes of its per-block gather, e.g. "
            "layer,kv,token,head,dim)" if name.startswith("vllm_") else "")
    raise Refused("unknown_layout", f"layout.layout={name!r} is not a layout codecs understand: "
                  f"{_AXIS_HELP}, or use {VLLM_CPU!r} or an SGLang segment layout{hint}")


def _sglang_axes(layout: KVLayout, mla: bool, pool_layout: str, segments: int) -> tuple[str, ...]:
    table = _SGLANG_MLA if mla else _SGLANG_MHA
    if pool_layout not in table:
        raise Refused("unknown_layout", f"layout.layout={layout.layout!r}: SGLang {'MLA ' if mla else ''}"
                      f"layout {pool_layout!r} is not a layout codecs understand (known: {sorted(table)})")
    axes, per_page = table[pool_layout]
    if segments != per_page(layout.num_layers):
        raise Refused("segment_count", f"layout.layout={layout.layout!r}: an SGLang {pool_layout} page of "
                      f"{layout.num_layers} layers has {per_page(layout.num_layers)} segments, not {segments}")
    return tuple(axes.split(","))
