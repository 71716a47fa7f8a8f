"""The daemon: ``kvstore serve`` and everything it runs around the Store — the gRPC servicer, the
server ends of the transports (gRPC streams, the bulk side channel's RPCs, same-host leases),
authentication, configuration, metrics and the process lifecycle (start-up checks, the lease and
stall reaper, graceful shutdown). It owns what callers can hold and what they may see: every call
is authenticated before it costs a thread, every wait on a caller is bounded, and a tenant sees
only its own namespaces. It imports down only (``kvstore.store``, ``kvstore.tiers``,
``kvstore.transport``, ``kvstore.fleet`` in fleet mode, the leaf modules and the generated
protocol) and must not import ``kvstore.client``, ``kvstore.ops`` or ``kvstore.connectors``.

Entry points: ``daemon`` (the process) builds the Store and ``grpc_server``, whose ``servicer``
hands each role of the service to one object (``stream_rpcs``, ``lease_rpcs``, ``bulk_rpcs``,
``admin_rpcs``) on the shared state of ``rpc_base``; ``calls`` bridges the event loop and the
worker threads. Each module's docstring says what it owns.
"""
