"""``HubDir``: the step hub's directory for its Unix socket, readable only by its user
(mode 0700), with a lock that says the hub is alive.

Why a lock: a coordinator that is killed (SIGKILL, or Ray killing its actor) never
removes its directory. The lock (``flock`` on ``hub.lock``, held open by the hub) goes
with the process whatever kills it, so a later hub can tell a dead hub's directory from
a live one's without touching the live one's socket, and removes it.

Why a fallback directory: a Unix socket's path has at most 107 bytes, and a long
``TMPDIR`` (a test's or a job scheduler's) would leave no room for it.
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

PREFIX = "tpcache-ch-"
SOCKET = "steps.sock"
LOCK = "hub.lock"
MAX_SOCKET_PATH = 107  # sun_path's 108 bytes, less the terminating NUL
_NAME = len(PREFIX) + 8 + 1 + len(SOCKET)  # mkdtemp's 8 random characters, "/", the socket
STALE_S = 60.0  # a directory without a lock is left this long (its hub may be starting)
# None younger is looked at: its hub may not have taken its lock yet (an unlocked lock
# file is the dead hub's sign only once the hub had time to lock it).
_BORN_S = 5.0


class HubDirError(TpcacheError, OSError):
    """No directory could be made for the step hub's socket."""


class HubDir:
    """A fresh directory for a hub's socket (``socket_path``), locked while it lives;
    dead hubs' directories in the same place are removed first (``sweep``)."""

    def __init__(self) -> None:
        base = socket_base()
        sweep(base)
        self.path = tempfile.mkdtemp(prefix=PREFIX, dir=base)  # mode 0700
        self.socket_path = os.path.join(self.path, SOCKET)
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


def sweep(base: str) -> list[str]:
    """Remove this user's hub directories under ``base`` whose hub is gone: its lock is
    free, or (a directory from before locks, or a hub that died while starting) it has
    none and is older than ``STALE_S``. Returns what was removed."""
    removed = []
    uid, now = os.getuid(), time.time()
    for path in glob.glob(os.path.join(glob.escape(base), PREFIX + "*")):
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
    except OSError:  # held: its hub is alive
        return False
    finally:
        os.close(fd)  # (releases the lock if this took it)
    return True
