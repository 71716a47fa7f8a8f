"""What a plan run leaves behind: the markdown summary, the console table and the curves.

Everything here reads the JSON-able report ``kvstore plan`` writes (one dict per replayed
candidate, see ``ReplayResult.summary``), so a report can be re-rendered without replaying.
"""

from __future__ import annotations

import json

from kvstore.units import GiB, format_size


def gib(n: int) -> str:
    """Sizes as the plan tables show them (``16GiB``, ``40KiB``, ``0``)."""
    return format_size(n) if n else "0"


def _workload_lines(report: dict) -> list[str]:
    lines = []
    for w in report.get("workloads") or [report]:
        lines.append(f"- `{w['workload']}`: {w['requests']:,} requests, {w['blocks']:,} blocks; infinite-cache "
                     f"hit rate {w['infinite_cache_hit_rate']:.1%}.")
    return lines


def write_markdown(report: dict, path: str) -> None:
    """A short human summary of a plan run (what benchmarks/results/plan_*.md hold)."""
    cm = report["cost_model"]
    workloads = report.get("workloads") or [report]
    title = ", ".join(f"`{w['workload']}`" for w in workloads)
    many = len(workloads) > 1
    lines = [f"# kvstore plan: {report['model']['model']}, {title}", "",
             f"Command: `{report.get('command', 'kvstore plan')}`", "",
             f"Blocks of {report['model']['block_tokens']} tokens ({report['model']['block_bytes'] / 2**20:.2f} MiB "
             f"raw). Store config: `{json.dumps(report['store_config'])}`.", "", *_workload_lines(report), "",
             f"TTFT model: {cm['formula']}; bandwidth GB/s {cm['bandwidth_gbps']} ({cm['bandwidth_source']}), "
             f"prefill {cm['prefill_tok_s']:,.0f} tok/s ({cm['prefill_source']}), rpc {cm['rpc_ms']} ms.", "",
             "| " + ("workload | " if many else "") + "policy | codec | cpu | nvme | hit cpu | hit nvme | hit total "
             "| loaded GB | put GB | demoted GB | promoted GB | NVMe written GB | TTFT p50 ms | p90 | p99 | replay s |",
             "|---" * (16 + many) + "|"]
    for r in report["results"]:
        per = r["hit_rate_per_tier"]
        lines.append(
            "| " + (f"{r['workload'].partition(':')[0]} | " if many else "") +
            f"{r['policy']} | {r['codec']} | {gib(r['cpu_bytes'])} | {gib(r['nvme_bytes'])} | "
            f"{per.get('cpu', 0):.1%} | {per.get('nvme', 0):.1%} | {r['hit_rate']:.1%} | "
            f"{sum(r['bytes_loaded'].values()) / 1e9:.1f} | {r['bytes_written'] / 1e9:.1f} | "
            f"{r['bytes_demoted'] / 1e9:.1f} | {r['bytes_promoted'] / 1e9:.1f} | "
            f"{(r['bytes_placed'].get('nvme') or 0) / 1e9:.1f} | {r['ttft_ms']['p50']:.0f} | "
            f"{r['ttft_ms']['p90']:.0f} | {r['ttft_ms']['p99']:.0f} | {r['replay_seconds']:.0f} |")
    t = report.get("targets", {})
    for w in workloads:
        rec = w.get("recommendation")
        if rec:
            lines += ["", f"Recommendation for `{w['workload']}`, target {t}: cpu {gib(rec['cpu_bytes'])}, "
                          f"nvme {gib(rec['nvme_bytes'])}, codec {rec['codec']}, policy {rec['policy']} "
                          f"(hit {rec['hit_rate']:.1%})."]
    facts = report.get("machine")
    if facts:
        lines += ["", f"Machine: `{json.dumps(facts)}`"]
    timing = report.get("timing", {})
    lines += ["", f"Timing: {timing}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def render_table(results: list[dict], console) -> None:
    """The console tables, one per workload, narrow enough for an 80-column terminal or a pipe:
    the per-tier bytes live in the JSON and markdown. Cells wrap rather than being cut."""
    from rich import box
    from rich.table import Table
    by_workload: dict[str, list[dict]] = {}
    for r in results:
        by_workload.setdefault(r.get("workload", ""), []).append(r)
    for workload, rows in by_workload.items():
        title = "kvstore plan: replay per candidate" + (f", {workload}" if len(by_workload) > 1 else "")
        table = Table(title=title, box=box.SIMPLE_HEAD)
        per_tier = any("+" in r["policy"] for r in rows)   # room for "cpu=s3fifo+" on a line
        for col in ("policy", "codec", "cpu", "nvme", "hit", "from cpu", "TTFT p50 ms", "p90", "p99"):
            table.add_column(col, justify="left" if col in ("policy", "codec") else "right", overflow="fold",
                             min_width=11 if col == "policy" and per_tier else None)
        for r in rows:
            # a policy per tier ("cpu=s3fifo+nvme=lru") is shown one tier a line
            table.add_row(r["policy"].replace("+", "+\n"), r["codec"], gib(r["cpu_bytes"]), gib(r["nvme_bytes"]),
                          f"{r['hit_rate']:.1%}",
                          f"{r['hit_rate_per_tier'].get('cpu', 0):.1%}", f"{r['ttft_ms']['p50']:.0f}",
                          f"{r['ttft_ms']['p90']:.0f}", f"{r['ttft_ms']['p99']:.0f}")
        console.print(table)


POLICY_STYLES = {"prefix": "-", "lru": "--", "s3fifo": "-."}


MARKERS = "osD^vP*X"


def plot(results: list[dict], path: str, title: str, percentile: int = 90, target_ttft_ms: float | None = None,
         target_hit_rate: float | None = None, recommendation: dict | None = None) -> None:
    """One workload: hit rate and TTFT (the ``percentile`` the planner optimises, solid; p50 faint)
    per candidate series (policy / codec / NVMe size) against CPU capacity, with the targets drawn
    as dashed lines and the recommended candidate circled. Several workloads: one hit-rate panel
    each. The CPU sizes are evenly spaced categories (a sweep over 4 GiB..64 GiB stays readable),
    series sharing a point are set slightly apart, and a sweep of one CPU size becomes bars."""
    import matplotlib.pyplot as plt

    fig = figure(results, title, percentile, target_ttft_ms, target_hit_rate, recommendation)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def figure(results: list[dict], title: str, percentile: int = 90, target_ttft_ms: float | None = None,
           target_hit_rate: float | None = None, recommendation: dict | None = None):
    """``plot``'s matplotlib figure (the caller closes it)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_workload: dict[str, list[dict]] = {}
    for r in results:
        by_workload.setdefault(r.get("workload", "").partition(":")[0], []).append(r)
    p = f"p{percentile}"
    if len(by_workload) > 1:
        fig, axes = plt.subplots(1, len(by_workload), figsize=(4.6 * len(by_workload), 4.8), squeeze=False)
        for ax, (workload, rows) in zip(axes[0], by_workload.items()):
            _panels(rows, plt, ax, None, p, target_ttft_ms, target_hit_rate, None)
            ax.set_title(workload)
    else:
        fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(13, 5.2))
        _panels(results, plt, ax_hit, ax_ttft, p, target_ttft_ms, target_hit_rate, recommendation)
        one_size = len({r["cpu_bytes"] for r in results}) == 1
        what = "per candidate (recommended: outlined)" if one_size else "vs CPU capacity (recommended: circled)"
        ax_hit.set_title(f"hit rate {what}", fontsize=10)
        ax_ttft.set_title(f"estimated TTFT {p}, optimised ({'p50: black tick' if one_size else 'p50: faint'})",
                          fontsize=10)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return fig


def _series(results: list[dict]) -> dict[tuple, list[dict]]:
    series: dict[tuple, list[dict]] = {}
    for r in results:
        series.setdefault((r["policy"], r["codec"], r["nvme_bytes"]), []).append(r)
    return dict(sorted(series.items()))


def _panels(results: list[dict], plt, ax_hit, ax_ttft, p: str, target_ttft_ms, target_hit_rate, rec) -> None:
    series = _series(results)
    sizes = sorted({r["cpu_bytes"] for r in results})
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    axes = [ax for ax in (ax_hit, ax_ttft) if ax is not None]
    if len(sizes) == 1:
        _bars(series, colors, ax_hit, ax_ttft, p, rec)
        for ax in axes:
            ax.set_xlabel(f"candidate (CPU tier {gib(sizes[0])})")
    else:
        _lines(series, sizes, colors, ax_hit, ax_ttft, p, rec)
        for ax in axes:
            ax.set_xticks(range(len(sizes)), [gib(s) for s in sizes])
            ax.set_xlabel("CPU tier capacity")
    ax_hit.set(ylabel="block hit rate", ylim=(0, 1.02))
    if target_hit_rate is not None:
        ax_hit.axhline(target_hit_rate, color="black", ls="--", lw=1, label=f"target hit rate {target_hit_rate:.0%}")
    if ax_ttft is not None:
        ax_ttft.set_ylabel(f"estimated TTFT {p} (ms)")
        ax_ttft.set_ylim(bottom=0)
        if target_ttft_ms is not None:
            ax_ttft.axhline(target_ttft_ms, color="black", ls="--", lw=1, label=f"target {p} {target_ttft_ms:g} ms")
    for ax in axes:
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[1]:
            ax.legend(fontsize=7, loc="best")


def _label(policy: str, codec: str, nvme: int) -> str:
    return f"{policy}, {codec}" + (f", nvme {gib(nvme)}" if nvme else "")


def _is(rec: dict | None, r: dict) -> bool:
    return rec is not None and all(rec.get(k) == r[k] for k in ("policy", "codec", "cpu_bytes", "nvme_bytes"))


def _lines(series, sizes, colors, ax_hit, ax_ttft, p, rec) -> None:
    at = {s: i for i, s in enumerate(sizes)}
    spread = 0.12 / max(1, len(series) - 1) if len(series) > 1 else 0.0
    for i, ((policy, codec, nvme), rs) in enumerate(series.items()):
        rs = sorted(rs, key=lambda r: r["cpu_bytes"])
        x = [at[r["cpu_bytes"]] + (i - (len(series) - 1) / 2) * spread for r in rs]   # apart, not hidden
        color, marker, ls = colors[i % len(colors)], MARKERS[i % len(MARKERS)], POLICY_STYLES.get(policy, ":")
        label = _label(policy, codec, nvme)
        ax_hit.plot(x, [r["hit_rate"] for r in rs], ls, marker=marker, color=color, label=label)
        if nvme:
            ax_hit.plot(x, [r["hit_rate_per_tier"].get("cpu", 0) for r in rs], ls, marker=marker, color=color,
                        alpha=0.35, markersize=4, label=f"{label}: from cpu")
        if ax_ttft is not None:
            ax_ttft.plot(x, [r["ttft_ms"][p] for r in rs], ls, marker=marker, color=color, lw=2, label=label)
            ax_ttft.plot(x, [r["ttft_ms"]["p50"] for r in rs], ls, marker=marker, color=color, alpha=0.3,
                         markersize=4, lw=1)
        for xi, r in zip(x, rs):
            if _is(rec, r):
                ax_hit.plot([xi], [r["hit_rate"]], "o", ms=16, mfc="none", mec="black", mew=1.5, label="recommended")
                if ax_ttft is not None:
                    ax_ttft.plot([xi], [r["ttft_ms"][p]], "o", ms=16, mfc="none", mec="black", mew=1.5,
                                 label="recommended")


def _bars(series, colors, ax_hit, ax_ttft, p, rec) -> None:
    names = [_label(*key) for key in series]
    x = list(range(len(names)))
    rows = [rs[0] for rs in series.values()]
    face = [colors[i % len(colors)] for i in x]
    edges = ["black" if _is(rec, r) else face[i] for i, r in enumerate(rows)]
    ax_hit.bar(x, [r["hit_rate"] for r in rows], color=face, edgecolor=edges, linewidth=2)
    if ax_ttft is not None:
        ax_ttft.bar(x, [r["ttft_ms"][p] for r in rows], color=face, edgecolor=edges, linewidth=2)
        ax_ttft.plot(x, [r["ttft_ms"]["p50"] for r in rows], "_", color="black", ms=18, mew=2, label="p50")
    tilt = len(names) > 3
    for ax in (ax_hit, ax_ttft):
        if ax is not None:
            ax.set_xticks(x, names, rotation=20 if tilt else 0, ha="right" if tilt else "center", fontsize=8)
