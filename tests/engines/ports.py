"""Port helpers for the engine-side check scripts (``sglang_hicache.py``, ``lmcache_l2.py``).

Those scripts run as ``python tests/engines/<script>.py`` inside an engine venv, so this
directory is ``sys.path[0]`` there and ``from ports import closed_port`` needs no path edits;
tests import it the same way (conftest puts tests/engines/ on ``sys.path``). Standard library only:
it must import in every engine venv.
"""

from __future__ import annotations

import socket


def closed_port() -> int:
    """A loopback port nothing listens on (bound once, then released): a daemon that is down, or
    a free port to hand to something that will bind it."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port
