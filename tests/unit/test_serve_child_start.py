"""A child that dies before it has read its config (killed at birth) is the supervisor's to count as a crash:
writing its config to a closed pipe must not raise in `kvrelay serve`, whose supervisor then sees the exit."""

import argparse
import signal
import subprocess

from kvrelay import serve
from kvrelay.serve_plan import Child
from kvrelay.shared.config.gateway import GatewayConfig


def test_a_child_killed_before_it_reads_its_config_is_returned_dead(monkeypatch):
    real_popen = subprocess.Popen

    def killed_at_birth(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        return proc

    monkeypatch.setattr(serve.subprocess, "Popen", killed_at_birth)
    child = Child(name="gateway", command="gateway", config=GatewayConfig())
    proc = serve._start(child, argparse.Namespace(log_level="INFO"), None, print_config=False)
    assert proc.returncode == -signal.SIGKILL and proc.stdin.closed
