"""The lines every benchmark result shares: the machine it ran on, and rendering a written result again."""

from __future__ import annotations

import os
import platform
import subprocess

from kvstore.ops.machine import code_changes, git_state, machine_facts
from kvstore.ops.report import machine_line, run_or_render, write_report


def test_machine_line_states_this_machine_and_the_load_given(tmp_path):
    m = machine_facts(str(tmp_path))
    line = machine_line(m, "numpy", directory=True, load=((0.46, 0.7, 0.9), 12.34))   # os.getloadavg(), a figure
    assert line.startswith(f"Machine: {m['cpu_model']}, {m['cores_usable']} usable cores, {m['ram_gib']} GiB RAM, ")
    assert f"kernel {platform.release()}, Python {platform.python_version()}, numpy {m['numpy']}" in line
    assert f"directory {tmp_path} on {m['dir_fs_type']}" in line
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    head = subprocess.run(["git", "-C", repo, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout
    assert m["kvstore_commit"].rstrip("+") == head.strip() and f"; kvstore at {m['kvstore_commit']}; " in line
    assert line.endswith("; load average 0.5 at start, 12.3 at end")


def test_a_result_names_the_commit_measured_and_marks_only_changes_to_code():
    """``+`` after the commit where tracked code has uncommitted changes; results and prose do not
    change what a benchmark measures."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    state = git_state()
    head = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    assert state["commit"] == head and head.startswith(state["short"])
    assert code_changes(["README.md", "docs/pd.md", "benchmarks/results/store-small.json", "tiers/cpu.py",
                         "benchmarks/bench_store.py"]) == ["tiers/cpu.py", "benchmarks/bench_store.py"]
    mark = "+" if code_changes(state["modified_tracked_files"]) else ""
    assert machine_facts()["kvstore_commit"] == state["short"] + mark


def test_machine_line_leaves_out_what_an_old_result_did_not_record():
    assert machine_line({"cpu_model": "X", "cores": 4, "ram_bytes": 2 * 2**30}) == (
        "Machine: X, 4 usable cores, 2.0 GiB RAM, kernel ?, Python ?")


def test_render_prints_the_markdown_of_a_written_result_and_runs_nothing(tmp_path, capsys):
    def markdown(r: dict) -> str:
        return f"# {r['title']}: {r['figure']:.2f}x\n"

    write_report(str(tmp_path / "res"), {"title": "copy", "figure": 0.8}, markdown, echo=False)
    ran = []
    run_or_render(lambda: ran.append(1), markdown, ["--render", str(tmp_path / "res.json")])
    assert capsys.readouterr().out == "# copy: 0.80x\n" and ran == []
    run_or_render(lambda: ran.append(1), markdown, [])
    assert ran == [1]
