"""A private directory for cached KV bytes, and file opens that a planted file cannot redirect.

Threat: another local user, or a stale process, plants entries in a directory the daemon writes
(a symlink where it creates a temp or probe file, so the write lands on the link's target) or reads
at start-up (a FIFO that blocks ``open()`` forever, a symlink that imports someone else's file), or
simply reads the cached KV bytes because the directory is loose. So:

* ``claim_private_dir`` creates the directory 0700, or accepts an existing one only if it is
  owned by this process's uid and no group/other bits are set. An existing loose directory is
  tightened to 0700 only while it is empty (a fresh mount point: tmpfs roots are 1777), since
  nothing can have been planted in it or read from it yet; a loose one with entries is refused.
* ``create_exclusive`` creates files ``O_CREAT|O_EXCL|O_NOFOLLOW`` 0600: it never opens
  something that was already there, link or not; ``replace_file`` writes a whole file that way
  (temp file, fsync, rename).
* ``open_regular`` opens ``O_NOFOLLOW|O_NONBLOCK`` and accepts only a regular file, so a FIFO,
  socket, device, directory or symlink is reported (``NotRegularFile``), never followed or waited on.

Only ``kvstore.errors`` is imported here; tiers and the store may use it for any file they own.
"""

from __future__ import annotations

import errno
import os
import stat

from kvstore.errors import TierIOError

PRIVATE_DIR_MODE = 0o700
PRIVATE_FILE_MODE = 0o600
_KINDS = ((stat.S_ISLNK, "symlink"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISSOCK, "socket"),
          (stat.S_ISDIR, "directory"), (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"),
          (stat.S_ISREG, "regular file"))


class NotRegularFile(Exception):
    """A path that should hold a regular file holds something else (``kind`` says what).
    Deliberately not an OSError: callers that delete damaged files on OSError must skip this one."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path} is a {kind}, not a regular file")
        self.path = path
        self.kind = kind


def file_kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "special file")


def claim_private_dir(path: str, label: str) -> None:
    """Make ``path`` a directory only this uid can enter, or refuse it (``TierIOError`` naming the
    path and its octal mode). OSError (cannot create, read-only filesystem) is left to the caller."""
    try:
        os.makedirs(path, mode=PRIVATE_DIR_MODE)
        created = True
    except FileExistsError:
        created = False
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if created:
            os.fchmod(dfd, PRIVATE_DIR_MODE)  # makedirs' mode is filtered by the umask; be exact
            return
        st = os.fstat(dfd)
        mode = stat.S_IMODE(st.st_mode)
        if st.st_uid != os.geteuid():
            raise TierIOError(f"{label}: {path} (mode {mode:04o}) is owned by uid {st.st_uid}, not by this "
                              f"daemon's uid {os.geteuid()}: another user could plant files there or read "
                              "cached KV blocks; use a directory this user owns, mode 700")
        if not mode & 0o077:
            return
        if os.listdir(dfd):
            raise TierIOError(_loose_message(label, path, mode))
        os.fchmod(dfd, PRIVATE_DIR_MODE)
        if os.listdir(dfd):  # planted while it was still open: refuse rather than trust it
            raise TierIOError(_loose_message(label, path, mode))
    finally:
        os.close(dfd)


def _loose_message(label: str, path: str, mode: int) -> str:
    why = "group/other may write" if mode & 0o022 else "group/other may read cached KV blocks"
    return (f"{label}: {path} is mode {mode:04o} ({why}) and not empty, so files in it may have been planted "
            "or read; chmod 700 it or choose another path (an empty directory is made 0700 automatically)")


def create_exclusive(path: str, extra_flags: int = 0) -> int:
    """Create ``path`` for writing, 0600, never through a link and never reusing what is there.

    A leftover at ``path`` (a crash's temp file, a planted symlink) is unlinked first if it is a
    regular file or a symlink (unlinking a symlink never touches its target); anything else there
    (a FIFO, a directory) raises OSError(EEXIST) naming it."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | extra_flags
    try:
        return os.open(path, flags, PRIVATE_FILE_MODE)
    except FileExistsError:
        remove_leftover(path)
    return os.open(path, flags, PRIVATE_FILE_MODE)


def replace_file(path: str, write, extra_flags: int = 0, fsync: bool = True) -> None:
    """Write ``path`` whole or not at all: ``write(fd)`` fills ``<path>.tmp`` (``create_exclusive``),
    which is fsynced (unless ``fsync=False``: then a crash may leave it torn) and renamed over
    ``path``. On OSError the temp file is removed and the error raised. The rename
    itself is durable only once the caller fsyncs the directory."""
    tmp = path + ".tmp"
    fd = create_exclusive(tmp, extra_flags)
    try:
        write(fd)
        if fsync:
            os.fsync(fd)
    except OSError:
        os.close(fd)
        unlink_quietly(tmp)
        raise
    os.close(fd)
    os.rename(tmp, path)


def remove_leftover(path: str) -> None:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
        raise OSError(errno.EEXIST, f"{path} is a {file_kind(mode)}, not a file this daemon left behind")
    os.unlink(path)


def open_regular(path: str, extra_flags: int = 0) -> int:
    """Open an existing regular file read-only (``extra_flags``: e.g. O_DIRECT); ``NotRegularFile``
    for anything else.

    ``lstat`` first, so a device or FIFO is never even opened (opening some devices has side
    effects); then ``O_NOFOLLOW|O_NONBLOCK`` and ``fstat``, so a swap in between is caught too."""
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise NotRegularFile(path, file_kind(mode))
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | extra_flags)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotRegularFile(path, "symlink") from None
        raise
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegularFile(path, file_kind(mode))
    return fd


def unlink_quietly(path: str) -> None:
    """Best effort: on a filesystem gone read-only (or a vanished directory) dropping a file must
    not turn an eviction or a cleanup into a failed request; a file left behind stays valid."""
    try:
        os.unlink(path)
    except OSError:
        pass


def fsync_dir(path: str) -> None:
    """Make the renames and unlinks in directory ``path`` so far durable (OSError if it cannot)."""
    dfd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
