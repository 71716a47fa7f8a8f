"""Storage tiers (installed as ``kvstore.tiers``): the ``Tier`` contract every medium implements
(``base``: place, read, view, drop and enumerate opaque payloads by block key, with a
``BlockRecord`` each) and one medium per module. A tier owns its medium and its own accounting;
what goes where, eviction, leases and codecs are the Store's business. It imports only the leaves
``kvstore.keys``, ``kvstore.errors``, ``kvstore.buffers``, ``kvstore.dead_owners`` and ``kvstore.redis_connection`` (and
its own modules) and must not import ``kvstore.store``, ``kvstore.fleet``, ``kvstore.service``,
``kvstore.client``, ``kvstore.transport``, ``kvstore.ops``, ``kvstore.codecs`` or
``kvstore.connectors``.

Modules: ``cpu`` (the ``/dev/shm`` arena over ``slots``, the slot allocator, and with tenant
segments ``replaced_segments``, the replaced ones clients still hold), ``nvme``
(checksummed O_DIRECT blocks in ``slabs``, one file per block size, with ``private_files`` for its
private directory), ``gpu``
(HBM), ``redis`` (a pool shared by a fleet) and ``metadata`` (accounting only, for the planner).
"""
