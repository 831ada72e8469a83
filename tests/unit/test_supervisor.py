"""kvrelay/supervisor.py with real child processes (``sh``): a child that dies is started again with a
doubling backoff, each exit is reported once, and a child crashing ``max_crashes`` times within the window
is the reason to give up, naming it and its exit code. A child that exits before it ever said "ready" on
its status pipe is not restarted: StartupError names it and the cause it wrote there. kvrelay serve's use of it is tests/e2e/test_serve_restart.py."""

import logging
import os
import subprocess
import time

import pytest

from kvrelay import supervisor
from kvrelay.startup_checks import StartupError
from kvrelay.supervisor import Supervisor


def _run(sup: Supervisor, until, timeout: float = 60.0):
    deadline = time.monotonic() + timeout  # generous: proves "does not hang", nothing about speed
    while time.monotonic() < deadline:
        reason = sup.check()
        if reason or until():
            return reason
        time.sleep(0.02)
    raise AssertionError("supervisor did not get there")


def _sh(script: str, ready: bool = True):
    """A child running ``script``, after saying it is ready (unless not ``ready``)."""
    script = f"echo ready >/dev/fd/$KVRELAY_STATUS_FD; {script}" if ready else script
    return lambda fd: subprocess.Popen(["sh", "-c", script], env=os.environ | Supervisor.status_env(fd),
                                       pass_fds=(fd,))


def test_a_killed_child_is_started_again_and_its_exit_reported(caplog):
    exits = []
    sup = Supervisor({"worker": _sh("sleep 60"), "steady": _sh("sleep 60")}, max_crashes=5, crash_window=300,
                     on_exit=lambda name, proc: exits.append((name, proc.pid, proc.returncode)))
    sup.start_all()
    try:
        assert _run(sup, lambda: sup.ready("worker") and sup.ready("steady")) is None  # else it never was ready
        first = sup.procs["worker"]
        steady = sup.procs["steady"]
        first.kill()
        with caplog.at_level(logging.INFO, logger="kvrelay.supervisor"):
            assert _run(sup, lambda: sup.procs["worker"] is not first) is None
        assert exits == [("worker", first.pid, -9)]
        assert sup.procs["worker"].poll() is None and sup.procs["steady"] is steady
        assert "worker exited with code -9; restarting it in 1s (crash 1 of 5 within 300s)" in caplog.text
        assert f"worker started again (pid {sup.procs['worker'].pid})" in caplog.text
    finally:
        for proc in sup.procs.values():
            proc.kill()
            proc.wait()


def test_a_child_with_its_own_first_backoff_starts_again_after_it_doubling_from_there(caplog):
    """serve's Redis: every other child needs it, and it is back from its file in milliseconds."""
    sup = Supervisor({"redis": _sh("sleep 60"), "worker": _sh("sleep 60")}, max_crashes=5, crash_window=300,
                     backoff_start={"redis": 0.05})
    sup.start_all()
    try:
        assert _run(sup, lambda: sup.ready("redis") and sup.ready("worker")) is None
        with caplog.at_level(logging.INFO, logger="kvrelay.supervisor"):
            for backoff in ("0.05", "0.1"):
                killed = sup.procs["redis"]
                killed.kill()
                assert _run(sup, lambda k=killed: sup.procs["redis"] is not k and sup.ready("redis")) is None
                assert f"redis exited with code -9; restarting it in {backoff}s" in caplog.text
        worker = sup.procs["worker"]
        worker.kill()
        with caplog.at_level(logging.INFO, logger="kvrelay.supervisor"):
            assert _run(sup, lambda: sup.procs["worker"] is not worker) is None
        assert "worker exited with code -9; restarting it in 1s (crash 1 of 5 within 300s)" in caplog.text
    finally:
        for proc in sup.procs.values():
            proc.kill()
            proc.wait()


def test_a_crash_loop_backs_off_doubling_then_gives_up_naming_the_child_and_its_code(caplog):
    exits = []
    sup = Supervisor({"decode-worker": _sh("exit 3")}, max_crashes=3, crash_window=300,
                     on_exit=lambda name, proc: exits.append(name))
    sup.start_all()
    with caplog.at_level(logging.WARNING, logger="kvrelay.supervisor"):
        reason = _run(sup, lambda: False)
    assert reason == "decode-worker exited with code 3, 3 times within 300s (--max-crashes 3); stopping everything"
    assert exits == ["decode-worker"] * 3
    assert "restarting it in 1s (crash 1 of 3" in caplog.text
    assert "restarting it in 2s (crash 2 of 3" in caplog.text


def test_crashes_outside_the_window_and_after_healthy_running_do_not_add_up(caplog, monkeypatch):
    monkeypatch.setattr(supervisor, "HEALTHY_S", 0.0)  # every run counts as healthy: the backoff starts over
    sup = Supervisor({"gateway": _sh("exit 1")}, max_crashes=2, crash_window=0.001)
    sup.start_all()
    with caplog.at_level(logging.WARNING, logger="kvrelay.supervisor"):
        assert _run(sup, lambda: caplog.text.count("restarting it in 1s (crash 1 of 2") == 3) is None


def test_max_crashes_1_stops_at_the_first_exit_even_a_clean_one():
    sup = Supervisor({"prefill-worker": _sh("exit 0")}, max_crashes=1, crash_window=300)
    sup.start_all()
    assert _run(sup, lambda: False).startswith("prefill-worker exited with code 0, 1 time within 300s")


def test_a_child_that_exits_before_it_was_ready_is_not_restarted_and_its_cause_is_said():
    exits = []
    sup = Supervisor({"steady": _sh("sleep 60"), "decode-worker": _sh(
        "sleep 0.2; echo 'fatal max_model_len 999999 exceeds what tiny serves' >/dev/fd/$KVRELAY_STATUS_FD; exit 2",
        ready=False)}, max_crashes=5, crash_window=300, on_exit=lambda name, proc: exits.append(name))
    sup.start_all()
    try:
        _run(sup, lambda: sup.ready("steady"))
        assert not sup.ready("decode-worker")
        with pytest.raises(StartupError) as caught:
            _run(sup, lambda: False)
        assert str(caught.value) == "decode-worker: max_model_len 999999 exceeds what tiny serves"
        assert exits == ["decode-worker"]
    finally:
        for proc in sup.procs.values():
            proc.kill()
            proc.wait()


def test_a_child_that_dies_silently_before_it_was_ready_is_named_with_its_exit_code():
    sup = Supervisor({"gateway": _sh("exit 1", ready=False)}, max_crashes=5, crash_window=300)
    sup.start_all()
    with pytest.raises(StartupError, match=r"^gateway: exited with code 1 before it was ready$"):
        _run(sup, lambda: False)
