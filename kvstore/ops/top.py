"""``kvstore top``: a live terminal view of a running daemon (hit rates, bytes/s, occupancy).

It polls ``Client.stats()`` (the store's stats plus a ``server`` section) every ``--interval``
seconds and shows rates as deltas between two polls, so a counter that only grows becomes
"what is happening now". ``--once`` prints a single frame (two polls ``--interval`` apart, so
rates are real) and exits: for scripts and tests.

Rendering is a pure function of (stats now, stats before, seconds between): ``view()`` computes
the numbers, ``render()`` lays them out, and neither talks to a daemon.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

from rich import box
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from kvstore.errors import DaemonUnavailable, KVStoreError
from kvstore.units import format_size

#: counters shown as per-second rates, in display order (label, counter name, is bytes)
RATES = [("lookups", "lookups", False), ("puts", "puts", False), ("misses", "misses", False),
         ("bytes in", "bytes_in", True), ("bytes out", "bytes_out", True), ("evictions", "evictions", False),
         ("demotions", "demotions", False), ("promotions", "promotions", False),
         ("corrupt dropped", "corrupt_dropped", False), ("put rejected (full)", "put_rejected_full", False)]


def _hits(counters: dict, tiers: list[str]) -> dict[str, int]:
    return {t: int(counters.get(f"hits_{t}", 0)) for t in tiers}


def _hit_rate(hits: dict[str, int], misses: int) -> float | None:
    total = sum(hits.values()) + misses
    return sum(hits.values()) / total if total else None


def view(stats: dict, prev: dict | None = None, dt: float | None = None) -> dict:
    """The numbers of one frame: totals since start, and rates over the last ``dt`` seconds."""
    counters = stats.get("counters", {})
    tiers = list(stats.get("tiers", {}))
    hits = _hits(counters, tiers)
    misses = int(counters.get("misses", 0))
    out = {
        "blocks": stats.get("blocks", 0), "leases": stats.get("leases", 0), "namespaces": stats.get("namespaces", 0),
        "server": stats.get("server", {}),
        "hit_rate_total": _hit_rate(hits, misses),
        "hit_share_total": {t: (h / (sum(hits.values()) + misses) if sum(hits.values()) + misses else None)
                            for t, h in hits.items()},
        "tiers": [], "rates": {}, "hit_rate_now": None, "namespace_usage": [],
    }
    for name, t in stats.get("tiers", {}).items():
        cap, used = int(t.get("capacity_bytes", 0)), int(t.get("used_bytes", 0))
        out["tiers"].append({"name": name, "capacity_bytes": cap, "used_bytes": used,
                             "occupancy": used / cap if cap else 0.0, "blocks": t.get("blocks", t.get("policy_blocks", 0)),
                             "hits": hits.get(name, 0), "corrupt_dropped": t.get("corrupt_dropped", 0)})
    if prev is not None and dt and dt > 0:
        before = prev.get("counters", {})
        for label, key, _ in RATES:
            out["rates"][key] = max(0, counters.get(key, 0) - before.get(key, 0)) / dt
        prev_hits = _hits(before, tiers)
        d_hits = {t: hits[t] - prev_hits.get(t, 0) for t in tiers}
        out["hit_rate_now"] = _hit_rate(d_hits, misses - int(before.get("misses", 0)))
        for t in tiers:
            out["rates"][f"hits_{t}"] = max(0, d_hits[t]) / dt
    usage = stats.get("namespace_usage") or []
    out["namespace_usage"] = sorted(usage, key=lambda n: n.get("bytes", 0), reverse=True)
    return out


def _pct(x: float | None) -> str:
    return "—" if x is None else f"{x:.1%}"


def _bar(fraction: float, width: int = 20) -> Text:
    filled = int(round(max(0.0, min(1.0, fraction)) * width))
    color = "green" if fraction < 0.8 else "yellow" if fraction < 0.95 else "red"
    return Text("█" * filled, style=color) + Text("░" * (width - filled), style="dim")


#: terminals at least this wide get the occupancy bars; narrower ones (80 columns, pipes) do not
BAR_MIN_WIDTH = 100
#: terminals at least this tall get the activity as a full table; shorter ones (24 rows) a compact block
TALL_MIN_HEIGHT = 40
#: namespaces listed at most (the daemon sends its largest ten)
MAX_NAMESPACES = 10


def _table(title: str | None, columns: list[str], left: tuple[str, ...]) -> Table:
    """A light table whose cells wrap instead of being cut with '…' when the terminal is narrow."""
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, padding=(0, 1), pad_edge=False,
                  show_edge=False)
    for col in columns:
        table.add_column(col, justify="left" if col in left else "right", overflow="fold")
    return table


def _lines(renderable, width: int | None) -> int:
    """Rows ``renderable`` takes on a terminal ``width`` columns wide."""
    console = Console(width=width or 200, record=True, color_system=None, file=io.StringIO())
    console.print(renderable)
    return len(console.export_text().splitlines())


def _activity(v: dict, stats: dict, dt: float | None, tall: bool, width: int | None):
    counters = stats.get("counters", {})
    if tall:
        rates = _table(f"activity (per second over {dt:.1f}s)" if dt else "activity (since start)",
                       ["counter", "per second", "total"], left=("counter",))
        for label, key, is_bytes in RATES:
            r = v["rates"].get(key)
            total = counters.get(key, 0)
            rates.add_row(label, "—" if r is None else (f"{format_size(r, 'readable')}/s" if is_bytes else f"{r:,.1f}"),
                          format_size(total, "readable") if is_bytes else f"{total:,}")
        return rates
    # a short terminal: every counter still shown, as "label rate" pairs filling lines of the width
    pairs = []
    for label, key, is_bytes in RATES:
        r = v["rates"].get(key)
        if r is None:
            shown = format_size(counters.get(key, 0), "readable") if is_bytes else f"{counters.get(key, 0):,}"
        else:
            shown = f"{format_size(r, 'readable')}/s" if is_bytes else f"{r:,.1f}/s"
        pairs.append((label, shown))
    out = Text(f"activity per second over {dt:.1f}s:" if dt else "activity since start:", style="bold")
    column = len(out.plain)
    for label, shown in pairs:
        piece = len(label) + 1 + len(shown)
        if column + 2 + piece > (width or 80):
            out.append("\n")
            column = -2
        else:
            out.append("  ")
        out.append(label, style="dim")
        out.append(" " + shown)
        column += 2 + piece
    return out


def _namespaces(rows: list[dict], limit: int) -> Table:
    ns = _table("top namespaces (by bytes)", ["namespace", "model", "tenant", "bytes", "blocks", "hit %"],
                left=("namespace", "model", "tenant"))
    for n in rows[:limit]:
        ratio = n.get("hit_ratio")
        ns.add_row(str(n.get("id", ""))[:12], str(n.get("model", "")), str(n.get("tenant", "") or "-"),
                   format_size(n.get("bytes", 0), "readable"), f"{n.get('blocks', 0):,}" if "blocks" in n else "—",
                   "—" if ratio is None else f"{ratio:.0%}")
    return ns


def render(stats: dict, prev: dict | None = None, dt: float | None = None, address: str = "",
           width: int | None = None, height: int | None = None) -> Group:
    """One frame for a terminal ``width`` x ``height`` (None: as much room as it needs). On 80x24
    it shows the tiers, the hit rates, every counter (compactly) and the top namespaces that fit;
    a wider terminal adds occupancy bars, a taller one the activity table and more namespaces."""
    v = view(stats, prev, dt)
    server = v["server"]
    head = Text.assemble(("kvstore top", "bold"), f"  {address}" if address else "",
                         f"  up {server.get('uptime_s', 0):.0f}s" if server else "",
                         f"  server {server.get('server_id', '?')}" if server and (width or 200) >= 100 else "",
                         f"\nblocks {v['blocks']:,}  namespaces {v['namespaces']}  leases {v['leases']}")
    hits = Text.assemble("hit rate ", ("now " + _pct(v["hit_rate_now"]), "bold cyan"),
                         f"   since start {_pct(v['hit_rate_total'])}  (",
                         ", ".join(f"{t} {_pct(s)}" for t, s in v["hit_share_total"].items()), ")")

    bars = width is None or width >= BAR_MIN_WIDTH
    tall = height is None or height >= TALL_MIN_HEIGHT
    tiers = _table(None, ["tier", "used", "capacity", "use %"] + ([""] if bars else [])
                   + ["blocks", "hits", "hits/s", "corrupt"], left=("tier", ""))
    for t in v["tiers"]:
        rate = v["rates"].get(f"hits_{t['name']}")
        tiers.add_row(t["name"], format_size(t["used_bytes"], "readable"),
                      format_size(t["capacity_bytes"], "readable"),
                      f"{t['occupancy']:.1%}", *([_bar(t["occupancy"])] if bars else []), f"{t['blocks']:,}",
                      f"{t['hits']:,}", "—" if rate is None else f"{rate:,.1f}", str(t["corrupt_dropped"]))

    parts = [head, hits, tiers, _activity(v, stats, dt, tall, width)]
    usage = v["namespace_usage"]
    if usage:
        for limit in range(min(len(usage), MAX_NAMESPACES), -1, -1):   # as many as fit (a long model wraps)
            tail = ([_namespaces(usage, limit)] if limit else []) + (
                [Text(f"{len(usage) - limit} more namespaces: a taller terminal shows them, or kvstore ns list",
                      style="dim")] if limit < len(usage) else [])
            # keep the last row free: a frame as tall as the terminal scrolls it by one
            if height is None or _lines(Group(*parts, *tail), width) < height:
                break
        parts += tail
    elif server.get("tenant_bytes") is not None:
        held = format_size(server["tenant_bytes"], "readable")
        parts.append(Text(f"tenant {server.get('tenant') or '(default)'}: {held}"))
    return Group(*parts)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore top", description="live view of a running kvstore daemon")
    p.add_argument("--url", help="daemon HOST:PORT (default: the client's default)")
    p.add_argument("--token", default=os.environ.get("KVSTORE_TOKEN"), help="bearer token (or KVSTORE_TOKEN)")
    p.add_argument("--root-ca", help="CA certificate for a TLS daemon")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between polls (default 1)")
    p.add_argument("--once", action="store_true", help="print one frame and exit")
    p.add_argument("--json", action="store_true", help="print one frame's numbers as JSON and exit")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.once = args.once or args.json
    console = Console()
    from kvstore.client import Client
    try:
        client = Client(args.url, token=args.token, timeout_s=max(2.0, args.interval * 2), root_ca=args.root_ca)
    except KVStoreError as e:
        print(f"kvstore top: {e}", file=sys.stderr)
        return 2
    address = client.address
    try:
        prev, prev_t = client.stats(), time.monotonic()
        if args.once:
            if args.interval > 0:
                time.sleep(args.interval)
                now, now_t = client.stats(), time.monotonic()
                frame = (now, prev, now_t - prev_t)
            else:
                frame = (prev, None, None)
            if args.json:
                print(json.dumps(view(*frame), indent=2, sort_keys=True))
            else:
                console.print(render(*frame, address=address, width=console.width,
                                     height=console.height if console.is_terminal else None))
            return 0
        with Live(render(prev, address=address, width=console.width, height=console.height), console=console,
                  refresh_per_second=4, screen=False) as live:
            while True:
                time.sleep(args.interval)
                now, now_t = client.stats(), time.monotonic()
                live.update(render(now, prev, now_t - prev_t, address, width=console.width, height=console.height))
                prev, prev_t = now, now_t
    except DaemonUnavailable as e:
        print(f"kvstore top: daemon at {address} unavailable: {e}", file=sys.stderr)
        return 1
    except KVStoreError as e:   # e.g. a missing or unknown token
        print(f"kvstore top: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
