"""Checks ``kvstore serve`` runs on its settings before it builds anything (``run_checks``): what
would otherwise fail late, or be silently wrong, is refused (``ConfigError``) or warned of now, in
one line naming the setting.
"""

from __future__ import annotations

import difflib
import errno
import os
import socket
from collections.abc import Iterator, Mapping

import psutil

from kvstore.service.config import ConfigError, Settings, existing_parent
from kvstore.units import format_size

#: ``KVSTORE_*`` variables that are read by something other than the daemon's settings
OTHER_VARIABLES = {"KVSTORE_CONFIG", "KVSTORE_URL", "KVSTORE_TOKEN", "KVSTORE_NO_REEXEC",
                   "KVSTORE_CODECS_REFERENCE", "KVSTORE_FLEET_REDIS_URL", "KVSTORE_FLEET_KEY_PREFIX",
                   "KVSTORE_DEPLOY_DIR", "KVSTORE_PROGRESS_EVERY_S"}
OTHER_PREFIXES = ("KVSTORE_VENV_",)   # scripts/engine-venv.sh, scripts/test.sh


def check_memory(settings: Settings) -> None:
    """Raise ``ConfigError`` naming ``cpu_bytes`` if the CPU tier is larger than the memory left
    (RAM available now, capped by a cgroup limit): the arena is allocated and touched up front,
    so it would take the host (or the daemon) down rather than fail later."""
    available = psutil.virtual_memory().available
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            current = int(f.read())
        if limit != "max":
            available = min(available, int(limit) - current)
    except (OSError, ValueError):
        pass
    if settings.cpu_bytes > available:
        raise ConfigError(f"cpu_bytes: {settings.cpu_bytes} bytes requested for the CPU tier but only {available} "
                          "bytes of memory are available on this host (or in its cgroup); lower --cpu-bytes")


def check_codecs(settings: Settings) -> None:
    """Raise ``ConfigError`` naming the setting (and the extra to install) if a tier's codec
    cannot run here (fp8 / int4 without torch)."""
    wanted = settings.tier_codecs
    if not wanted:
        return
    from kvstore import codecs
    for tier, codec in wanted.items():
        reason = codecs.unavailable(codec)
        if reason:
            raise ConfigError(f"{'redis_tier.codec' if tier == 'redis' else f'codecs.{tier}'}: {reason}")


def setting_variables() -> set[str]:
    """Every environment variable name the settings read (nested ones with ``__``)."""
    names = set()
    for name, field in Settings.model_fields.items():
        names.add(f"KVSTORE_{name.upper()}")
        sub = field.annotation
        if isinstance(sub, type) and hasattr(sub, "model_fields"):
            names |= {f"KVSTORE_{name.upper()}__{inner.upper()}" for inner in sub.model_fields}
    return names


def unknown_environment(environ: Mapping[str, str]) -> Iterator[str]:
    """One warning per ``KVSTORE_*`` variable in ``environ`` that nothing reads (its value is
    never shown: it may be a secret): pydantic-settings reads only the names it knows, so a typo
    would otherwise fall back to the default without a word."""
    known = setting_variables()
    for var in sorted(environ):
        if not var.startswith("KVSTORE_") or var in known or var in OTHER_VARIABLES or var.startswith(OTHER_PREFIXES):
            continue
        near = difflib.get_close_matches(var, sorted(known | OTHER_VARIABLES), n=1, cutoff=0.6)
        hint = f"; did you mean {near[0]}?" if near else "; see docs/config.md for the settings"
        yield f"environment variable {var} is not a kvstore setting and is ignored{hint}"


def _bytes_held(path: str) -> int:
    """Bytes the files directly in ``path`` take on disk now (the tier's slabs: a restarted tier
    may grow back into what it already holds)."""
    held = 0
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if entry.is_file(follow_symlinks=False):
                    held += entry.stat(follow_symlinks=False).st_blocks * 512
    except OSError:
        pass
    return held


def nvme_room_warning(settings: Settings) -> str | None:
    """A warning naming ``nvme_bytes`` and the path if the NVMe tier could outgrow its filesystem.
    Not refused: a disk that fills degrades, it does not fail requests (guarantee 3), and room may
    be freed while the daemon runs. (The CPU arena's tmpfs room is checked by ``CpuTier``.)"""
    if not settings.nvme_bytes:
        return None
    path = os.path.abspath(os.path.expanduser(settings.nvme_path))
    try:
        free = os.statvfs(existing_parent(path))
    except OSError:
        return None   # the tier says why it cannot use the directory when it opens it
    room = free.f_bavail * free.f_frsize + _bytes_held(path)
    if settings.nvme_bytes <= room:
        return None
    return (f"nvme_bytes: {format_size(settings.nvme_bytes, 'readable')} asked for the NVMe tier in {path}, "
            f"but its filesystem has room for {format_size(room, 'readable')}; once it is full, puts are "
            "acknowledged 'stored' instead of 'persisted' and demotions drop blocks: lower nvme_bytes or "
            "point nvme_path at a larger disk")


#: filesystems whose pages live in memory only: an arena there is never written back to a disk
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "hugetlbfs", "ramfs", "shm"})


def filesystem_of(path: str) -> str | None:
    """The type of the filesystem that holds ``path`` (its nearest existing ancestor), from the
    mount table; None when it cannot be told."""
    path = os.path.realpath(existing_parent(path))
    best, kind = "", None
    try:
        mounts = psutil.disk_partitions(all=True)
    except OSError:
        return None
    for m in mounts:
        point = m.mountpoint.rstrip("/") or "/"
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, m.fstype
    return kind


def arena_filesystem_warning(settings: Settings) -> str | None:
    """A warning naming ``shm_dir`` when the CPU arena would live on a disk-backed filesystem."""
    if not settings.cpu_bytes:
        return None
    kind = filesystem_of(settings.shm_dir)
    if kind is None or kind in MEMORY_FILESYSTEMS:
        return None
    return (f"shm_dir: {os.path.abspath(os.path.expanduser(settings.shm_dir))} is on {kind}, a filesystem on a "
            "disk, not in memory: the kernel writes the CPU arena's pages back to that disk, so copies into it "
            "compete with the disk's other writes; point shm_dir at a tmpfs such as /dev/shm")


def _address_in_use(host: str, port: int) -> str | None:
    """Whether binding ``host:port`` fails now because something holds it (its error text)."""
    host = host.strip("[]") or None
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError:
        return None   # an unknown host: the server says so when it binds
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)   # as the servers bind (TIME_WAIT is no owner)
            try:
                s.bind(address)
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    return e.strerror
    return None


def check_ports(settings: Settings) -> None:
    """Raise ``ConfigError`` naming ``listen`` or ``metrics_port`` when that port is taken: said
    before gRPC's own bind logs its C-level error, and with the setting to change."""
    wanted = [("listen", settings.host, settings.port)]
    if settings.metrics_port:
        wanted.append(("metrics_port", settings.metrics_host, settings.metrics_port))
    for key, host, port in wanted:
        if port and (problem := _address_in_use(host, port)):
            raise ConfigError(f"{key}: {host}:{port} is taken ({problem}); another process listens there: "
                              f"stop it or choose another port")


def run_checks(settings: Settings, environ: Mapping[str, str]) -> list[str]:
    """Refuse what cannot work (``ConfigError``); return warnings for what is only suspicious."""
    check_ports(settings)
    check_codecs(settings)
    check_memory(settings)
    suspicious = (nvme_room_warning(settings), arena_filesystem_warning(settings))
    return [*unknown_environment(environ), *filter(None, suspicious)]
