"""``kvstore route``: which nodes hold the longest cached prefix of a request, for operators and
routers without Python. It reads the directory like a daemon does, so it needs the fleet secret
(``KVSTORE_FLEET__SECRET`` or ``--secret-file``) to tell signed node entries from planted ones."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

from kvstore.errors import KVStoreError
from kvstore.fleet.directory import Directory
from kvstore.keys import ChainHasher
from kvstore.redis_connection import url_problem

SECRET_ENV = "KVSTORE_FLEET__SECRET"


def _secret(args, parser: argparse.ArgumentParser) -> str:
    if args.secret_file:
        try:
            with open(args.secret_file, encoding="utf-8") as f:
                return f.read().strip()
        except OSError as e:
            parser.error(f"--secret-file: cannot read {args.secret_file}: {e.strerror}")
    secret = os.environ.get(SECRET_ENV)
    if not secret:
        parser.error(f"the fleet secret is needed to trust the directory: set {SECRET_ENV} or give --secret-file")
    return secret


def redacted(url: str) -> str:
    scheme, sep, rest = url.partition("://")
    return f"{scheme}{sep}{rest.rpartition('@')[2]}"


def why_no_route(directory: Directory, namespace_id: bytes, key_prefix: str) -> str | None:
    """Why a route found no node, when the answer is not simply "no node holds the first block":
    node entries that do not verify (another fleet's secret), no node in this namespace, or no
    directory at all under this key prefix. None: live, verified nodes, none holding the block."""
    rejected = sum(n for key, n in directory.counters.items() if key.startswith("rejected_"))
    if rejected:
        return (f"{rejected} node entries of namespace {namespace_id.hex()} are not signed with this secret; "
                f"give the fleet's own secret ({SECRET_ENV} or --secret-file)")
    if directory.redis.hlen(directory.nodes_key(namespace_id)):
        return None   # its nodes are there and verified (or expired): a plain miss
    if next(iter(directory.redis.scan_iter(match=f"{key_prefix}:*", count=1000)), None) is None:
        return (f"no fleet directory under key prefix {key_prefix!r} in this Redis; check --key-prefix "
                "(the daemons' fleet.key_prefix)")
    return f"no node of the fleet serves namespace {namespace_id.hex()} (check --namespace)"


def route_main(argv: Sequence[str] | None = None) -> int:
    """``kvstore route --redis URL --namespace HEX (--hashes HEX,... | --tokens 1,2,...)``:
    print which nodes hold the longest cached prefix of a request (JSON with ``--json``)."""
    p = argparse.ArgumentParser(prog="kvstore route", description=route_main.__doc__)
    p.add_argument("--redis", default=os.environ.get("KVSTORE_FLEET_REDIS_URL", "redis://127.0.0.1:6379/0"),
                   help="directory URL (redis://, rediss://, unix://, redis+cluster://)")
    p.add_argument("--key-prefix", default=os.environ.get("KVSTORE_FLEET_KEY_PREFIX", "kvs"))
    p.add_argument("--secret-file", help=f"file holding the fleet secret (default: ${SECRET_ENV})")
    p.add_argument("--namespace", required=True, help="namespace id, 32 hex digits")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--hashes", help="comma-separated block hashes in hex, in chain order")
    src.add_argument("--tokens", help="comma-separated token ids (hashed with --hash-algorithm/--hash-seed)")
    p.add_argument("--block-tokens", type=int, help="tokens per block (required with --tokens)")
    p.add_argument("--hash-algorithm", default="xxh3_128")
    p.add_argument("--hash-seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print JSON")
    args = p.parse_args(argv)
    try:
        ns = bytes.fromhex(args.namespace)
        if len(ns) != 16:
            raise ValueError
    except ValueError:
        p.error("--namespace: expected 32 hex digits")
    if args.hashes:
        try:
            hashes = [bytes.fromhex(h) for h in args.hashes.split(",") if h]
        except ValueError:
            p.error("--hashes: not hex")
    else:
        if not args.block_tokens:
            p.error("--block-tokens is required with --tokens")
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
        hashes = ChainHasher(args.hash_algorithm, args.hash_seed).chain(tokens, args.block_tokens)
    problem = url_problem(args.redis)
    if problem:
        print(f"kvstore route: --redis: {problem}", file=sys.stderr)
        return 2
    secret = _secret(args, p)
    try:
        directory = Directory(args.redis, args.key_prefix, socket_timeout_s=2.0, secret=secret)
    except KVStoreError as e:
        print(f"kvstore route: {e}", file=sys.stderr)
        return 2
    try:
        routes = directory.route(ns, hashes, args.block_tokens)
        why_empty = None if routes else why_no_route(directory, ns, args.key_prefix)
    except KVStoreError as e:
        print(f"kvstore route: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001
        print(f"kvstore route: directory unreachable at {redacted(args.redis)}: {e}", file=sys.stderr)
        return 1
    finally:
        directory.close()
    if why_empty:
        print(f"kvstore route: {why_empty}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps({"blocks_requested": len(hashes), "nodes": [r.to_dict() for r in routes]}, indent=2))
    elif not routes:
        print(f"no node holds the first of {len(hashes)} blocks")
    else:
        print(f"{'node':<24} {'address':<24} {'blocks':>7} {'tokens':>8}  tiers")
        for r in routes:
            tiers = ", ".join(f"{k}={v}" for k, v in sorted(r.tiers.items()))
            print(f"{r.node_id:<24} {r.address:<24} {r.blocks:>7} {r.tokens if r.tokens is not None else '-':>8}  {tiers}")
    return 0
