"""Prefill and decode workers refuse ``--pipeline-parallel-size`` before loading (served unified, a stage
killed with -9 is tests/e2e/test_serve_tensor_parallel.py's case, both kinds)."""

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.mark.parametrize("role", ["prefill-worker", "decode-worker"])
def test_handoff_roles_refuse_pipeline_parallelism_before_loading(role, tiny_model_dir):
    """The KV handoff carries one stage's layers until it learns parallel layouts."""
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", role, "--model", str(tiny_model_dir),
                           "--pipeline-parallel-size", "2", "--redis-url", "redis://127.0.0.1:1/0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("--pipeline-parallel-size: the KV handoff "
                                        f"{'moves' if role == 'prefill-worker' else 'fills'} one stage's layers; "
                                        "use a unified worker")
