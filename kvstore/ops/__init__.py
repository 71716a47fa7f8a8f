"""Operator tools: the ``kvstore`` command and everything its subcommands need.

Owns the console script and its subcommands (``serve``, ``health``, ``stats``, ``bench``, ``plan``,
``top``, the operator commands ``ns``/``evict``/``pin``/``unpin``/``prewarm``/``reload`` in
``admin_cli``; ``route`` lives with the fleet), the sizing planner (``plan``: replay, cost model,
report), the workload generators and trace reader, the live view, the service benchmark, the
machine's physical ceilings and facts, a private local daemon, a forging gRPC peer and a timed HTTP
probe for benchmarks and tests, and where the engine venvs those drive live. It may import any
public API of kvstore (store, service, client, fleet, tiers), never another package's privates;
nothing in kvstore imports ops: only the console script, ``benchmarks/`` and ``tests/`` do. It
imports nothing from ``benchmarks/`` or ``tests/``."""
