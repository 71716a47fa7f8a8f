"""What a reader needs to interpret a measured number: the machine it was measured on.

Every report of ``kvstore bench`` and ``kvstore plan`` and every benchmark result carries these
facts, so a figure can be judged against the CPU, memory, filesystem and library versions that
produced it. Facts are gathered, never required: a probe that fails is reported as unknown.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time

import numpy as np

from kvstore.tiers.nvme import o_direct_supported  # the NVMe tier's own probe


def _fs_type(directory: str) -> str:
    try:
        out = subprocess.run(["stat", "-f", "-c", "%T", directory], capture_output=True, text=True,
                             timeout=5)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return 0


def _version(module: str) -> str | None:
    m = sys.modules.get(module)
    if m is None:
        try:
            m = __import__(module)
        except ImportError:
            return None
    return getattr(m, "__version__", getattr(m, "VERSION", "?"))


def git_state() -> dict | None:
    """The git checkout this kvstore was imported from: its commit (``commit``, ``short``) and
    its tracked files with uncommitted changes; None outside one. What a result measured."""
    import kvstore

    here = os.path.dirname(os.path.dirname(os.path.abspath(kvstore.__file__)))
    try:
        head = subprocess.run(["git", "-C", here, "rev-parse", "HEAD", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=10)
        changed = subprocess.run(["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
                                 capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if head.returncode != 0:
        return None
    commit, short = head.stdout.split()
    return {"commit": commit, "short": short,
            "modified_tracked_files": [line[3:] for line in changed.stdout.splitlines() if line[3:]]}


def code_changes(files: list[str]) -> list[str]:
    """Those of ``files`` that can change what a benchmark measures: not results, not prose."""
    return [f for f in files if not f.startswith("benchmarks/results/") and not f.endswith(".md")]


def _kvstore_commit() -> str | None:
    """``git_state``'s short commit, ``+`` after it where code in that checkout has uncommitted changes."""
    state = git_state()
    if state is None:
        return None
    return state["short"] + ("+" if code_changes(state["modified_tracked_files"]) else "")


def machine_facts(directory: str | None = None) -> dict:
    """CPU, cores, RAM, kernel, load, versions, the kvstore commit measured; with ``directory``,
    its filesystem and O_DIRECT."""
    facts = {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "ram_gib": round(_ram_bytes() / 2**30, 1),
        "ram_bytes": _ram_bytes(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": np.__version__,
        "load_avg_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "malloc_tuned": "MALLOC_MMAP_MAX_" in os.environ,
        "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "kvstore_commit": _kvstore_commit(),
    }
    if directory is not None:
        facts["dir"] = directory
        facts["dir_fs_type"] = _fs_type(directory)
        facts["dir_o_direct"] = o_direct_supported(directory)
    for module in ("grpc", "torch", "xxhash"):
        version = _version(module)
        if version is not None:
            facts["grpcio" if module == "grpc" else module] = version
    return facts
