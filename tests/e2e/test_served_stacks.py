"""Two ``kvrelay serve`` deployments on one host, started at once: each one's workers share weights among
themselves alone (kvrelay/weight_scope.py). In the host-wide default folder the second deployment's workers
mapped the first's weights, and on a GPU they exit when the first stops (CUDA memory goes with the process that
exported it), taking the model out of the second's /ready and /v1/models. And what a stack says of itself for a
failing test's message (``Served.state``)."""

import pytest

from kvrelay.shared.worker.weight_registry import default_dir
from tests.e2e.served import Served

pytestmark = pytest.mark.slow
TINY = ["--mode", "disaggregated", "--model", "dummy:tiny-llama", "--device", "cpu", "--max-model-len", "256",
        "--kv-cache-memory", str(16 << 20)]


def deployment_folders(serve_pid: int) -> list:
    return list(default_dir().parent.glob(f"{default_dir().name}-serve-{serve_pid}-*"))


def test_deployments_started_at_once_share_no_weights_with_each_other(tmp_path):
    with Served(TINY, tmp_path / "a.log") as a, Served(TINY, tmp_path / "b.log") as b:
        logs = {name: s.log.read_text(errors="replace") for name, s in (("a", a), ("b", b))}
        pids = [a.proc.pid, b.proc.pid]
        folders = [deployment_folders(pid) for pid in pids]
        state = b.state()
    # within a deployment one worker loads and exports, the other maps that copy; across them nothing is mapped
    for name, log in logs.items():
        assert log.count("weights loaded and exported") == 1, (name, log[-3000:])
        assert log.count("weights mapped") == 1, (name, log[-3000:])
    assert [len(f) for f in folders] == [1, 1], folders
    assert not any(deployment_folders(pid) for pid in pids)  # each serve removed its own as it stopped
    assert "GET /ready: 200" in state and '"role": "prefill"' in state and '"role": "decode"' in state, state
