"""vLLM v1 KV connector: vLLM's paged KV cache <-> a kvstore daemon.

This package owns the vLLM side of kvstore: the ``KVStoreConnector`` vLLM loads, its scheduler and
worker halves, the paged-KV copies and the background saver. It talks to the daemon only through
``kvstore.client`` (``NamespaceHandle``) and must not import the store, the service, the fleet,
``kvstore.ops`` or ``tiers``.

Load it out of tree (vLLM 0.32; see docs/vllm.md for the supported range):

    --kv-transfer-config '{"kv_connector": "KVStoreConnector",
                           "kv_connector_module_path": "kvstore.connectors.vllm",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"url": "127.0.0.1:7373"}}'

How a request flows:

* **Scheduler** (``scheduler_side``): hashes the prompt's full blocks with kvstore's own seeded chain
  (vLLM's ``request.block_hashes`` depend on vLLM's hash algorithm, pickle and ``PYTHONHASHSEED``,
  so they are not a stable cross-process key), asks the daemon once how many leading blocks it
  holds (the lookup pins them under a lease), and tells vLLM how many tokens it can load.
  ``build_connector_meta`` turns that into per-step *loads* (daemon -> allocated vLLM blocks) and
  *saves* (full prompt blocks computed this step that the daemon does not hold yet).
* **Worker** (``worker_side``): ``start_load_kv`` fetches the planned blocks into a staging buffer
  and scatters them into every layer before the forward pass; ``wait_for_save`` gathers newly
  computed blocks out of the paged cache (a memcpy, so vLLM may reuse the blocks immediately) and a
  background thread (``saver``) sends them to the daemon. The engine never waits on the network
  for a save.

A block's bytes are the concatenation over layers (in the KV cache group's layer order) of that
layer's page for the block, copied verbatim (``paged_blocks``): the CPU attention kernel stores K
transposed inside a page, so the layout is treated as opaque and named in the namespace
(``vllm_cpu`` on CPU), together with model, layers, KV heads, head dim, dtype, block size and TP/PP
rank (``identity``): differently shaped or sharded workers never share blocks.

Failure model: the daemon being down, slow or missing a block is a *miss*. Lookups that fail count
as zero hits; a load that fails reports its vLLM block ids through
``get_block_ids_with_load_errors`` and the connector sets ``kv_load_failure_policy="recompute"``,
so vLLM recomputes those tokens; saves that fail are dropped. After a failure the connector stops
calling the daemon for ``retry_after_s`` so a dead daemon costs one timeout, not one per request.
Nothing raised by kvstore or the network reaches vLLM.

Extra config keys (``kv_connector_extra_config``, see ``settings``): ``url`` (``host:port`` or
``grpc://host:port``; default: ``KVSTORE_URL`` or the daemon's default address), ``token``,
``transport`` (auto | shm | bulk | grpc), ``lookup_timeout_s`` (0.5), ``timeout_s`` (5.0),
``retry_after_s`` (5.0), ``cache_salt`` (namespace salt), ``model_id`` (namespace model name;
default: the model path or id), ``hash_seed`` (0), ``load`` / ``save`` (true),
``max_pending_saves`` (64 batches).
"""

from kvstore.connectors.vllm.connector import KVStoreConnector
from kvstore.connectors.vllm.metadata import BlockTransfer, KVStoreConnectorMetadata, KVStoreConnectorStats
from kvstore.connectors.vllm.settings import ConnectorSettings

__all__ = ["KVStoreConnector", "KVStoreConnectorMetadata", "KVStoreConnectorStats", "BlockTransfer",
           "ConnectorSettings"]
