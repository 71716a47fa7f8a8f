"""How bulk bytes move between a client and the daemon.

* ``shm``    — same host: the client maps the daemon's CPU arena; RPCs carry slot extents only.
* ``bulk``   — remote: a raw TCP side channel negotiated over gRPC (control stays on gRPC).
* ``chunks`` — remote fallback: payloads as streams of ~1 MiB protobuf chunks.
"""
