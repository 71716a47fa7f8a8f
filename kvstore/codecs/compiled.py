"""The compiled CPU kernels (``fast_cpu``, ``fast_rotated``, ``fast_kchan``, ``fast_t0``) are compiled
in a child process, which fills numba's on-disk cache (``NUMBA_CACHE_DIR``, else ``__pycache__``
beside the sources); this process then loads them from that cache in one background thread, and
the codecs use them only once every one is: until then they run the torch reference, which gives
the same bytes (tests/test_codecs.py checks), so no encode or decode waits for the compiler.

Compiling every kernel takes ~30 s of CPU on a cold numba cache (a fresh install, an upgrade,
which invalidates the cache), loading them from the cache under a second. Numba holds the GIL
through most of a compile: in a daemon's own thread it made every request wait (the p99 of small
puts rose 4-20x for as long); in the child it costs the daemon nothing but a core. If the child
fails (killed, out of memory, no numba there), this process compiles them itself, as it would
without a child, and says so once in the log. ``ready()`` starts all this on first use;
``compile_all(wait=True)`` (``codecs.warm_up``) waits for it.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
import subprocess
import sys
import threading
import time

log = logging.getLogger(__name__)

#: seconds the child may take: ~30 s of CPU, minutes of wall time on a loaded host
CHILD_TIMEOUT_S = 1200.0


class Kernel:
    """A numba function compiled for its one signature (one machine-code version and one on-disk
    cache entry for every layout), releasing the GIL. A direct call compiles it first if it must
    (from numba's cache when the child has filled it)."""

    _lock = threading.Lock()   # each kernel compiled once, by whichever thread comes first

    def __init__(self, fn, signature) -> None:
        self.fn, self.signature, self.compiled = fn, signature, None
        self.__name__ = fn.__name__
        _KERNELS.append(self)

    def compile(self):
        with self._lock:
            if self.compiled is None:
                from numba import njit   # (only reached where numba is installed: a kernel module imported it)
                self.compiled = njit(self.signature, cache=True, nogil=True, error_model="numpy")(self.fn)
        return self.compiled

    def compiled_anew(self) -> bool:
        """Whether this process compiled the kernel rather than loading it from numba's cache."""
        stats = getattr(self.compiled, "stats", None)
        return bool(stats is not None and sum(stats.cache_misses.values()))

    def __call__(self, *args):
        return (self.compiled or self.compile())(*args)


_KERNELS: list[Kernel] = []
_compiler: threading.Thread | None = None
_done = threading.Event()
_starting = threading.Lock()


def compile_all(wait: bool = True) -> None:
    """Compile every kernel in a child process and load them here from numba's cache, in one
    background thread started by the first call; ``wait``: until it is done (or has failed, logged)."""
    global _compiler
    with _starting:
        if _compiler is None:
            child = _start_child()
            _compiler = threading.Thread(target=_compile_every_kernel, args=(child,),
                                         name="kvstore-codec-compiler", daemon=True)
            _compiler.start()
    if wait:
        _compiler.join()


def ready() -> bool:
    """Whether every kernel is compiled; the first call starts compiling them (``compile_all``)
    where numba is installed (without it, never: the torch reference is complete on its own)."""
    if not _done.is_set() and _numba_installed():
        compile_all(wait=False)
    return _done.is_set()


@functools.cache
def _numba_installed() -> bool:
    return importlib.util.find_spec("numba") is not None


def _start_child() -> subprocess.Popen | None:
    """The child compiling every kernel into numba's cache (this interpreter, this ``sys.path``:
    the same source files, so the same cache entries), or None if it cannot start (logged).
    Logged before the call that started it returns (tests/daemon_util.py reads the line)."""
    try:
        child = subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(sys.path), str(os.getpid())],
                                 stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, close_fds=True)
    except OSError as e:
        log.warning("codec kernels: no child process to compile them (%s); compiling them in this process", e)
        return None
    log.info("codec kernels: compiling in child process %d (numba's cache: %s)", child.pid,
             os.environ.get("NUMBA_CACHE_DIR", "__pycache__ beside the sources"))
    return child


def _child_compiled(child: subprocess.Popen | None) -> bool:
    """Wait for the child (blocked in a system call: the GIL free); whether it compiled every
    kernel. A failure is logged once, with the end of what the child wrote."""
    if child is None:
        return False
    try:
        _, err = child.communicate(timeout=CHILD_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        child.kill()
        _, err = child.communicate()
    if child.returncode == 0:
        return True
    tail = err.decode(errors="replace").strip().splitlines()[-5:]
    log.warning("codec kernels: the child process compiling them failed (exit %s: %s); compiling them in "
                "this process", child.returncode, " | ".join(tail) or "no output")
    return False


def _compile_every_kernel(child: subprocess.Popen | None) -> None:
    t0 = time.monotonic()
    in_child = _child_compiled(child)
    try:
        _compile_listed()
    except Exception:  # noqa: BLE001 - the torch reference computes the same bytes, only slower
        log.exception("compiling the codec kernels failed: the codecs run their torch reference")
        return
    anew = [k.__name__ for k in _KERNELS if k.compiled_anew()]
    if in_child and anew:
        log.warning("codec kernels: %d were not in numba's cache after the child compiled them (%s): compiled "
                    "in this process", len(anew), ", ".join(anew[:3]))
    _done.set()
    log.info("codec kernels ready in %.1fs (%s)", time.monotonic() - t0,
             "compiled in this process" if anew else "loaded from numba's cache")


#: the child's program (argv: the parent's ``sys.path`` as JSON, the parent's pid). It exits (3) as
#: soon as the parent has gone (nobody would load what it compiles), and imports the kernel modules
#: without running ``kvstore.codecs``'s ``__init__``, which imports torch: 11 s of a child's start
#: at load 16 on 2 cores, against 1.4 s for kvstore, numba and the kernel modules.
_CHILD = """
import importlib.util, json, os, sys, threading, time
def orphaned(parent=int(sys.argv[2])):
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(3)
threading.Thread(target=orphaned, daemon=True).start()
sys.path[:] = json.loads(sys.argv[1])
sys.modules["kvstore.codecs"] = importlib.util.module_from_spec(importlib.util.find_spec("kvstore.codecs"))
from kvstore.codecs import compiled
compiled.child_main()
"""


def child_main() -> None:
    """The child's work: compile every kernel into numba's cache (exit 0 then)."""
    _compile_listed()


def _compile_listed() -> None:
    """Compile (or load from numba's cache) every kernel of the kernel modules, which list them
    as they are imported: one list for this process and the child, so both hold the same set."""
    from kvstore.codecs import fast_cpu, fast_kchan, fast_rotated, fast_t0  # noqa: F401 - lists their kernels
    for k in _KERNELS:
        k.compile()
