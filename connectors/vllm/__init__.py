"""vLLM v1 KV connector: vLLM's paged KV cache <-> a kvstore daemon.

This package owns the vLLM side of kvstore: the ``KVStoreConnector`` vLLM loads, the object it
holds for its role (scheduler or worker), the paged-KV copies, the background loader and saver. It
talks to the daemon only through ``kvstore.client`` (``NamespaceHandle``) and must not import the
store, the service, the fleet, ``kvstore.ops`` or ``tiers``. Only ``connector``, ``metadata`` and
``admission`` (vLLM's schedulers with cache-aware admission, loaded through ``scheduler_cls``)
import vLLM; the naming rules (``identity``, ``settings``) do not, so they can be tested without an
engine.

Load it out of tree (vLLM 0.32; see docs/vllm.md for the supported range):

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"url": "127.0.0.1:7373", "load_mode": "sync"}}'

How a request flows:

* **Scheduler** (``scheduler_side``): hashes the prompt's full blocks with kvstore's own seeded chain
  (vLLM's ``request.block_hashes`` depend on vLLM's hash algorithm, pickle and ``PYTHONHASHSEED``,
  so they are not a stable cross-process key), asks the daemon once how many leading blocks every
  rank's namespace holds (the lookup pins them under a lease), and tells vLLM how many tokens it
  can load — before the step (``load_mode`` ``sync`` / ``layer``) or between steps (``async``).
  ``build_connector_meta`` turns that into per-step *loads* and *saves* (blocks that became full,
  prompt and generated, that the daemon does not hold yet).
* **Worker** (``worker_side``, ``loader``, ``saver``): loads fetch blocks into a staging buffer and
  scatter them into every layer — all at once before the forward pass, layer by layer as attention
  layers ask, or on a background thread; saves are copied out of the paged cache and sent on
  background threads, and a finished request's blocks are held until they are copied out.

A block's bytes are the concatenation over layers (in the KV cache group's layer order) of that
layer's page for the block, copied verbatim (``paged_blocks``): the CPU attention kernel stores K
transposed inside a page, so the layout is treated as opaque and named in the namespace
(``vllm_cpu`` on CPU), together with model, layers, KV heads, head dim, dtype, block size and TP/PP
rank (``identity``): differently shaped or sharded workers never share blocks; MLA's latent KV is
stored once, rank-free.

With ``blocks_per_chunk`` N > 1 one kvstore block is a *chunk* of N consecutive vLLM blocks,
repacked into the byte order its layout name describes for N x block_size tokens (``chunks``);
hashes, lookups and saves then go by whole chunks (docs/vllm.md, "Chunks").

Roles (``roles``): ``kv_role: kv_producer`` (prefill) saves and never loads, and names the prompt
blocks it saves in the finished request's ``kv_transfer_params``; ``kv_consumer`` (decode) loads,
never saves prompt blocks, and, handed those params, defers the request until its daemon holds
exactly those blocks, for at most ``pd_wait_s`` (``handoff``; docs/pd.md); ``kv_both`` does both.

Failure model: the daemon being down, slow or missing a block is a *miss*. Lookups that fail count
as zero hits; a load that fails reports its vLLM block ids through
``get_block_ids_with_load_errors`` and the connector sets ``kv_load_failure_policy="recompute"``,
so vLLM recomputes those tokens; saves that fail are dropped. After a failure the connector stops
calling the daemon for ``retry_after_s`` so a dead daemon costs one timeout, not one per request.
Nothing raised by kvstore or the network reaches vLLM. If this build's block hashing fails its
known-answer self-check the connector disables itself (logged) rather than store unfindable blocks.

Extra config keys: see ``settings.ConnectorSettings`` and docs/vllm.md.
"""

from kvstore.connectors.vllm.settings import ConnectorSettings

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreConnectorStats", "BlockTransfer",
           "ConnectorSettings"]


def __getattr__(name: str):
    """vLLM's classes load on first use, so the naming rules import without vLLM installed."""
    if name == "KVStoreConnector":
        from kvstore.connectors.vllm.connector import KVStoreConnector

        return KVStoreConnector
    if name in ("KVStoreConnectorMetadata", "KVStoreConnectorStats", "BlockTransfer"):
        from kvstore.connectors.vllm import metadata

        return getattr(metadata, name)
    raise AttributeError(f"module 'kvstore.connectors.vllm' has no attribute {name!r}")
