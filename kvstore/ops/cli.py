"""The ``kvstore`` command: serve, health, stats, bench (+ plan, top, route, ns, evict, pin, unpin, prewarm,
reload from their modules).

    kvstore serve                       # zero config: CPU tier sized from RAM, NVMe in ~/.cache, 127.0.0.1:7373
    kvstore serve --config kv.yaml --listen 0.0.0.0:7373 --cpu-bytes 8GiB --nvme-path /mnt/nvme/kv
    kvstore health --url 127.0.0.1:7373
    kvstore stats [--json]
    kvstore bench [--url HOST:PORT] [--json]   # without --url: an in-process daemon
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import sys

# glibc malloc tuned for large buffers: gRPC's per-message allocations stop hitting mmap/munmap
# and page faults (measured ~5x faster streams here). Freed memory stays in the process.
MALLOC_ENV = {"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": str(1 << 40), "MALLOC_TOP_PAD_": str(64 << 20)}

LAZY_COMMANDS = {"plan": ("kvstore.ops.plan", "main"), "top": ("kvstore.ops.top", "main"),
                 "route": ("kvstore.fleet", "route_main"),
                 "pd-proxy": ("kvstore.ops.pd_proxy", "main"),   # prefill/decode front end (docs/pd.md)
                 # operator commands (kvstore/ops/admin_cli.py)
                 "ns": ("kvstore.ops.admin_cli", "ns_main"), "evict": ("kvstore.ops.admin_cli", "evict_main"),
                 "pin": ("kvstore.ops.admin_cli", "pin_main"), "unpin": ("kvstore.ops.admin_cli", "unpin_main"),
                 "prewarm": ("kvstore.ops.admin_cli", "prewarm_main"),
                 "reload": ("kvstore.ops.admin_cli", "reload_main")}


def reexec_with_malloc_tuning(command: list[str]) -> None:
    """Re-run ``python *command`` with MALLOC_* set if they are missing (glibc reads them only at
    start); returns only when no re-exec is needed."""
    if os.environ.get("KVSTORE_NO_REEXEC") or all(k in os.environ for k in MALLOC_ENV):
        return
    if sys.platform != "linux":
        return
    env = {**os.environ, **{k: v for k, v in MALLOC_ENV.items() if k not in os.environ}, "KVSTORE_NO_REEXEC": "1"}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, *command], env)


def _serve_parser(sub) -> None:
    p = sub.add_parser("serve", help="run the daemon (flags > KVSTORE_* env > --config file > defaults)")
    p.add_argument("--config", help="YAML or TOML settings file (also KVSTORE_CONFIG)")
    p.add_argument("--listen", help="HOST:PORT for gRPC (default 127.0.0.1:7373; port 0 = any free port)")
    p.add_argument("--cpu-bytes", help="shared CPU arena size, e.g. 4GiB")
    p.add_argument("--cpu-slot-bytes", help="arena slot size, e.g. 256KiB")
    p.add_argument("--shm-dir", help="tmpfs directory for the arena (default /dev/shm)")
    p.add_argument("--nvme-path", help="directory of the NVMe tier")
    p.add_argument("--nvme-bytes", help="NVMe tier size (0 = no NVMe tier)")
    p.add_argument("--gpu-bytes", help="GPU tier size (default 0 = none)")
    p.add_argument("--eviction-policy", choices=["lru", "prefix", "s3fifo"])
    p.add_argument("--write-through", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--promote-on-hit", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument("--lease-seconds", type=float)
    p.add_argument("--metrics-port", type=int, help="Prometheus endpoint port (0 = any free port)")
    p.add_argument("--metrics-host", help="address the metrics endpoint listens on (default 127.0.0.1)")
    p.add_argument("--token", action="append", metavar="TOKEN=TENANT",
                   help="accept this bearer token as TENANT (repeatable; enables auth)")
    p.add_argument("--quota", action="append", metavar="TENANT=SIZE", help="per-tenant byte quota (repeatable)")
    p.add_argument("--tls-cert")
    p.add_argument("--tls-key")
    p.add_argument("--bulk-channel", action=argparse.BooleanOptionalAction, default=None,
                   help="offer the raw-TCP side channel to remote clients (default on)")
    p.add_argument("--ready-file", help="write {address, port, metrics_port, pid} as JSON here once serving")
    p.add_argument("--log-level", help="DEBUG, INFO, ... (default INFO; the log_level setting; reloadable)")


def _pairs(items: list[str] | None, flag: str) -> dict[str, str] | None:
    if not items:
        return None
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            got = "" if flag == "--token" else f", got {item!r}"   # a token is never echoed
            raise SystemExit(f"{flag}: expected KEY=VALUE{got}")
        out[key] = value
    return out


def cmd_serve(args) -> int:
    from kvstore.service.config import ConfigError, load_settings
    from kvstore.errors import KVStoreError

    flags = {"listen": args.listen, "cpu_bytes": args.cpu_bytes, "cpu_slot_bytes": args.cpu_slot_bytes,
             "shm_dir": args.shm_dir, "nvme_path": args.nvme_path, "nvme_bytes": args.nvme_bytes,
             "gpu_bytes": args.gpu_bytes, "eviction_policy": args.eviction_policy,
             "write_through": args.write_through, "promote_on_hit": args.promote_on_hit,
             "lease_seconds": args.lease_seconds, "metrics_port": args.metrics_port,
             "metrics_host": args.metrics_host,
             "tokens": _pairs(args.token, "--token"), "quotas": _pairs(args.quota, "--quota"),
             "tls_cert": args.tls_cert, "tls_key": args.tls_key, "bulk_channel": args.bulk_channel,
             "log_level": args.log_level}
    try:
        settings = load_settings(args.config, **flags)
    except ConfigError as e:
        print(f"kvstore serve: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from kvstore.service.daemon import run
    from kvstore.service.preflight import run_checks

    try:
        for warning in run_checks(settings, os.environ):
            logging.getLogger("kvstore.service.preflight").warning("%s", warning)
    except ConfigError as e:
        print(f"kvstore serve: cannot start: {e}", file=sys.stderr)
        return 1

    try:   # SIGHUP / `kvstore reload` read the configuration again the same way
        return run(settings, ready_file=args.ready_file, reload_settings=lambda: load_settings(args.config, **flags))
    except (KVStoreError, OSError, ValueError) as e:
        print(f"kvstore serve: cannot start: {e}", file=sys.stderr)
        return 1


def _client(args):
    from kvstore.client import Client

    return Client(args.url, token=args.token, timeout_s=args.timeout)


def cmd_health(args) -> int:
    with _client(args) as c:
        ok = c.health()
    print(f"{c.address}: {'SERVING' if ok else 'NOT SERVING / unreachable'}")
    return 0 if ok else 1


def cmd_stats(args) -> int:
    from kvstore.errors import KVStoreError

    try:
        with _client(args) as c:
            stats = c.stats()
    except KVStoreError as e:   # unreachable, or a missing / unknown token
        print(f"kvstore stats: {e}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    from rich import box
    from rich.console import Console
    from rich.table import Table

    from kvstore.units import format_size

    console = Console()
    if "tiers" not in stats:   # a tenant's own view: the daemon shows store-wide figures to admins only
        print_tenant_stats(stats, c.address, console)
        return 0
    # light tables whose cells wrap rather than being cut with '…' in 80 columns or a pipe
    tiers = Table(title=f"kvstore at {c.address}: {stats['blocks']} blocks, {stats['namespaces']} namespaces, "
                        f"{stats.get('leases', 0)} leases",  # a non-admin tenant's view has no store-wide figures
                  box=box.SIMPLE_HEAD)
    for col in ("tier", "used", "capacity", "use %", "blocks", "corrupt dropped"):
        tiers.add_column(col, justify="right" if col != "tier" else "left", overflow="fold")
    for name, t in stats.get("tiers", {}).items():
        cap = t.get("capacity_bytes", 0)
        tiers.add_row(name, format_size(t.get("used_bytes", 0)), format_size(cap),
                      f"{100 * t.get('used_bytes', 0) / cap:.1f}" if cap else "-",
                      str(t.get("policy_blocks", t.get("blocks", 0))), str(t.get("corrupt_dropped", 0)))
    console.print(tiers)
    counters = Table(title="counters", box=box.SIMPLE_HEAD)
    counters.add_column("counter", overflow="fold")
    counters.add_column("value", justify="right", overflow="fold")
    for k, v in sorted(stats.get("counters", {}).items()):
        counters.add_row(k, str(v))
    console.print(counters)
    fleet = stats.get("fleet")
    if fleet:   # peer fetches, direct fetches of P/D hand-offs, directory health (docs/fleet.md)
        events = Table(title=f"fleet node {fleet.get('node_id')}", box=box.SIMPLE_HEAD)
        events.add_column("counter", overflow="fold")
        events.add_column("value", justify="right", overflow="fold")
        events.add_row("directory connected", "yes" if fleet.get("connected") else "no")
        events.add_row("published_blocks", str(fleet.get("published_blocks", 0)))
        for k, v in sorted(fleet.get("counters", {}).items()):
            events.add_row(k, str(v))
        console.print(events)
    threads = stats.get("server", {}).get("threads")
    if threads:   # what every pool of the daemon is sized to (kvstore/threads.py)
        console.print("threads: " + ", ".join(f"{k} {v}" for k, v in threads.items()))
    return 0


def print_tenant_stats(stats: dict, address: str, console) -> None:
    """What a tenant's token may see: its own namespaces, and how to see more."""
    from rich import box
    from rich.table import Table

    from kvstore.units import format_size

    quota = stats.get("quota_bytes")
    print(f"kvstore at {address}, tenant {stats.get('tenant')!r}: {stats.get('namespaces', 0)} namespaces, "
          f"{stats.get('blocks', 0)} blocks, {format_size(stats.get('bytes', 0), 'readable')}"
          + (f" of a {format_size(quota, 'readable')} quota" if quota else ""))
    table = Table(box=box.SIMPLE_HEAD)
    for col in ("namespace", "blocks", "bytes"):
        table.add_column(col, justify="left" if col == "namespace" else "right", overflow="fold")
    for ns, row in sorted(stats.get("by_namespace", {}).items()):
        table.add_row(ns, str(row["blocks"]), format_size(row["bytes"], "readable"))
    if stats.get("by_namespace"):
        console.print(table)
    print(f"This is tenant {stats.get('tenant')!r}'s own view. Tiers and counters are shown to an admin token only\n"
          "(a tenant named in the daemon's admin_tenants setting).")


def cmd_bench(args) -> int:
    from kvstore.errors import InvalidArgument, KVStoreError
    from kvstore.ops.bench import check_transports, format_report, run_bench
    from kvstore.progress import Progress
    from kvstore.units import parse_size

    try:
        sizes = [parse_size(s, "sizes") for s in args.sizes.split(",")]
        total = parse_size(args.total, "total")
        transports = check_transports([t.strip() for t in args.transports.split(",") if t.strip()])
    except InvalidArgument as e:
        print(f"kvstore bench: {e}", file=sys.stderr)
        return 2
    try:
        with Progress("kvstore bench", total=len(sizes) * (len(transports) + 1) + 2) as steps:
            report = run_bench(url=args.url, token=args.token, sizes=sizes, total_bytes=total,
                               transports=transports, steps=steps)
    except (KVStoreError, RuntimeError, TimeoutError, OSError) as e:   # no daemon there, or ours did not start
        print(f"kvstore bench: {e}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _lazy(name: str, argv: list[str]) -> int:
    module, func = LAZY_COMMANDS[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        print(f"kvstore {name}: not available in this build ({module} is missing)", file=sys.stderr)
        return 2
    return int(getattr(mod, func)(argv) or 0)


def main(argv: list[str] | None = None) -> int:
    """``kvstore ...``; a reader that stops early (``kvstore stats --json | head``) ends the
    command quietly with exit 1, as other Unix tools do, instead of a BrokenPipeError traceback."""
    try:
        return _main(argv)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)   # the interpreter flushes stdout at exit: let it
        os.dup2(devnull, sys.stdout.fileno())
        return 1


def _main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in LAZY_COMMANDS:
        return _lazy(argv[0], argv[1:])
    ap = argparse.ArgumentParser(prog="kvstore", description="A KV-cache service for LLM serving.")
    sub = ap.add_subparsers(dest="command", required=True)
    _serve_parser(sub)
    for name, helptext in (("health", "is the daemon serving? (exit 0 / 1)"), ("stats", "tier occupancy and counters"),
                           ("bench", "GB/s of the daemon's data paths beside memcpy and raw TCP")):
        p = sub.add_parser(name, help=helptext)
        p.add_argument("--url", default=None if name == "bench" else os.environ.get("KVSTORE_URL"),
                       help="HOST:PORT of the daemon" + (" (bench: omit for an in-process daemon)" if name == "bench" else ""))
        p.add_argument("--token", default=os.environ.get("KVSTORE_TOKEN"))
        p.add_argument("--timeout", type=float, default=5.0)
        p.add_argument("--json", action="store_true")
        if name == "bench":
            p.add_argument("--sizes", default="1MiB,4MiB,16MiB", help="block sizes")
            p.add_argument("--total", default="256MiB", help="bytes moved per measurement")
            p.add_argument("--transports", default="grpc,bulk,shm")
    for name in LAZY_COMMANDS:
        sub.add_parser(name, help=f"see `kvstore {name} --help`")
    args = ap.parse_args(argv)
    if args.command in ("serve", "bench"):
        # -P: never put the working directory first on sys.path, or a source checkout's kvstore/
        # (which lacks the kvstore.tiers / .proto / .connectors mapping) would shadow the installed package
        reexec_with_malloc_tuning(["-P", "-m", "kvstore.ops.cli", *argv])
    return {"serve": cmd_serve, "health": cmd_health, "stats": cmd_stats, "bench": cmd_bench}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
