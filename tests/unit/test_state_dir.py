"""kvrelay/state_dir.py: ``kvrelay serve``'s state folder is made private (0700, whatever the umask), one
that others may enter or that is no folder is refused in one line naming --state-dir, and one serve at a
time holds it: another process is refused while the holder lives, and gets it once the holder and the
processes it handed the lock to (its redis-server) are gone, however they end (the kernel drops the lock
of a ``kill -9``). The serve-level tests are tests/e2e/test_serve_durable.py."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from kvrelay import state_dir
from kvrelay.startup_checks import StartupError
from kvrelay.state_dir import StateDir, default_state_dir

HOLD = "import sys, time; from kvrelay.state_dir import StateDir\nwith StateDir(sys.argv[1]):\n" \
       "    print('held', flush=True); time.sleep(120)"
# serve's way: its redis-server (here `sleep`) inherits the locked descriptor
HOLD_WITH_CHILD = """import subprocess, sys, time
from kvrelay.state_dir import StateDir
folder = StateDir(sys.argv[1])
with folder:
    child = subprocess.Popen(["sleep", sys.argv[2]], pass_fds=(folder.lock_fd,))
    print(child.pid, flush=True)
    time.sleep(120)
"""


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # exited: its descriptors are closed
    except psutil.NoSuchProcess:
        return True


def test_the_default_is_under_xdg_data_home_else_the_users_data_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert default_state_dir() == tmp_path / "kvrelay"
    monkeypatch.setenv("XDG_DATA_HOME", "relative/path")  # the XDG spec: a relative path is to be ignored
    assert default_state_dir() == Path.home() / ".local" / "share" / "kvrelay"
    monkeypatch.delenv("XDG_DATA_HOME")
    assert default_state_dir() == Path.home() / ".local" / "share" / "kvrelay"


def test_a_missing_folder_is_made_private_whatever_the_umask(tmp_path):
    path = tmp_path / "a" / "b" / "state"
    old = os.umask(0)
    try:
        with StateDir(path) as got:
            assert got == path and (path.stat().st_mode & 0o777) == 0o700
    finally:
        os.umask(old)


@pytest.mark.parametrize("mode", [0o750, 0o705, 0o777])
def test_a_folder_others_may_enter_is_refused_and_left_alone(tmp_path, mode):
    path = tmp_path / "state"
    path.mkdir()
    os.chmod(path, mode)
    with pytest.raises(StartupError) as err, StateDir(path):
        pass
    assert str(err.value) == (f"--state-dir {path}: mode {mode:04o} lets other users in, and it holds Redis's "
                              f"passwords and every tenant's data; chmod 700 {path}")
    assert (path.stat().st_mode & 0o777) == mode and os.listdir(path) == []


def test_a_file_is_refused(tmp_path):
    (tmp_path / "file").write_text("")
    with pytest.raises(StartupError, match=r"^--state-dir .*/file: not a directory$"), StateDir(tmp_path / "file"):
        pass


def test_one_holder_at_a_time_and_a_killed_holder_lets_go(tmp_path):
    path = tmp_path / "state"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(StartupError) as err, StateDir(path):
            pass
        assert str(err.value) == (f"--state-dir {path}: in use by another kvrelay serve (pid {holder.pid}); stop "
                                  "it, or give this one its own --state-dir")
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
    with StateDir(path):  # the kernel released the dead holder's lock
        assert (path / "serve.lock").read_text() == f"{os.getpid()}\n"
    with StateDir(path):  # and this one's, at the block's end
        pass


def test_a_killed_serve_s_folder_is_free_once_the_process_it_handed_the_lock_to_is_gone(tmp_path):
    path = tmp_path / "state"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_WITH_CHILD, str(path), "3"], stdout=subprocess.PIPE,
                              text=True)
    child = int(holder.stdout.readline())
    holder.send_signal(signal.SIGKILL)
    holder.wait(10)
    with StateDir(path):  # waits (up to STALE_WAIT_S) for the dead holder's child rather than refuse
        assert _gone(child)


def test_a_process_that_outlives_its_serve_and_keeps_the_folder_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(state_dir, "STALE_WAIT_S", 0.5)
    path = tmp_path / "state"
    holder = subprocess.Popen([sys.executable, "-c", HOLD_WITH_CHILD, str(path), "60"], stdout=subprocess.PIPE,
                              text=True)
    child = int(holder.stdout.readline())
    try:
        holder.send_signal(signal.SIGKILL)
        holder.wait(10)
        with pytest.raises(StartupError) as err, StateDir(path):
            pass
        assert str(err.value) == (f"--state-dir {path}: its last kvrelay serve (pid {holder.pid}) is gone, but a "
                                  "process it started still holds it (its redis-server?); stop that process")
    finally:
        os.kill(child, signal.SIGKILL)
