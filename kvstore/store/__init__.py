"""The store core: the tier cascade behind put / get / lookup / delete, with pins, leases and the
two-phase zero-copy operations, eviction policies, codec transcoding between tiers, the namespace
registry and warm restart. Its public face is ``Store`` and the seams on it (``subscribe`` with
``held_blocks`` and ``replay``, ``pinned``, ``shared_arena``, ``largest_block_bytes``, ``leases``); nobody
outside this package touches the index, the lock or a tier's internals. It imports down only (``kvstore.tiers``, ``kvstore.codecs``,
and the leaves ``keys``, ``errors``, ``buffers``, ``wire``) and must not import ``kvstore.service``,
``kvstore.client``, ``kvstore.fleet``, ``kvstore.ops``, ``kvstore.transport`` or ``kvstore.proto``.

Modules: ``store`` (the Store and its seams), ``cascade`` (placing, demoting, promoting and dropping
copies), ``index`` (entries and prefix-chain links), ``leases`` (two-phase operations), ``puts`` /
``reads`` (blocks by value, as stored or decoded), ``transcoding`` (the form a copy takes in each
tier: codecs where configured, and its per-tier tally), ``namespaces`` (the registry and its
per-tenant cap), ``namespace_files`` (one file per namespace on disk), ``quotas`` (per-tenant byte
accounting), ``recovery`` (warm restart), ``views`` (pinned blocks and the shared arena),
``listeners``, ``config`` and ``policy``; ``admin`` (operator commands: footprints, drop, evict,
prewarm, limits; ``Store.admin``) with ``pinned_prefixes`` (``kvstore pin``); both warm blocks into
the CPU tier with ``Transfers.warm``.
"""

from kvstore.store.config import StoreConfig
from kvstore.store.leases import Lease
from kvstore.store.listeners import StoreListener
from kvstore.store.store import Store
from kvstore.store.views import PinnedBlock, SharedArena
from kvstore.wire import MAX_BATCH, Lookup

__all__ = ["Store", "StoreConfig", "StoreListener", "Lease", "Lookup", "MAX_BATCH", "PinnedBlock", "SharedArena"]
