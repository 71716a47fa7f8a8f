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

import os as _os

# Installed, ``kvstore.tiers``, ``.proto`` and ``.connectors`` are mapped in from top-level folders
# (pyproject.toml's package-dir). Imported from a source checkout instead (a script run from the
# repository root puts it first on sys.path), this package is the checkout's ``kvstore/``, and those
# folders lie beside it: look there too, so the checkout imports whole rather than half.
_beside = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if not _os.path.isdir(_os.path.join(__path__[0], "proto")) and \
        _os.path.isfile(_os.path.join(_beside, "proto", "__init__.py")):
    __path__.append(_beside)

from kvstore.keys import ChainHasher, KVLayout, Namespace  # noqa: E402

__all__ = ["Client", "AsyncClient", "KVLayout", "Namespace", "ChainHasher"]


def __getattr__(name):
    if name in ("Client", "AsyncClient"):
        from kvstore import client

        return getattr(client, name)
    raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
