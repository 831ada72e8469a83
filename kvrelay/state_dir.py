"""``kvrelay serve --state-dir``: where the embedded Redis keeps what must outlive a restart (tenants, API
keys, registered models, limits and counters in its append-only file; its users' passwords; its socket).

The folder is made 0700 and must stay private: it holds Redis's passwords and every tenant's data, so one
that group or others may enter is refused, as is one this user cannot write. One ``kvrelay serve`` at a
time uses it: a second Redis appending to the same file would corrupt it, and one shutting down would
remove the other's socket. So ``StateDir`` holds an exclusive lock (``flock``, released by the kernel
however its holders end), and serve hands the locked descriptor to its redis-server too: the folder is
free once serve and its Redis are both gone. A serve killed outright leaves its Redis a moment to write
its file and exit; a new serve waits that long (``STALE_WAIT_S``) rather than refuse. Every refusal is one
line naming ``--state-dir`` (exit 2), before anything starts.
"""

import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from types import TracebackType

from kvrelay.startup_checks import StartupError

FLAG = "--state-dir"
LOCK_NAME = "serve.lock"
STALE_WAIT_S = 10.0  # for the children of a serve that is gone to let go (Redis flushing its file)


def default_state_dir() -> Path:
    """``$XDG_DATA_HOME/kvrelay``, else ``~/.local/share/kvrelay`` (the XDG base directory default)."""
    data_home = os.environ.get("XDG_DATA_HOME")
    base = Path(data_home) if data_home and Path(data_home).is_absolute() else Path.home() / ".local" / "share"
    return base / "kvrelay"


class StateDir:
    """The checked, locked state folder; a context manager whose value is its absolute path.

        with StateDir(args.state_dir or default_state_dir()) as path:
            ...  # no other kvrelay serve uses ``path`` until this block ends
    """

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser().absolute()
        self._lock_fd: int | None = None

    @property
    def lock_fd(self) -> int:
        """The locked descriptor: a process given it (``pass_fds``) holds the folder as long as it lives."""
        if self._lock_fd is None:
            raise RuntimeError("StateDir not entered")
        return self._lock_fd

    def __enter__(self) -> Path:
        self._make()
        self._check()
        self._lock()
        return self.path

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # closing the descriptor releases the flock
            self._lock_fd = None

    def _error(self, cause: str) -> StartupError:
        return StartupError(f"{FLAG} {self.path}: {cause}")

    def _make(self) -> None:
        if self.path.exists() or self.path.is_symlink():
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.path.mkdir(mode=0o700)
            os.chmod(self.path, 0o700)  # whatever the umask
        except FileExistsError:  # made meanwhile by another serve: checked and locked below like any
            pass
        except OSError as exc:
            raise self._error(f"cannot create it ({exc.strerror or exc})") from None

    def _check(self) -> None:
        try:
            st = os.stat(self.path)
        except OSError as exc:
            raise self._error(f"cannot read it ({exc.strerror or exc})") from None
        if not stat.S_ISDIR(st.st_mode):
            raise self._error("not a directory")
        if st.st_uid != os.getuid():
            raise self._error(f"owned by another user (uid {st.st_uid}); it holds Redis's passwords")
        mode = stat.S_IMODE(st.st_mode)
        if mode & 0o077:
            raise self._error(f"mode {mode:04o} lets other users in, and it holds Redis's passwords and every "
                              f"tenant's data; chmod 700 {self.path}")
        if not os.access(self.path, os.R_OK | os.W_OK | os.X_OK):
            raise self._error("not writable by this user")

    def _lock(self) -> None:
        lock = self.path / LOCK_NAME
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise self._error(f"cannot open {LOCK_NAME} ({exc.strerror or exc})") from None
        deadline = time.monotonic() + STALE_WAIT_S
        while not _try_lock(fd):
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
            serve_alive = holder.isdigit() and _alive(int(holder))
            if serve_alive or time.monotonic() > deadline:
                os.close(fd)
                if serve_alive:
                    raise self._error(f"in use by another kvrelay serve (pid {holder}); stop it, or give this one "
                                      f"its own {FLAG}")
                raise self._error(f"its last kvrelay serve (pid {holder or '?'}) is gone, but a process it started "
                                  f"still holds it (its redis-server?); stop that process")
            time.sleep(0.1)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise StartupError(f"{FLAG}: cannot lock {LOCK_NAME} ({exc.strerror or exc})") from None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process of that number: alive, and not ours to judge
        return True
    return True
