"""The compiled CPU kernels (``fast_cpu``, ``fast_rotated``, ``fast_kchan``, ``fast_t0``) are compiled in one
background thread, and the codecs use them only once every one is: until then they run the torch
reference, which gives the same bytes (tests/test_codecs.py checks), so no encode or decode waits
for the compiler.

Compiling every kernel takes ~30 s of CPU on a cold numba cache (a fresh install, an upgrade,
which invalidates the cache), loading them from the cache about a second: inside a call, either
could outlast a client's deadline. ``ready()`` starts the compile on first use; ``codecs.warm_up``
(the daemon calls it at start) waits for it.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)


class Kernel:
    """A numba function compiled for its one signature (one machine-code version and one on-disk
    cache entry for every layout), releasing the GIL. A direct call compiles it first if it must."""

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

    def __call__(self, *args):
        return (self.compiled or self.compile())(*args)


_KERNELS: list[Kernel] = []
_compiler: threading.Thread | None = None
_done = threading.Event()
_starting = threading.Lock()


def compile_all(wait: bool = True) -> None:
    """Compile every kernel (or load it from numba's on-disk cache) in one background thread,
    started by the first call; ``wait``: until it is done (or has failed, logged)."""
    global _compiler
    with _starting:
        if _compiler is None:
            _compiler = threading.Thread(target=_compile_every_kernel, name="kvstore-codec-compiler", daemon=True)
            _compiler.start()
    if wait:
        _compiler.join()


def ready() -> bool:
    """Whether every kernel is compiled; the first call starts compiling them (``compile_all``)."""
    if not _done.is_set():
        compile_all(wait=False)
    return _done.is_set()


def _compile_every_kernel() -> None:
    try:
        from kvstore.codecs import fast_cpu, fast_kchan, fast_rotated, fast_t0  # noqa: F401 - importing lists their kernels
        for k in _KERNELS:
            k.compile()
    except Exception:  # noqa: BLE001 - the torch reference computes the same bytes, only slower
        log.exception("compiling the codec kernels failed: the codecs run their torch reference")
        return
    _done.set()
