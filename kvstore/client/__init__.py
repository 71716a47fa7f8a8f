"""The one client every connector and CLI command uses: ``Client`` (blocking), ``AsyncClient``
(asyncio) and ``NamespaceHandle`` (one namespace, failing closed, for connectors), with the client
ends of the transports. It owns talking to a daemon and nothing else; it must not import
``kvstore.store``, ``kvstore.service``, ``kvstore.fleet``, ``kvstore.ops`` or ``kvstore.tiers``
(only the wire: ``kvstore.wire``, ``kvstore.keys``, ``kvstore.buffers``, ``kvstore.errors``,
``kvstore.transport`` and the generated protocol, plus ``kvstore.codecs``, imported lazily and
only when a daemon stores blocks encoded, to decode them).

    c = Client("127.0.0.1:7373", token=None, timeout_s=5.0, transport="auto")
    ns_id = c.register_namespace(Namespace(layout, cache_salt="..."))
    c.put(ns_id, hashes, blocks)            # bytes / numpy / CPU torch tensors
    sizes = c.get_into(ns_id, hashes, outs)  # None = miss

Transports (``transport=``): ``"auto"`` — shm when the daemon's arena is openable on this host,
else the raw-TCP bulk side channel, else gRPC streams; ``"shm"`` — same host only (raises if the
arena is not reachable); ``"bulk"`` — side channel, never shm; ``"grpc"`` — pure gRPC streams of
~1 MiB chunks (what a client behind a proxy uses). See ``negotiation``.

Failure model: every failure to reach the daemon in time — refused, reset, deadline — raises
``DaemonUnavailable`` (``NamespaceHandle`` turns it into a miss). Idempotent calls (all of them:
puts are content-addressed) are retried on UNAVAILABLE with short backoff inside the deadline. Any
other error comes back as the same ``kvstore.errors`` class the daemon raised, naming the field.
Compressed transfer: blocks a daemon stores encoded (tier codecs) arrive as stored and are
decoded here, into the caller's buffer on its device (a CUDA tensor decodes on its GPU), when this
process can decode them; otherwise the daemon decodes them before sending. A payload that fails
its decode raises ``CodecError``.

Modules: ``sync_client`` (Client), ``async_client``, ``rpc`` (channel, retries), ``rpc_errors``
(gRPC status -> kvstore error), ``negotiation`` (transport choice per daemon run), ``lease_calls`` (the
shm path's lease RPCs: the daemon's Unix socket, else gRPC), ``shm_path`` /
``stream_paths`` (the data paths), ``delivery`` (where each block lands, decoded), ``breaker`` and
``namespace_handle``.
"""

from kvstore.client.async_client import AsyncClient
from kvstore.client.breaker import CircuitBreaker
from kvstore.client.namespace_handle import NamespaceHandle
from kvstore.client.negotiation import TRANSPORTS
from kvstore.client.rpc_errors import RemoteError
from kvstore.client.sync_client import Client
from kvstore.errors import DaemonUnavailable
from kvstore.wire import Lookup

__all__ = ["Client", "AsyncClient", "NamespaceHandle", "CircuitBreaker", "Lookup", "RemoteError",
           "DaemonUnavailable", "TRANSPORTS"]
