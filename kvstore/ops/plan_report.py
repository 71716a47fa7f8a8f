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


def plot(results: list[dict], path: str, title: str) -> None:
    """One workload: miss-ratio curves (hit rate vs CPU capacity, per NVMe size / codec / policy)
    and TTFT percentiles vs capacity. Several: one hit-rate panel per workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_workload: dict[str, list[dict]] = {}
    for r in results:
        by_workload.setdefault(r.get("workload", "").partition(":")[0], []).append(r)
    if len(by_workload) > 1:
        fig, axes = plt.subplots(1, len(by_workload), figsize=(4.2 * len(by_workload), 4.5), squeeze=False)
        for ax, (workload, rows) in zip(axes[0], by_workload.items()):
            _hit_curves(ax, rows, plt)
            ax.set(xlabel="CPU tier capacity (GiB)", ylabel="block hit rate", title=workload, ylim=(0, 1))
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    else:
        fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(13, 5))
        _hit_curves(ax_hit, results, plt, ax_ttft)
        ax_hit.set(xlabel="CPU tier capacity (GiB)", ylabel="block hit rate", title="hit rate vs capacity",
                   ylim=(0, 1))
        ax_ttft.set(xlabel="CPU tier capacity (GiB)", ylabel="estimated TTFT (ms)",
                    title="TTFT percentiles vs capacity")
        for ax in (ax_hit, ax_ttft):
            ax.grid(alpha=0.3)
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _hit_curves(ax_hit, results: list[dict], plt, ax_ttft=None) -> None:
    """Hit rate (total, and from CPU when there is an NVMe tier) vs CPU capacity per policy / codec /
    NVMe size; TTFT p50/p99 on ``ax_ttft`` when given."""
    series: dict[tuple, list[dict]] = {}
    for r in results:
        series.setdefault((r["policy"], r["codec"], r["nvme_bytes"]), []).append(r)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((policy, codec, nvme), rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=lambda r: r["cpu_bytes"])
        x = [r["cpu_bytes"] / GiB for r in rs]
        color = colors[i % len(colors)]
        label = f"{policy}, {codec}, nvme {gib(nvme)}"
        ls = POLICY_STYLES.get(policy, ":")
        ax_hit.plot(x, [r["hit_rate"] for r in rs], ls, marker="o", color=color, label=f"{label}: total")
        if nvme:
            ax_hit.plot(x, [r["hit_rate_per_tier"].get("cpu", 0) for r in rs], ls, marker=".", color=color,
                        alpha=0.45, label=f"{label}: from cpu")
        if ax_ttft is not None:
            ax_ttft.plot(x, [r["ttft_ms"]["p50"] for r in rs], ls, marker="o", color=color, label=f"{label}: p50")
            ax_ttft.plot(x, [r["ttft_ms"]["p99"] for r in rs], ls, marker="^", color=color, alpha=0.6,
                         label=f"{label}: p99")
