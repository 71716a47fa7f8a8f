"""The reliability suite's scenarios, one module per group (see benchmarks/reliability.py, the entry).

Owns the scenario code: checkable payloads and the daemon's vital signs (common), kill -9 loops
(crash), disk faults (disk), memory refusals (memory), hostile input (hostile), tenancy, load and
dependencies going down (deps), and the markdown summary (report). Every scenario drives a real
``kvstore serve`` child (kvstore.ops.local_daemon) and returns a dict of counts. Imports kvstore's
public API only; nothing from tests/ or from other benchmark scripts.
"""
