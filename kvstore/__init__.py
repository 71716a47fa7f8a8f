"""kvstore: a standalone KV-cache service for LLM serving.

The public surface: ``Client`` / ``AsyncClient`` (talk to a daemon started with ``kvstore serve``),
``KVLayout`` / ``Namespace`` (what a block's bytes mean) and ``ChainHasher`` (prefix hashes).
Imports are lazy so ``import kvstore`` stays cheap (no gRPC until a client is made).
"""

from kvstore.keys import ChainHasher, KVLayout, Namespace

__all__ = ["Client", "AsyncClient", "KVLayout", "Namespace", "ChainHasher"]


def __getattr__(name):
    if name in ("Client", "AsyncClient"):
        from kvstore import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
