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
    secret = _secret(args, p)
    try:
        directory = Directory(args.redis, args.key_prefix, socket_timeout_s=2.0, secret=secret)
    except KVStoreError as e:
        print(f"kvstore route: {e}", file=sys.stderr)
        return 2
    try:
        routes = directory.route(ns, hashes, args.block_tokens)
    except KVStoreError as e:
        print(f"kvstore route: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001
        print(f"kvstore route: directory unreachable at {args.redis}: {e}", file=sys.stderr)
        return 1
    finally:
        directory.close()
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
