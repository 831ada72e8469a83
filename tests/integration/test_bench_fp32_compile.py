"""``python -m kvrelay.bench.triton_fp32_compile`` on CPU (Triton's interpreter): a row per candidate tiling from
its own child process, and a budget that runs out reports the candidates left, without failing the run."""

import os
import subprocess

import pytest

from kvrelay.shared.config.handover import module_argv

pytest.importorskip("triton")
from kvrelay.kernels.triton.decode_attention import FP32_BLOCK_N, FP32_BLOCK_N_CANDIDATES  # noqa: E402


def _bench(*args: str) -> list[list[str]]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    out = subprocess.run([*module_argv("kvrelay.bench.triton_fp32_compile"), "--device", "cpu", *args],
                         capture_output=True, text=True, timeout=240, env=env)
    assert out.returncode == 0, out.stderr
    return [[c.strip() for c in line.strip("|").split("|")] for line in out.stdout.splitlines()
            if line.startswith("| decode")]


def test_every_decode_candidate_gets_a_checked_row():
    rows = _bench("--kernels", "decode", "--jobs", "3", "--budget", "200")
    # the current tiling first, then the others
    assert [r[1] for r in rows] == [f"BLOCK_N={n}" for n in (FP32_BLOCK_N, *FP32_BLOCK_N_CANDIDATES)]
    assert len(rows) == 3
    assert all(r[5] == "yes" and float(r[4]) < 1e-4 for r in rows), rows


def test_a_spent_budget_reports_what_did_not_run():
    rows = _bench("--kernels", "decode", "--budget", "0")
    assert len(rows) == 3 and all(r[5] == "FAILED: skipped: time budget spent" for r in rows), rows
