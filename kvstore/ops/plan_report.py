"""What a plan run leaves behind: the markdown summary, the console table and the curves.

Everything here reads the JSON-able report ``kvstore plan`` writes (one dict per replayed
candidate, see ``ReplayResult.summary``), so a report can be re-rendered without replaying.
"""

from __future__ import annotations

import json

from kvstore.units import GiB


def gib(n: int) -> str:
    """Sizes as the plan tables show them (``16 GiB``, ``0``)."""
    return f"{n / GiB:g} GiB" if n else "0"


def write_markdown(report: dict, path: str) -> None:
    """A short human summary of a plan run (what benchmarks/results/plan_*.md hold)."""
    cm = report["cost_model"]
    lines = [f"# kvstore plan: {report['model']['model']}, `{report['workload']}`", "",
             f"Command: `{report.get('command', 'kvstore plan')}`", "",
             f"{report['requests']:,} requests, {report['blocks']:,} blocks of {report['model']['block_tokens']} tokens "
             f"({report['model']['block_bytes'] / 2**20:.2f} MiB raw); infinite-cache hit rate "
             f"{report['infinite_cache_hit_rate']:.1%}. Store config: `{json.dumps(report['store_config'])}`.", "",
             f"TTFT model: {cm['formula']}; bandwidth GB/s {cm['bandwidth_gbps']} ({cm['bandwidth_source']}), "
             f"prefill {cm['prefill_tok_s']:,.0f} tok/s ({cm['prefill_source']}), rpc {cm['rpc_ms']} ms.", "",
             "| policy | codec | cpu | nvme | hit cpu | hit nvme | hit total | loaded GB | put GB | demoted GB "
             "| promoted GB | NVMe written GB | TTFT p50 ms | p90 | p99 | replay s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in report["results"]:
        per = r["hit_rate_per_tier"]
        lines.append(
            f"| {r['policy']} | {r['codec']} | {gib(r['cpu_bytes'])} | {gib(r['nvme_bytes'])} | "
            f"{per.get('cpu', 0):.1%} | {per.get('nvme', 0):.1%} | {r['hit_rate']:.1%} | "
            f"{sum(r['bytes_loaded'].values()) / 1e9:.1f} | {r['bytes_written'] / 1e9:.1f} | "
            f"{r['bytes_demoted'] / 1e9:.1f} | {r['bytes_promoted'] / 1e9:.1f} | "
            f"{(r['bytes_placed'].get('nvme') or 0) / 1e9:.1f} | {r['ttft_ms']['p50']:.0f} | "
            f"{r['ttft_ms']['p90']:.0f} | {r['ttft_ms']['p99']:.0f} | {r['replay_seconds']:.0f} |")
    rec = report.get("recommendation")
    t = report.get("targets", {})
    if rec:
        lines += ["", f"Recommendation for target {t}: cpu {gib(rec['cpu_bytes'])}, nvme {gib(rec['nvme_bytes'])}, "
                      f"codec {rec['codec']}, policy {rec['policy']} (hit {rec['hit_rate']:.1%})."]
    facts = report.get("machine")
    if facts:
        lines += ["", f"Machine: `{json.dumps(facts)}`"]
    timing = report.get("timing", {})
    lines += ["", f"Timing: {timing}"]
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")


def render_table(results: list[dict], console) -> None:
    from rich.table import Table
    table = Table(title="kvstore plan: replay per candidate", show_lines=False)
    for col in ("policy", "codec", "cpu", "nvme", "hit cpu", "hit nvme", "hit total", "loaded GB",
                "demoted GB", "TTFT p50 ms", "p90", "p99"):
        table.add_column(col, justify="right" if col not in ("policy", "codec") else "left")
    for r in results:
        per = r["hit_rate_per_tier"]
        table.add_row(r["policy"], r["codec"], gib(r["cpu_bytes"]), gib(r["nvme_bytes"]),
                      f"{per.get('cpu', 0):.1%}", f"{per.get('nvme', 0):.1%}", f"{r['hit_rate']:.1%}",
                      f"{sum(r['bytes_loaded'].values()) / 1e9:.1f}", f"{r['bytes_demoted'] / 1e9:.1f}",
                      f"{r['ttft_ms']['p50']:.0f}", f"{r['ttft_ms']['p90']:.0f}", f"{r['ttft_ms']['p99']:.0f}")
    console.print(table)


def plot(results: list[dict], path: str, title: str) -> None:
    """Miss-ratio curves (hit rate vs CPU capacity, per NVMe size / codec / policy) and TTFT
    percentiles vs capacity."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_hit, ax_ttft) = plt.subplots(1, 2, figsize=(13, 5))
    series: dict[tuple, list[dict]] = {}
    for r in results:
        series.setdefault((r["policy"], r["codec"], r["nvme_bytes"]), []).append(r)
    styles = {"prefix": "-", "lru": "--"}
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, ((policy, codec, nvme), rs) in enumerate(sorted(series.items())):
        rs = sorted(rs, key=lambda r: r["cpu_bytes"])
        x = [r["cpu_bytes"] / GiB for r in rs]
        color = colors[i % len(colors)]
        label = f"{policy}, {codec}, nvme {gib(nvme)}"
        ls = styles.get(policy, ":")
        ax_hit.plot(x, [r["hit_rate"] for r in rs], ls, marker="o", color=color, label=f"{label}: total")
        if nvme:
            ax_hit.plot(x, [r["hit_rate_per_tier"].get("cpu", 0) for r in rs], ls, marker=".", color=color,
                        alpha=0.45, label=f"{label}: from cpu")
        ax_ttft.plot(x, [r["ttft_ms"]["p50"] for r in rs], ls, marker="o", color=color, label=f"{label}: p50")
        ax_ttft.plot(x, [r["ttft_ms"]["p99"] for r in rs], ls, marker="^", color=color, alpha=0.6,
                     label=f"{label}: p99")
    ax_hit.set(xlabel="CPU tier capacity (GiB)", ylabel="block hit rate", title="hit rate vs capacity", ylim=(0, 1))
    ax_ttft.set(xlabel="CPU tier capacity (GiB)", ylabel="estimated TTFT (ms)", title="TTFT percentiles vs capacity")
    for ax in (ax_hit, ax_ttft):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
