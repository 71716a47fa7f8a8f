"""The sizing planner: metadata-only replay == real store, outputs, recommendations, trace errors,
policies compared across workloads, a table that fits 80 columns."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kvstore.ops import plan, workload
from kvstore.keys import ChainHasher, KVLayout
from kvstore.store import StoreConfig
from kvstore.tiers.cpu import CpuTier
from kvstore.tiers.metadata import MetadataTier
from kvstore.tiers.nvme import NvmeTier

# 2 layers x 2 (K,V) x 16 tokens x 1 head x 16 dim x 2 bytes = 2 KiB blocks
TINY = KVLayout(model="tiny", num_layers=2, num_kv_heads=1, head_dim=16, dtype="float16", block_tokens=16)
SLOT = 4096
CHAT = "chat:system_prompts=3,system_tokens=64,user_tokens=16,reply_tokens=16,turns=6,rate=4,think_s=2"


def tiny_requests(n=200, spec=CHAT):
    return list(workload.generate(spec, TINY.block_tokens, requests=n, seed=7))


@pytest.mark.parametrize("policy,write_through,lease", [("prefix", False, 5.0), ("lru", False, 5.0),
                                                        ("prefix", True, 0.0), ("s3fifo", False, 5.0),
                                                        ("cpu=s3fifo+nvme=lru", False, 5.0)])
def test_metadata_replay_agrees_exactly_with_real_store(tmp_path, policy, write_through, lease):
    reqs = tiny_requests()
    cpu_bytes, nvme_bytes = 20 * SLOT, 90 * 8192  # 20 CPU slots; 90 NVMe files (4 KiB header + 4 KiB)
    cand = plan.Candidate(policy, "raw", cpu_bytes, nvme_bytes)
    config = StoreConfig(write_through=write_through, lease_seconds=lease)

    real_tiers = [CpuTier(cpu_bytes, slot_bytes=SLOT), NvmeTier(str(tmp_path / "nvme"), nvme_bytes)]
    real = plan.replay(reqs, TINY, cand, config=config, tiers=real_tiers, keep_hit_tiers=True)
    for t in real_tiers:
        t.close()
    meta = plan.replay(reqs, TINY, cand, config=config, slot_bytes=SLOT, keep_hit_tiers=True)

    # the trace exercises every path: hits in both tiers, demotions, evictions, promotions
    assert real.hit_blocks["cpu"] > 0 and real.hit_blocks["nvme"] > 0
    assert real.counters.get("evictions", 0) > 0 and real.counters.get("promotions", 0) > 0
    assert real.counters.get("demotions", 0) > 0 or write_through  # write-through: already on NVMe
    assert real.hit_tiers == meta.hit_tiers          # per request, per tier
    assert real.hit_blocks == meta.hit_blocks
    assert real.miss_blocks == meta.miss_blocks
    for name in ("hits_cpu", "hits_nvme", "misses", "puts", "demotions", "evictions", "promotions"):
        assert real.counters.get(name, 0) == meta.counters.get(name, 0), name


def test_metadata_tier_accounts_like_the_real_tiers(tmp_path):
    nvme = NvmeTier(str(tmp_path), 1 << 20)
    meta = MetadataTier.like_nvme(1 << 20)
    for n in (1, 4096, 4097, 300_000):
        assert meta.footprint(n) == nvme.footprint(n)
    cpu = CpuTier(10 * SLOT + 100, slot_bytes=SLOT)
    mcpu = MetadataTier.like_cpu(10 * SLOT + 100, SLOT)
    assert mcpu.capacity_bytes == cpu.capacity_bytes
    for n in (1, SLOT, SLOT + 1):
        assert mcpu.footprint(n) == cpu.footprint(n)
    cpu.close()
    meta.close()


def _cli(tmp_path, *extra):
    out = tmp_path / "plan"
    argv = ["--model", str(_write_config(tmp_path)), "--block-tokens", "16", "--workload", CHAT,
            "--requests", "300", "--cpu", "40KiB,80KiB,160KiB", "--nvme", "0,400KiB", "--codec", "raw,fp8",
            "--policy", "prefix,lru", "--bandwidth", "cpu=19,nvme=3", "--prefill-tok-s", "20000",
            "--cpu-slot-bytes", "512", "--jobs", "1", "--quiet", "--out", str(out), *extra]
    return argv, out


def _write_config(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 1,
                                "hidden_size": 64, "torch_dtype": "float16", "_name_or_path": "tiny/model"}))
    return path


def test_cli_writes_json_and_png(tmp_path):
    argv, out = _cli(tmp_path, "--target-hit-rate", "0.3")
    assert plan.main(argv) == 0
    report = json.loads((tmp_path / "plan.json").read_text())
    assert report["model"]["head_dim"] == 16 and report["model"]["num_kv_heads"] == 1
    assert len(report["results"]) == 3 * 2 * 2 * 2
    png = (tmp_path / "plan.png").read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000
    # fp8 stores ~half the bytes (in 512-byte slots: 3 instead of 4), so the same RAM holds more blocks
    by = {(r["policy"], r["codec"], r["cpu_bytes"], r["nvme_bytes"]): r for r in report["results"]}
    assert any(by[("prefix", "fp8", c, 0)]["hit_rate"] > by[("prefix", "raw", c, 0)]["hit_rate"]
               for c in (40 << 10, 80 << 10, 160 << 10))
    rec = report["recommendation"]
    assert rec is not None and rec["hit_rate"] >= 0.3


def test_recommendations_are_monotone_in_the_target(tmp_path):
    argv, _ = _cli(tmp_path)
    report = plan.run(plan.build_parser().parse_args(argv))
    results = report["results"]
    best = max(r["hit_rate"] for r in results)
    costs = []
    for target in [0.0, 0.1, 0.2, 0.3, 0.4, 0.5, best]:
        rec = plan.recommend(results, target_hit_rate=target)
        assert rec is not None and rec["hit_rate"] >= target
        # nothing cheaper reaches the target
        cheaper = [r for r in results if r["cpu_bytes"] / 2**30 + r["nvme_bytes"] / 2**30 * 0.05 < rec["cost"]]
        assert all(r["hit_rate"] < target for r in cheaper)
        costs.append(rec["cost"])
    assert costs == sorted(costs) and costs[-1] > costs[0]
    assert plan.recommend(results, target_hit_rate=best + 0.01) is None
    ttft_costs = [plan.recommend(results, target_ttft_ms=t)["cost"]
                  for t in sorted({r["ttft_ms"]["p90"] for r in results}, reverse=True)]
    assert ttft_costs == sorted(ttft_costs)


def test_malformed_trace_line_is_named(tmp_path, capsys):
    path = tmp_path / "trace.jsonl"
    path.write_text('{"t": 0, "prefix": [["sys", 64]]}\n\n{"t": 1, "tokens": [1, 2, 3]}\n'
                    '{"t": 2, "prefix": [["sys", "many"]]}\n')
    with pytest.raises(workload.TraceError) as e:
        list(workload.read_trace(str(path), 16))
    assert e.value.line == 4 and ":4:" in str(e.value)
    path.write_text('{"t": 0, "tokens": [1, 2]}\n{"t": 1, tokens: [1]}\n')
    argv, _ = _cli(tmp_path)
    argv[argv.index("--workload") + 1] = str(path)
    assert plan.main(argv) == 2
    assert "trace.jsonl:2: not JSON" in capsys.readouterr().err


def test_trace_hashes_tokens_like_the_store_and_shares_prefix_groups(tmp_path):
    tokens = list(range(40))
    path = tmp_path / "t.jsonl"
    workload.write_trace(str(path), [
        {"t": 0, "tokens": tokens},
        {"t": 1, "prefix": [["sys", 40], ["conv-1", 30]]},
        {"t": 2, "prefix": [["sys", 40], ["conv-1", 50]]},
        {"t": 3, "prefix": [["sys", 40], ["conv-2", 50]]},
    ])
    a, b, c, d = workload.read_trace(str(path), 16)
    assert a.hash_list() == ChainHasher().chain(tokens, 16) and a.tokens == 40
    assert (b.num_blocks, c.num_blocks, d.num_blocks) == (4, 5, 5)
    assert c.hash_list()[:4] == b.hash_list()          # a longer turn extends the same chain
    assert d.hash_list()[:2] == c.hash_list()[:2]      # blocks wholly inside the shared group
    assert d.hash_list()[2] != c.hash_list()[2]        # block 2 mixes "sys" with a different group


SYSPROMPT = "sysprompt:system_prompts=4,system_tokens=64,user_tokens=16"


def test_policies_compared_across_workloads(tmp_path):
    argv, out = _cli(tmp_path, "--workload", SYSPROMPT, "--target-hit-rate", "0.2")
    argv[argv.index("--policy") + 1] = "prefix,lru,s3fifo"
    argv[argv.index("--codec") + 1] = "raw"
    report = plan.run(plan.build_parser().parse_args(argv))
    assert [w["workload"] for w in report["workloads"]] == [CHAT, SYSPROMPT]
    assert all(w["requests"] == 300 and w["recommendation"] is not None for w in report["workloads"])
    assert "workload" not in report and report["recommendation"] is None   # only for a single workload
    per_workload = 3 * 3 * 2                                                 # policies x cpu x nvme
    assert len(report["results"]) == 2 * per_workload
    for spec in (CHAT, SYSPROMPT):
        rows = [r for r in report["results"] if r["workload"] == spec]
        assert {r["policy"] for r in rows} == {"prefix", "lru", "s3fifo"} and len(rows) == per_workload
        assert all(0 < r["hit_rate"] <= 1 for r in rows)
    md = (tmp_path / "plan.md").read_text()
    assert "| workload | policy |" in md and "| sysprompt | s3fifo |" in md and "| chat | lru |" in md


def _plan_subprocess(tmp_path, *extra):
    argv, _ = _cli(tmp_path, *extra)
    argv.remove("--quiet")
    env = {**os.environ, "COLUMNS": "80"}
    return subprocess.run([sys.executable, "-m", "kvstore.ops.cli", "plan", *argv], capture_output=True, text=True,
                          timeout=300, env=env, cwd=tmp_path)


def test_table_fits_80_columns_when_piped(tmp_path):
    out = _plan_subprocess(tmp_path, "--workload", SYSPROMPT, "--target-hit-rate", "0.3")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "kvstore plan: replay per candidate" in out.stdout and "s3fifo" not in out.stdout
    assert any(line.split()[:4] == ["prefix", "fp8", "40KiB", "400KiB"] for line in lines)  # whole cells
    assert max(len(line) for line in lines) <= 80, [line for line in lines if len(line) > 80]
    assert "…" not in out.stdout


def test_json_output(tmp_path):
    out = _plan_subprocess(tmp_path, "--json", "--policy", "s3fifo")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert {r["policy"] for r in report["results"]} == {"s3fifo"} and report["workload"] == CHAT


def test_a_policy_per_tier(tmp_path, capsys):
    argv, _ = _cli(tmp_path)
    argv[argv.index("--policy") + 1] = "s3fifo,lru,cpu=s3fifo+nvme=lru,cpu=lru+nvme=s3fifo"
    argv[argv.index("--codec") + 1] = "raw"
    report = plan.run(plan.build_parser().parse_args(argv))
    by = {(r["policy"], r["cpu_bytes"], r["nvme_bytes"]): r["hit_blocks"] for r in report["results"]}
    assert len(by) == 4 * 3 * 2
    for cpu in (40 << 10, 80 << 10, 160 << 10):
        # without an NVMe tier only the CPU tier's policy plays: the replay used it
        assert by[("cpu=s3fifo+nvme=lru", cpu, 0)] == by[("s3fifo", cpu, 0)]
        assert by[("cpu=lru+nvme=s3fifo", cpu, 0)] == by[("lru", cpu, 0)]
    # with one, the candidate is its own: a Store built with that mapping gives the same figures
    cand = plan.Candidate("cpu=s3fifo+nvme=lru", "raw", 40 << 10, 400 << 10)
    direct = plan.replay(list(workload.generate(CHAT, 16, requests=300, seed=0)), plan.load_model(
        argv[argv.index("--model") + 1], 16)[0], cand, config=StoreConfig(), slot_bytes=512)
    assert direct.hit_blocks == by[("cpu=s3fifo+nvme=lru", 40 << 10, 400 << 10)]

    for bad, named in (("cpu=s3fifo+tape=lru", "unknown tier 'tape'"), ("cpu=fifo", "policy.cpu: "),
                       ("cpu=lru+cpu=s3fifo", "named twice"), ("fifo", "unknown policy 'fifo'")):
        argv[argv.index("--policy") + 1] = bad
        assert plan.main(argv) == 2
        assert named in capsys.readouterr().err


def _plan_rows(cpu_sizes, policies=("prefix", "lru")):
    """Result rows as ``kvstore plan`` writes them (hit rates and TTFTs made up for the picture)."""
    rows = []
    for i, policy in enumerate(policies):
        for j, cpu in enumerate(cpu_sizes):
            rows.append({"policy": policy, "codec": "raw", "cpu_bytes": cpu, "nvme_bytes": 0,
                         "hit_rate": 0.3 + 0.1 * j, "hit_rate_per_tier": {"cpu": 0.3 + 0.1 * j},
                         "ttft_ms": {"p50": 80.0 - j, "p90": 200.0 - 20 * j - i, "p99": 400.0, "mean": 90.0}})
    return rows


def test_picture_draws_the_optimised_percentile_and_the_targets():
    """The TTFT panel plots the percentile the planner optimises (p90 here), never only p50/p99; the
    targets are horizontal lines; the recommended candidate is marked."""
    from kvstore.ops.plan_report import figure

    rows = _plan_rows([8 << 30, 16 << 30, 32 << 30])
    fig = figure(rows, "t", percentile=90, target_ttft_ms=170, target_hit_rate=0.45, recommendation=rows[2])
    ax_hit, ax_ttft = fig.axes
    ttft_lines = {tuple(line.get_ydata()) for line in ax_ttft.get_lines()}
    assert (200.0, 180.0, 160.0) in ttft_lines                      # prefix's p90 per CPU size
    assert (170, 170) in ttft_lines and (0.45, 0.45) in {tuple(line.get_ydata()) for line in ax_hit.get_lines()}
    assert "recommended" in ax_ttft.get_legend_handles_labels()[1]
    assert [t.get_text() for t in ax_hit.get_xticklabels()] == ["8GiB", "16GiB", "32GiB"]   # evenly spaced
    # two series at one point are set apart, not drawn over each other
    xs = [tuple(line.get_xdata()) for line in ax_ttft.get_lines() if len(line.get_xdata()) == 3]
    assert len({x[0] for x in xs}) > 1


def test_picture_with_one_cpu_size_is_bars_per_candidate():
    from kvstore.ops.plan_report import figure

    rows = _plan_rows([8 << 30], policies=("prefix", "lru", "s3fifo"))
    fig = figure(rows, "t", percentile=99, target_ttft_ms=300)
    ax_hit, ax_ttft = fig.axes
    assert len(ax_hit.patches) == 3 and [p.get_height() for p in ax_ttft.patches] == [400.0] * 3   # p99 bars
    assert [t.get_text() for t in ax_hit.get_xticklabels()] == ["lru, raw", "prefix, raw", "s3fifo, raw"]
    assert (300, 300) in {tuple(line.get_ydata()) for line in ax_ttft.get_lines()}
