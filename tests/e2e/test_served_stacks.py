"""Two ``kvrelay serve`` stacks started through tests/e2e/served.py at once, as the GPU suite's processes start
theirs: each stack's workers share weights among themselves alone. In the host-wide default folder the second
stack's workers mapped the first's weights, and on a GPU they exit when the first stack stops (CUDA memory goes
with the process that exported it), taking the model out of the second's /ready and /v1/models. And what a stack
says of itself for a failing test's message (``Served.state``)."""

import pytest

from tests.e2e.served import Served

pytestmark = pytest.mark.slow
TINY = ["--mode", "disaggregated", "--model", "dummy:tiny-llama", "--device", "cpu", "--max-model-len", "256",
        "--kv-cache-memory", str(16 << 20)]


def test_stacks_started_at_once_share_no_weights_with_each_other(tmp_path):
    with Served(TINY, tmp_path / "a.log") as a, Served(TINY, tmp_path / "b.log") as b:
        logs = {name: s.log.read_text(errors="replace") for name, s in (("a", a), ("b", b))}
        share_dirs = {a.share_dir, b.share_dir}
        state = b.state()
    # within a stack one worker loads and exports, the other maps that copy; across stacks nothing is mapped
    for name, log in logs.items():
        assert log.count("weights loaded and exported") == 1, (name, log[-3000:])
        assert log.count("weights mapped") == 1, (name, log[-3000:])
    assert len(share_dirs) == 2 and not any(d.exists() for d in share_dirs)
    assert "GET /ready: 200" in state and '"role": "prefill"' in state and '"role": "decode"' in state, state
