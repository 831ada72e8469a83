"""``kvrelay bench swap`` as a user first runs it: with its own defaults (SmolLM2, two clients per model,
10 s before and after the swap) it succeeds on this 2-core CPU with no failed request, and it leaves no
temporary folder behind, whether it succeeds, fails or is stopped."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


def bench(tmp: Path, *argv: str) -> subprocess.Popen:
    tmp.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "bench", "swap", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ, TMPDIR=str(tmp)))


def test_defaults_succeed_and_clean_up(tmp_path):
    proc = bench(tmp_path / "tmp")
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, f"{out[-3000:]}\n{err[-3000:]}"
    result = json.loads(out[out.index("\n{\n") + 1:])
    assert result["failed"] == 0 and result["requests"] > 0 and result["swap_status"] == 200
    assert result["swap_body"]["version"] == 2 and result["other_latency"]["after"]["n"] > 0
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_failed_run_removes_its_folder_too(tmp_path):
    proc = bench(tmp_path / "tmp", "--after", "1", "--", "--max-num-seqs", "0")  # serve refuses it, exit 2
    out, err = proc.communicate(timeout=600)
    assert proc.returncode != 0 and "kvrelay serve did not come up" in err, f"{out[-2000:]}\n{err[-2000:]}"
    assert "--max-num-seqs" in err  # serve's own one-line error, passed on
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_stopped_run_removes_its_folder_and_its_server(tmp_path):
    proc = bench(tmp_path / "tmp")
    deadline = time.monotonic() + 300
    while not list((tmp_path / "tmp").glob("kvrelay-swap-*/serve.log")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    serve_log = next((tmp_path / "tmp").glob("kvrelay-swap-*/serve.log"))
    while b"gateway listening" not in serve_log.read_bytes():  # serve and its children are up
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert list((tmp_path / "tmp").iterdir()) == []
    leftovers = subprocess.run(["pgrep", "-f", str(serve_log.parent)], capture_output=True, text=True).stdout
    assert leftovers == "", leftovers  # serve, started with the folder's swap.yaml, is gone
