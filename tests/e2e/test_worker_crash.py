"""A worker thread that hits a bug (anything but a Redis error) ends the worker process with a non-zero
exit, for its supervisor to restart, instead of warning every 0.2 s while the worker serves on without a
heartbeat and vanishes from the registry."""

import subprocess
import sys

import pytest

from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.conftest import TINY_ENGINE

pytestmark = pytest.mark.slow


def test_a_bug_in_a_worker_thread_ends_the_worker_with_a_non_zero_exit(tiny_model_dir, tmp_path):
    """The heartbeat's own code fails (not Redis): the process must end, not warn every 0.2 s."""
    bug = ("import sys, threading\n"
           "from kvrelay.shared.worker import runtime\n"
           "info = runtime.WorkerRuntime._worker_info\n"
           "def broken(self):\n"
           "    if threading.current_thread().name == '_heartbeat_loop':\n"
           "        raise ZeroDivisionError('a bug in the heartbeat')\n"
           "    return info(self)\n"
           "runtime.WorkerRuntime._worker_info = broken\n"
           "from kvrelay.cli import main\n"
           "sys.exit(main(sys.argv[1:]))\n")
    with EmbeddedRedis() as url:
        proc = subprocess.run([sys.executable, "-c", bug, "decode-worker", "--model", str(tiny_model_dir),
                               "--redis-url", url, "--worker-id", "d-bug", *TINY_ENGINE],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "a bug in the heartbeat" in proc.stderr
