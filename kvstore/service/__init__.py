"""The daemon: ``kvstore serve`` and everything it runs around the Store — the gRPC servicer, the
server ends of the transports (gRPC streams, the bulk side channel's RPCs, same-host leases),
authentication, configuration, metrics and the process lifecycle (start-up checks, the lease and
stall reaper, graceful shutdown). It owns what callers can hold and what they may see: every call
is authenticated before it costs a thread, every wait on a caller is bounded, and a tenant sees
only its own namespaces. It imports down only (``kvstore.store``, ``kvstore.tiers``,
``kvstore.transport``, ``kvstore.fleet`` in fleet mode, and the leaves ``keys``, ``errors``,
``buffers``, ``wire``, ``units``, ``progress``, ``dead_owners`` and the generated protocol) and must not import ``kvstore.client``,
``kvstore.ops`` or ``kvstore.connectors``.

Modules: ``daemon`` (the process), ``config`` (settings), ``auth`` (token -> tenant),
``grpc_server`` (the aio server, its connection bounds, health and reflection), ``interceptors``
(authentication from the headers), ``calls`` (the call bridge: messages on the event loop, bodies
on worker threads, errors as statuses), ``stalls`` (cutting callers that stop making progress),
``servicer`` (the KVStore service and its control RPCs) on ``rpc_base`` (the state every call
shares), delegating to one object per role: ``stream_rpcs`` (Put, Get), ``lease_rpcs`` (same-host
zero copy, over gRPC or the lookup socket), ``bulk_rpcs`` (the side channel), with ``block_reads``,
and ``admin_rpcs`` (operator commands) with ``usage`` (lookup counts per namespace);
``lookup_indexes`` (the per-tenant lookup tables same-host clients map, kept in step with the store);
``validation`` (request checks), ``metrics`` (the store's, the server's, and per tenant / namespace /
fleet, bounded), ``http_endpoint`` (``/metrics`` and ``/v1/route``) and ``reload`` (SIGHUP, ``kvstore
reload``).
"""
