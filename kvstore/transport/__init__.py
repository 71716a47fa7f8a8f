"""How bulk bytes move between a client and the daemon: the framing both ends share.

* ``shm``    — same host: the client maps the daemon's CPU arena; RPCs carry slot extents only.
* ``segments`` — same host with auth on: the client maps its tenant's arena segments, whose
  descriptors the daemon hands over a Unix socket after a ticket check.
* ``local_lookup`` — same host: Lookup over a Unix socket instead of gRPC (the scheduler path).
* ``local_calls`` — same host: the shm path's lease RPCs over that socket instead of gRPC.
* ``lookup_index`` — same host: the daemon's read-only table of served blocks, mapped by clients,
  which answer lookups from it without a round trip (and tell the socket service afterwards).
* ``socket_server`` — the daemon end every socket service above builds on (one epoll thread each:
  accept, deadlines, per-tenant caps, tickets), and the greeting its Unix-socket clients send.
* ``bulk``   — remote: a raw TCP side channel negotiated over gRPC (control stays on gRPC).
* ``chunks`` — remote fallback: payloads as streams of ~1 MiB protobuf chunks.

This package owns the wire format of each transport and both of its ends (the client's in
``kvstore.client``, the daemon's in ``kvstore.service`` call in here). It imports only the leaves
(``kvstore.buffers``, ``errors``, ``keys``, ``dead_owners``, ``threads``) and the generated protocol,
never the client, the service, the store or ``tiers``: a client never pulls in the daemon's storage.
"""
