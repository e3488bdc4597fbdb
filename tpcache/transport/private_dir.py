"""``PrivateDir``: a new temp directory readable only by its user (mode 0700), with a
lock that says its owner is alive: the step hub's (its Unix socket) and a TP group's
rendezvous file's.

Why a lock: a process that is killed (SIGKILL, or Ray killing an actor) never removes
its directory. The lock (``flock`` on ``owner.lock``, held open by the owner) goes with
the process whatever kills it, so a later owner of the same kind can tell a dead one's
directory from a live one's without touching what is in it, and removes it.

Why a fallback directory for the hub: a Unix socket's path has at most 107 bytes, and a
long ``TMPDIR`` (a test's or a job scheduler's) would leave no room for it.
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import os
import shutil
import stat
import tempfile
import time

from tpcache.errors import TpcacheError

HUB_PREFIX = "tpcache-ch-"
RDV_PREFIX = "tpcache-rdv-"
SOCKET = "steps.sock"
LOCK = "owner.lock"
MAX_SOCKET_PATH = 107  # sun_path's 108 bytes, less the terminating NUL
_NAME = len(HUB_PREFIX) + 8 + 1 + len(SOCKET)  # mkdtemp's 8 random characters, "/", the socket
STALE_S = 60.0  # a directory without a lock is left this long (its hub may be starting)
# None younger is looked at: its hub may not have taken its lock yet (an unlocked lock
# file is the dead hub's sign only once the hub had time to lock it).
_BORN_S = 5.0


class HubDirError(TpcacheError, OSError):
    """No directory could be made for the step hub's socket."""


class PrivateDir:
    """A fresh directory named ``prefix``... under ``base`` (the temp directory), locked
    while its owner lives; dead owners' directories of the same prefix there are removed
    first (``sweep``)."""

    def __init__(self, prefix: str, base: str | None = None) -> None:
        base = base or tempfile.gettempdir()
        sweep(base, prefix)
        self.path = tempfile.mkdtemp(prefix=prefix, dir=base)  # mode 0700
        try:
            self._lock = os.open(os.path.join(self.path, LOCK), os.O_CREAT | os.O_RDWR, 0o600)
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BaseException:
            shutil.rmtree(self.path, ignore_errors=True)
            raise

    def remove(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.close(self._lock)


def socket_base() -> str:
    """Where hub directories go: the temp directory, or ``/tmp`` if a socket path under
    the temp directory would be too long. Raises ``HubDirError`` if neither will do."""
    for base in (tempfile.gettempdir(), "/tmp"):
        if len(base) + 1 + _NAME <= MAX_SOCKET_PATH and os.access(base, os.W_OK | os.X_OK):
            return base
    raise HubDirError(
        f"no directory for the step channel's Unix socket: {tempfile.gettempdir()!r} is too"
        f" long for a socket path ({MAX_SOCKET_PATH} bytes) and /tmp is not writable; set"
        " TMPDIR to a shorter directory"
    )


def hub_dir() -> tuple[PrivateDir, str]:
    """A step hub's directory and the path of its socket in it."""
    d = PrivateDir(HUB_PREFIX, socket_base())
    return d, os.path.join(d.path, SOCKET)


def sweep(base: str, prefix: str) -> list[str]:
    """Remove this user's ``prefix`` directories under ``base`` whose owner is gone: its
    lock is free, or (a directory from before locks, or an owner that died while
    starting) it has none and is older than ``STALE_S``. Returns what was removed."""
    removed = []
    uid, now = os.getuid(), time.time()
    for path in glob.glob(os.path.join(glob.escape(base), prefix + "*")):
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if st.st_uid != uid or not stat.S_ISDIR(st.st_mode):
            continue
        if now - st.st_mtime > _BORN_S and _gone(path, now - st.st_mtime):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    return removed


def _gone(path: str, age_s: float) -> bool:
    try:
        fd = os.open(os.path.join(path, LOCK), os.O_RDWR | os.O_NOFOLLOW)
    except FileNotFoundError:
        return age_s > STALE_S
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: its owner is alive
        return False
    finally:
        os.close(fd)  # (releases the lock if this took it)
    return True
