"""kvstore: a standalone KV-cache service for LLM serving.

The public surface: ``Client`` / ``AsyncClient`` (talk to a daemon started with ``kvstore serve``),
``KVLayout`` / ``Namespace`` (what a block's bytes mean) and ``ChainHasher`` (prefix hashes).
Imports are lazy so ``import kvstore`` stays cheap (no gRPC until a client is made).

This module owns only those re-exports: it imports ``kvstore.keys`` at once and ``kvstore.client``
on first use, and must not import the daemon's packages (``kvstore.store``, ``kvstore.service``,
``kvstore.fleet``, ``kvstore.tiers``), ``kvstore.ops`` or ``kvstore.codecs`` (torch), so a process
that only talks to a daemon never loads them. The packages under it each say in their own
``__init__`` what they own and what they must not import.
"""

from kvstore.keys import ChainHasher, KVLayout, Namespace

__all__ = ["Client", "AsyncClient", "KVLayout", "Namespace", "ChainHasher"]


def __getattr__(name):
    if name in ("Client", "AsyncClient"):
        from kvstore import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
