"""Scenario 3, memory pressure: configurations the machine cannot hold are refused at start,
with a message that says what to change, instead of the daemon dying later.
"""

from __future__ import annotations

import contextlib
import os
import time

from kvstore.ops.local_daemon import start_local_daemon

from .common import Unsupported, tmpfs


# -- 3. memory pressure ----------------------------------------------------------------------------

def memory_refusals(workdir: str) -> dict:
    """Tiers larger than the machine: refused at start with a clear error, never an OOM kill."""
    import psutil

    out = {}
    ram = psutil.virtual_memory().total
    cases = [("cpu_bytes_over_ram", [], {"cpu_bytes": str(2 * ram)})]
    ctx = contextlib.ExitStack()
    try:
        small = ctx.enter_context(tmpfs("8m"))
        cases.append(("cpu_bytes_over_shm_dir", ["--shm-dir", small], {"cpu_bytes": "32MiB"}))
    except Unsupported as e:
        out["cpu_bytes_over_shm_dir"] = {"skipped": str(e)}
    with ctx:
        for name, flags, kw in cases:
            t0 = time.monotonic()
            try:
                d = start_local_daemon(os.path.join(workdir, name), *flags, timeout=60, **kw)
                out[name] = {"refused": False, "alive": d.alive()}
                d.kill()
            except RuntimeError as e:
                msg = str(e)
                first = msg.splitlines()[0]
                line = next((ln for ln in msg.splitlines() if "cannot start" in ln), first)
                code = int(first.split("exited with ")[1].split(":")[0]) if "exited with" in first else None
                out[name] = {"refused": True, "exit_code": code, "killed_by_signal": code is not None and code < 0,
                             "message": line.strip(), "seconds": round(time.monotonic() - t0, 2)}
    return out
