"""Operator commands: ``kvstore ns list|drop``, ``evict``, ``pin``, ``unpin``, ``prewarm``, ``reload``.

    kvstore ns list [--json]                         # namespaces: model, tenant, blocks/bytes per tier, hits
    kvstore ns drop NS                               # unregister NS and free every block of it
    kvstore evict NS [PREFIX]                        # drop a prefix's blocks (no PREFIX: the whole namespace)
    kvstore pin NS PREFIX / kvstore unpin NS [PREFIX]
    kvstore prewarm NS PREFIX                        # NVMe (or peers) -> CPU tier ahead of traffic
    kvstore reload                                   # re-read tokens, quotas, pin bound, log level

``NS`` is a namespace id in hex, or any unambiguous start of one as ``ns list`` shows it. A
``PREFIX`` is a chain of block hashes: ``--hashes H1,H2,..`` / ``--hashes-file F`` (hex, one per
line or comma-separated) — what an engine's connector stored — or ``--tokens 1,2,..`` /
``--tokens-file F`` (token ids), hashed here with ``kvstore.keys.ChainHasher`` the way kvstore's
own hashing does (``--hash-algorithm``, ``--hash-seed``; blocks of the namespace's
``block_tokens`` unless ``--block-tokens`` says otherwise). Engines that hash with their own
scheme (vLLM's block hashes) must be given as ``--hashes``. With auth on, ``--token`` (or
``KVSTORE_TOKEN``) is the caller's: an admin's acts on every namespace, any other tenant's on
its own only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from kvstore.errors import InvalidArgument, KVStoreError
from kvstore.keys import ChainHasher
from kvstore.units import format_size
from kvstore.wire import MAX_BATCH


# -- calls (tests use these too) ---------------------------------------------------------------


def list_namespaces(client) -> list[dict]:
    """What ``ns list`` shows, one dict per namespace (largest first)."""
    from kvstore.proto import kvstore_pb2 as pb

    out = []
    for n in client.call("ListNamespaces", pb.ListNamespacesRequest()).namespaces:
        layout = {f.name: v for f, v in n.layout.ListFields()}
        out.append({"namespace_id": n.namespace_id.hex(), "tenant": n.tenant, "model": n.layout.model,
                    "layout": layout, "cache_salt": n.cache_salt, "blocks": n.blocks, "bytes": n.bytes,
                    "tiers": {t: {"blocks": u.blocks, "bytes": u.bytes} for t, u in sorted(n.tiers.items())},
                    "pinned_blocks": n.pinned_blocks, "pinned_bytes": n.pinned_bytes,
                    "lookup_blocks": n.lookup_blocks, "lookup_hits": n.lookup_hits,
                    "hit_ratio": n.lookup_hits / n.lookup_blocks if n.lookup_blocks else None,
                    "last_used": n.last_used or None})
    return out


def drop_namespace(client, namespace_id: bytes) -> dict:
    from kvstore.proto import kvstore_pb2 as pb

    r = client.call("DropNamespace", pb.NamespaceRequest(namespace_id=namespace_id))
    return {"blocks": r.blocks, "bytes": r.bytes}


def prefix_call(client, method: str, namespace_id: bytes, hashes: list[bytes], steps=None) -> dict:
    """One of Evict / Pin / Unpin / Prewarm over ``hashes`` (in batches of the wire's limit),
    summed. Pin's and Unpin's ``bytes`` is the tenant's pinned total after the last batch.
    ``steps`` (``kvstore.progress.Progress``) is told each batch as it is sent."""
    from kvstore.proto import kvstore_pb2 as pb

    total = {"blocks": 0, "bytes": 0, "stored": 0, "skipped": 0, "fetched": 0, "warmed": 0}
    for start in range(0, max(len(hashes), 1), MAX_BATCH):
        if steps is not None:
            steps.advance(f"blocks {start:,}..{min(start + MAX_BATCH, len(hashes)):,} of {len(hashes):,}")
        r = client.call(method, pb.PrefixRequest(namespace_id=namespace_id, hashes=hashes[start:start + MAX_BATCH]))
        for field in total:
            total[field] = getattr(r, field) if field == "bytes" and method in ("Pin", "Unpin") \
                else total[field] + getattr(r, field)
    return total


def reload(client) -> dict:
    from kvstore.proto import kvstore_pb2 as pb

    r = client.call("Reload", pb.ReloadRequest())
    return {"applied": list(r.applied), "ignored": list(r.ignored)}


# -- arguments ---------------------------------------------------------------------------------


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=os.environ.get("KVSTORE_URL"), help="daemon HOST:PORT")
    p.add_argument("--token", default=os.environ.get("KVSTORE_TOKEN"), help="bearer token (or KVSTORE_TOKEN)")
    p.add_argument("--root-ca", help="CA certificate for a TLS daemon")
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--json", action="store_true", help="print the answer as JSON")


def _prefix_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hashes", help="block hashes in hex, comma-separated, first block first")
    p.add_argument("--hashes-file", help="a file of block hashes in hex (one per line or comma-separated)")
    p.add_argument("--tokens", help="token ids, comma-separated (hashed here into full blocks)")
    p.add_argument("--tokens-file", help="a file of token ids (whitespace/comma-separated, or a JSON list)")
    p.add_argument("--block-tokens", type=int, help="tokens per block (default: the namespace's)")
    p.add_argument("--hash-algorithm", default="xxh3_128", choices=["xxh3_128", "sha256"])
    p.add_argument("--hash-seed", type=int, default=0)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def prefix_hashes(args, block_tokens: int) -> list[bytes]:
    """The chain the prefix arguments name (empty: none given)."""
    hex_text = args.hashes or (_read(args.hashes_file) if args.hashes_file else None)
    token_text = args.tokens or (_read(args.tokens_file) if args.tokens_file else None)
    if hex_text and token_text:
        raise InvalidArgument("prefix", "give hashes or token ids, not both")
    if hex_text:
        try:
            return [bytes.fromhex(h) for h in hex_text.replace(",", " ").split()]
        except ValueError:
            raise InvalidArgument("hashes", "every hash must be hex") from None
    if not token_text:
        return []
    text = token_text.strip()
    try:
        tokens = json.loads(text) if text.startswith("[") else [int(t) for t in text.replace(",", " ").split()]
    except ValueError:
        raise InvalidArgument("tokens", "token ids must be integers") from None
    bt = args.block_tokens or block_tokens
    hashes = ChainHasher(args.hash_algorithm, args.hash_seed).chain(tokens, bt)
    if not hashes:
        raise InvalidArgument("tokens", f"{len(tokens)} tokens make no full block of {bt} tokens")
    return hashes


def resolve_namespace(client, text: str) -> dict:
    """The namespace ``text`` names (a hex id or an unambiguous start of one) among those the
    caller may see."""
    text = text.strip().lower()
    found = [n for n in list_namespaces(client) if n["namespace_id"].startswith(text)]
    if len(found) == 1:
        return found[0]
    if not found:
        raise InvalidArgument("namespace", f"no namespace {text!r} visible to this token (see `kvstore ns list`)")
    raise InvalidArgument("namespace", f"{text!r} matches {len(found)} namespaces; give more of the id")


# -- output ------------------------------------------------------------------------------------


def _ago(ts: float | None) -> str:
    if not ts:
        return "-"
    s = max(0.0, time.time() - ts)
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.0f}h ago"


SHORT_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32", "float8_e4m3fn": "fp8",
                "float8_e5m2": "fp8e5"}


def _layout_line(layout: dict) -> str:
    """``L32 H8 D128 bf16 x16 tp0/2``: layers, kv heads, head dim, dtype, tokens per block, rank."""
    tp = f" tp{layout.get('tp_rank', 0)}/{layout['tp_size']}" if layout.get("tp_size", 1) > 1 else ""
    dtype = layout.get("dtype", "?")
    return (f"L{layout.get('num_layers', '?')} H{layout.get('num_kv_heads', '?')} D{layout.get('head_dim', '?')} "
            f"{SHORT_DTYPES.get(dtype, dtype)} x{layout.get('block_tokens', '?')}{tp}")


def print_namespaces(rows: list[dict], address: str) -> None:
    """A table that stays readable in 80 columns and when piped: cells wrap, never cut; the
    namespace is shown as the first 12 hex digits (any unambiguous start names it)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"namespaces at {address}: {len(rows)}", title_justify="left", box=box.SIMPLE_HEAD)
    table.add_column("namespace", no_wrap=True)
    table.add_column("model, layout", overflow="fold", min_width=14, max_width=20)
    table.add_column("tenant", overflow="fold")
    table.add_column("blocks", justify="right", no_wrap=True)
    table.add_column("per tier", no_wrap=True)
    table.add_column("hits", justify="right", no_wrap=True)
    for n in rows:
        held = f"{n['blocks']:,}\n{format_size(n['bytes'], 'cell')}"
        if n["pinned_blocks"]:
            held += f"\n{n['pinned_blocks']:,} pin"
        tiers = "\n".join(f"{t} {format_size(u['bytes'], 'cell')}" for t, u in n["tiers"].items() if u["blocks"]) or "-"
        hits = "-" if n["hit_ratio"] is None else f"{100 * n['hit_ratio']:.1f}%"
        table.add_row(n["namespace_id"][:12], f"{n['model']}\n{_layout_line(n['layout'])}", n["tenant"] or "-",
                      held, tiers, f"{hits}\n{_ago(n['last_used'])}")
    Console().print(table)


DONE = {
    "Evict": "evicted {blocks} blocks ({size}) of {ns}; {skipped} pinned blocks left in place",
    "Pin": "pinned {blocks} more blocks of {ns} ({stored} stored now, {warmed} copied into the CPU tier); "
           "the tenant pins {size} in all",
    "Unpin": "unpinned {blocks} blocks of {ns}; the tenant pins {size} in all",
    "Prewarm": "prewarmed {ns}: {warmed} blocks copied into the CPU tier, {stored} there already, "
               "{skipped} not here or no room, {fetched} fetched from peers",
}


# -- commands ----------------------------------------------------------------------------------


def _run(prog: str, args, body) -> int:
    from kvstore.client import Client

    try:
        with Client(args.url, token=args.token, timeout_s=args.timeout, root_ca=args.root_ca, transport="grpc") as c:
            return body(c) or 0
    except InvalidArgument as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 2
    except (KVStoreError, OSError) as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return 1


def ns_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvstore ns", description="list or drop namespaces")
    sub = ap.add_subparsers(dest="action", required=True)
    _common(sub.add_parser("list", help="namespaces with their blocks and bytes per tier, hit ratio, last use"))
    drop = sub.add_parser("drop", help="unregister a namespace and free every block of it")
    drop.add_argument("namespace", help="namespace id (hex, or an unambiguous start of it)")
    _common(drop)
    args = ap.parse_args(argv)

    def body(c):
        if args.action == "list":
            rows = list_namespaces(c)
            if args.json:
                print(json.dumps(rows, indent=2, sort_keys=True))
            else:
                print_namespaces(rows, c.address)
            return 0
        ns = resolve_namespace(c, args.namespace)
        freed = drop_namespace(c, bytes.fromhex(ns["namespace_id"]))
        print(json.dumps(freed) if args.json else
              f"dropped namespace {ns['namespace_id']} ({ns['model']}, tenant {ns['tenant'] or '-'}): "
              f"{freed['blocks']} blocks, {format_size(freed['bytes'], 'readable')} freed")
        return 0
    return _run("kvstore ns", args, body)


def _prefix_main(method: str, argv: list[str], prefix_required: bool, helptext: str) -> int:
    name = method.lower()
    ap = argparse.ArgumentParser(prog=f"kvstore {name}", description=helptext)
    ap.add_argument("namespace", help="namespace id (hex, or an unambiguous start of it)")
    _prefix_args(ap)
    _common(ap)
    args = ap.parse_args(argv)

    def body(c):
        ns = resolve_namespace(c, args.namespace)
        hashes = prefix_hashes(args, ns["layout"].get("block_tokens", 1))
        if prefix_required and not hashes:
            raise InvalidArgument("prefix", "give the prefix: --hashes, --hashes-file, --tokens or --tokens-file")
        from kvstore.progress import Progress

        batches = -(-len(hashes) // MAX_BATCH)
        with Progress(f"kvstore {name}", total=batches, quiet=batches < 2) as steps:   # one batch: no progress
            done = prefix_call(c, method, bytes.fromhex(ns["namespace_id"]), hashes, steps=steps)
        print(json.dumps(done) if args.json else
              DONE[method].format(ns=ns["namespace_id"][:12], size=format_size(done["bytes"], "readable"), **done))
        return 0
    return _run(f"kvstore {name}", args, body)


def evict_main(argv: list[str]) -> int:
    return _prefix_main("Evict", argv, False, "drop a prefix's blocks from every tier (no prefix: the whole "
                                               "namespace); pinned blocks stay")


def pin_main(argv: list[str]) -> int:
    return _prefix_main("Pin", argv, True, "never evict a prefix's blocks and keep them in the CPU tier")


def unpin_main(argv: list[str]) -> int:
    return _prefix_main("Unpin", argv, False, "release pins (no prefix: every pin of the namespace)")


def prewarm_main(argv: list[str]) -> int:
    return _prefix_main("Prewarm", argv, True, "copy a prefix's blocks into the CPU tier ahead of traffic")


def reload_main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="kvstore reload", description="re-read tokens, quotas, the pin bound and "
                                 "the log level from the daemon's configuration (as SIGHUP does)")
    _common(ap)
    args = ap.parse_args(argv)

    def body(c):
        done = reload(c)
        if args.json:
            print(json.dumps(done))
        else:
            print(f"reloaded: applied {', '.join(done['applied']) or 'nothing (no change)'}"
                  + (f"; changed but need a restart: {', '.join(done['ignored'])}" if done["ignored"] else ""))
        return 0
    return _run("kvstore reload", args, body)
