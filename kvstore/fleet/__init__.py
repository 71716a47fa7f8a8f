"""Fleet mode: a Redis directory of who holds which block, verified peer fetch and KV-aware routing.

A fleet is many daemons, one per inference node. Each daemon publishes the blocks its Store holds
to a directory in Redis; any daemon (or a router) can then ask which node holds the longest cached
prefix of a request, and a daemon that misses locally can fetch the blocks from a peer instead of
letting its engine recompute them. Every directory value a daemon acts on is signed with the fleet
secret, so whoever can merely write to Redis cannot steer a daemon to a node of its choosing or
vouch for bytes; and peer calls prove possession of the keys instead of sending a token, so whoever
holds a signed entry's address gets nothing usable (docs/fleet.md, "Trust model").

This package owns the directory (layout, Lua scripts, signing), the publisher that mirrors a Store
into it, peer fetch and routing, and ``kvstore route``. It uses only the Store's public seams
(``subscribe``/``unsubscribe``, ``pinned()``, ``namespace()``, ``put``/``lookup``),
``kvstore.client`` to talk to peers and ``kvstore.redis_connection``; it must not import
``kvstore.service``, ``kvstore.ops`` or the internals of ``kvstore.tiers`` or ``kvstore.store``.

Modules: ``records`` (value layouts, defensive parsing), ``signing`` (MACs under the fleet secret),
``lua`` (the scripts), ``directory`` (Redis keys, membership, verified reads), ``routing`` (route
answers), ``publisher`` (Store -> directory), ``peer_proof`` (how peer calls prove possession),
``peers`` (bounded peer clients, verified fetch), ``direct`` (direct fetch of a P/D hand-off from the
member a lookup names), ``checksums`` (the checksum a node vouches for a block with),
``node`` (``Fleet``, composing them) and ``cli`` (``kvstore route``).
"""

from kvstore.fleet.cli import route_main
from kvstore.fleet.directory import Directory, DirectoryFull
from kvstore.fleet.node import Fleet
from kvstore.fleet.peers import PeerClients
from kvstore.fleet.records import MAX_SLOTS, TIER_CODES, pack_entry
from kvstore.fleet.routing import MAX_ROUTE_HASHES, NodeRoute
from kvstore.fleet.signing import DirectorySigner
from kvstore.redis_connection import connect

__all__ = ["Fleet", "Directory", "DirectoryFull", "DirectorySigner", "NodeRoute", "PeerClients", "pack_entry",
           "connect", "route_main", "TIER_CODES", "MAX_SLOTS", "MAX_ROUTE_HASHES"]
