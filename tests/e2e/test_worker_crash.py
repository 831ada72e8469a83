"""A worker thread that hits a bug (anything but a Redis error) ends the worker process with a non-zero
exit, for its supervisor to restart, instead of warning every 0.2 s while the worker serves on without a
heartbeat and vanishes from the registry."""

import subprocess
import sys
import time

import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.redis_conn import EmbeddedRedis, sync_client
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.jobs import JobClient

pytestmark = pytest.mark.slow


def test_a_bug_in_a_worker_thread_ends_the_worker_with_a_non_zero_exit(tiny_model_dir, tmp_path):
    """The heartbeat's own code fails (not Redis): the process must end, not warn every 0.2 s."""
    bug = ("import sys, threading\n"
           "from kvrelay.shared.worker import registration\n"
           "publish = registration.Registration._publish_heartbeat\n"
           "def broken(self, info):\n"
           "    if threading.current_thread().name == 'heartbeat':\n"
           "        raise ZeroDivisionError('a bug in the heartbeat')\n"
           "    return publish(self, info)\n"
           "registration.Registration._publish_heartbeat = broken\n"
           "from kvrelay.cli import main\n"
           "sys.exit(main(sys.argv[1:]))\n")
    with EmbeddedRedis() as url:
        proc = subprocess.run([sys.executable, "-c", bug, "decode-worker", "--model", str(tiny_model_dir),
                               "--redis-url", url, "--worker-id", "d-bug", *TINY_ENGINE],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "a bug in the heartbeat" in proc.stderr


def test_an_engine_crash_mid_request_ends_a_lone_worker_with_a_non_zero_exit(tiny_model_dir):
    """``kvrelay unified-worker`` run alone (as k8s or systemd runs it): its engine fails on a request's
    step, so the process exits non-zero for its orchestrator to restart, and unregisters on its way out,
    rather than serving on with a broken engine."""
    bug = ("import sys\n"
           "from kvrelay.shared.engine.engine_core import EngineCore\n"
           "def broken(self):\n"
           "    raise RuntimeError('the engine broke')\n"
           "EngineCore.step = broken\n"
           "from kvrelay.cli import main\n"
           "sys.exit(main(sys.argv[1:]))\n")
    with EmbeddedRedis() as url:
        redis = sync_client(url)
        proc = subprocess.Popen([sys.executable, "-c", bug, "unified-worker", "--model", str(tiny_model_dir),
                                 "--redis-url", url, "--worker-id", "u-bug", *TINY_ENGINE],
                                stderr=subprocess.PIPE, text=True)
        try:
            deadline = time.monotonic() + 120
            while not redis.exists(keys.worker_key("u-bug")):
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
                time.sleep(0.2)
            jobs = JobClient(redis, "tiny")
            jobs.submit("r1", [1, 2, 3, 4])
            _, stderr = proc.communicate(timeout=120)
            jobs.close()
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode != 0
        assert "the engine broke" in stderr
        assert not redis.exists(keys.worker_key("u-bug"))
