"""kvstore's own paths at two commits, in one run: is any block size slower than before?

    .venv/bin/python benchmarks/bench_ab.py --baseline b072a05     # writes results/peers_ab.{json,md}

Each commit measures itself with its own ``benchmarks/bench_peers.py`` (kvstore's paths and the
ceilings only, ``--peers ''``): the baseline from a detached git worktree of ``--baseline``
installed into a venv of its own (its dependencies taken from this venv), the current code from
this checkout. The runs alternate baseline, current, current, baseline (``--rounds`` such
quartets), so a steady drift of the host's speed cancels. Every path is compared as its ratio to the
ceiling its run measured beside it (memcpy, raw TCP, raw O_DIRECT), which takes out what the host
did between runs; a size counts as slower only when the current code's best run is below the
baseline's worst.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)

from kvstore.ops.machine import machine_facts  # noqa: E402
from kvstore.ops.report import machine_line, run_or_render, write_report  # noqa: E402

PATHS = ("kv_shm", "kv_bulk", "kv_grpc", "kv_nvme", "kv_cpu")
OPS = ("put", "get")


def baseline_python(rev: str, work: str) -> tuple[str, str]:
    """A python that imports kvstore as it was at ``rev``, and that tree: a detached worktree
    with a venv whose site-packages hold only that kvstore (installed without dependencies) and
    a path file onto this venv's, where the dependencies come from."""
    tree = os.path.join(work, "baseline")
    subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", tree, rev], check=True, capture_output=True)
    venv = os.path.join(work, "venv")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    python = os.path.join(venv, "bin", "python")
    own = subprocess.run([python, "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    with open(os.path.join(own, "zz_dependencies.pth"), "w") as f:
        f.write("\n".join(site.getsitepackages()) + "\n")
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", tree], check=True)
    return python, tree


def one_run(python: str, tree: str, out: str, sizes: str, total: str, disk_total: str) -> dict:
    """``bench_peers.py`` of ``tree`` under ``python``, kvstore's paths only; its JSON report."""
    t0 = time.monotonic()
    subprocess.run([python, os.path.join(tree, "benchmarks", "bench_peers.py"), "--peers", "", "--sizes", sizes,
                    "--total", total, "--disk-total", disk_total, "--out", out], check=True, cwd=tree,
                   stdout=subprocess.DEVNULL)
    with open(out + ".json") as f:
        report = json.load(f)
    report["wall_s"] = time.monotonic() - t0
    return report


def ratios(report: dict) -> dict:
    """path -> size -> op -> the path's GB/s over its ceiling in that run."""
    out: dict = {}
    for size, paths in report["results"].items():
        for path in PATHS:
            row = paths.get(path)
            if row:
                for op in OPS:
                    out.setdefault(path, {}).setdefault(size, {})[op] = row[f"{op}_vs_ceiling"]
    return out


def compare(runs: dict[str, list[dict]]) -> list[dict]:
    rows = []
    base, cur = [ratios(r) for r in runs["baseline"]], [ratios(r) for r in runs["current"]]
    for path in PATHS:
        for size in runs["current"][0]["sizes"]:
            for op in OPS:
                b = [r[path][size][op] for r in base if path in r and size in r[path]]
                c = [r[path][size][op] for r in cur if path in r and size in r[path]]
                if b and c:
                    rows.append({"path": path, "size": size, "op": op, "baseline": b, "current": c,
                                 "change": (sum(c) / len(c)) / (sum(b) / len(b)), "slower": max(c) < min(b)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="the commit to compare with (e.g. b072a05)")
    ap.add_argument("--rounds", type=int, default=1, help="quartets of runs: baseline, current, current, baseline")
    ap.add_argument("--sizes", default="64KiB,1MiB,16MiB")
    ap.add_argument("--total", default="256MiB", help="bytes moved per pass (memory and network paths)")
    ap.add_argument("--disk-total", default="128MiB", help="bytes moved per pass by the disk paths")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "peers_ab"))
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="bench-ab-")
    commit = subprocess.run(["git", "-C", REPO, "rev-parse", "HEAD"], check=True, capture_output=True,
                            text=True).stdout.strip()
    baseline = subprocess.run(["git", "-C", REPO, "rev-parse", a.baseline], check=True, capture_output=True,
                              text=True).stdout.strip()
    load_start = os.getloadavg()
    try:
        python, tree = baseline_python(baseline, work)
        who = {"baseline": (python, tree), "current": (sys.executable, REPO)}
        runs: dict[str, list[dict]] = {"baseline": [], "current": []}
        for r in range(a.rounds):
            for i, name in enumerate(("baseline", "current", "current", "baseline")):
                print(f"round {r + 1}: {name}", flush=True)
                runs[name].append(one_run(*who[name], os.path.join(work, f"{name}-{r}-{i}"), a.sizes,
                                          a.total, a.disk_total))
        report = {"benchmark": "peers_ab", "baseline": baseline, "current": commit, "sizes": a.sizes.split(","),
                  "rounds": a.rounds, "total": a.total, "disk_total": a.disk_total, "machine": machine_facts(), "load_start": load_start,
                  "load_end": os.getloadavg(), "runs": runs, "rows": compare(runs)}
        write_report(a.out, report, markdown)
    finally:
        subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", os.path.join(work, "baseline")],
                       capture_output=True)
        shutil.rmtree(work, ignore_errors=True)


def markdown(r: dict) -> str:
    names = {"kv_shm": "same-host shared memory (x memcpy)", "kv_bulk": "side channel (x raw TCP)",
             "kv_grpc": "gRPC streams (x raw TCP)", "kv_nvme": "NVMe tier, in-process (x raw O_DIRECT)",
             "kv_cpu": "CPU tier, in-process (x memcpy)"}
    runs = len(r["runs"]["current"])
    lines = [f"# kvstore at {r['current'][:7]} against {r['baseline'][:7]}, one run (`benchmarks/bench_ab.py`)", "",
             f"`python benchmarks/bench_ab.py --baseline {r['baseline'][:7]} --rounds {r['rounds']}` "
             f"({r.get('total', '256MiB')} per pass, {r.get('disk_total', '128MiB')} for the disk paths): each commit's own "
             "`bench_peers.py` (kvstore's paths and the ceilings, no peers), run alternately baseline, current, "
             f"current, baseline ({runs} runs each). Each figure is the path's GB/s over the ceiling measured beside "
             "it in the same run (put / get); `slower` = the current code's best run below the baseline's worst.", "",
             machine_line(r["machine"], load=(r["load_start"], r["load_end"])) + ".", "",
             "| path | size | op | baseline (each run) | current (each run) | current / baseline | slower |",
             "|---|---|---|---|---|---:|---|"]
    for row in r["rows"]:
        lines.append(f"| {names[row['path']]} | {row['size']} | {row['op']} | "
                     f"{', '.join(f'{x:.2f}' for x in row['baseline'])} | {', '.join(f'{x:.2f}' for x in row['current'])} | "
                     f"{row['change']:.2f}x | {'**yes**' if row['slower'] else 'no'} |")
    slower = [row for row in r["rows"] if row["slower"]]
    lines += ["", f"{len(slower)} of {len(r['rows'])} path, size and op pairs slower than the baseline"
              + (": " + ", ".join(f"{row['path']} {row['size']} {row['op']}" for row in slower) if slower else "")
              + ".", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    run_or_render(main, markdown)
