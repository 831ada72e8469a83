"""Stopping ``kvrelay serve`` with its embedded Redis, as a user does: Ctrl-C in a terminal (SIGINT to the
whole foreground process group, so every child sees it too unless it has its own) or SIGTERM to serve
alone. Workers and gateways must stop while Redis is still up (they unregister there), Redis last, with
nothing but log lines on the console and exit code 0."""

import os
import signal
import subprocess
import sys

import psutil
import pytest

from tests.e2e.cluster import free_port
from tests.e2e.served import until_ready

pytestmark = pytest.mark.slow

# What a worker or gateway says when Redis went away under it
REDIS_GONE = ("Traceback", "could not unregister", "subscription lost", "Connection refused", "Error 111")


@pytest.mark.parametrize("how", ["ctrl-c", "sigterm"])
def test_serve_stops_everything_before_its_redis_without_a_traceback(tmp_path, how):
    log = tmp_path / "serve.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvrelay.cli", "serve", "--port", str(free_port()), "--model", "dummy:tiny-llama",
         "--max-model-len", "256", "--kv-cache-memory", str(16 << 20), "--state-dir", str(tmp_path / "state")],
        stdout=open(log, "wb"), stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"),
        start_new_session=True)  # a process group of its own, as a shell gives a foreground job
    try:
        until_ready(proc, log)
        children = psutil.Process(proc.pid).children(recursive=True)
        assert any(c.name() == "redis-server" for c in children), children
        if how == "ctrl-c":
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM)
        code = proc.wait(90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    output = log.read_text()
    assert code == 0, output
    assert not [s for s in REDIS_GONE if s in output], output
    _gone, alive = psutil.wait_procs(children, timeout=15)
    assert not alive, f"orphans: {alive}"
