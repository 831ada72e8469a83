"""tests/live_log.py: a run's results on disk as they happen, once each, failures with their message."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_each_result_is_written_once_with_a_failures_message(tmp_path):
    (tmp_path / "test_sample.py").write_text(
        "def test_fine():\n    assert True\n\n"
        "def test_broken():\n    assert 1 + 1 == 3, 'arithmetic moved'\n")
    log = tmp_path / "live.txt"
    env = dict(os.environ, KVRELAY_TEST_LIVE_LOG=str(log), PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.live_log",
                          "-n", "2", str(tmp_path / "test_sample.py")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1, run.stdout + run.stderr
    text = log.read_text()
    results = [line.split() for line in text.splitlines() if not line.startswith("    ")]
    assert sorted((r[0], r[-1].rsplit("::", 1)[1]) for r in results) == [("failed", "test_broken"),
                                                                        ("passed", "test_fine")]
    assert "arithmetic moved" in text
