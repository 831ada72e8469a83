"""``kvrelay bench pool`` as CI runs it: tiny dummy models on the CPU, a few seconds, every part of its report
printed (models that fit each way, per-model TTFT/TPOT, tok/s, the cold load, goodput, the ratios). No
assertion about speed: the numbers of a busy 2-core box mean nothing."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def test_bench_pool_reports_both_modes_on_the_cpu():
    argv = ["bench", "pool", "--device", "cpu", "--threads", "1", "--num-models", "4", "--num-requests", "24",
            "--request-rate", "48", "--input-len", "16", "--output-len", "8"]
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", "--log-level", "WARNING", *argv],
                          capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-3000:]}\n{proc.stderr[-3000:]}"
    # room for all but one model: the pool keeps three resident over one KV pool and loads the fourth on
    # demand; a static split of the same memory holds fewer, and the rest of its requests fail
    fit = re.search(r"models that fit: pool (\d+) resident of 4 .* static split (\d+) of 4", out)
    assert fit and int(fit[1]) == 3 and int(fit[2]) < 3, out
    assert re.search(r"pool: \d+ output tokens in [\d.]+ s = [\d.]+ tok/s; goodput \d+/24 requests = [\d.]+ req/s", out), out
    assert re.search(r"static: \d+ output tokens .* \d+ failed \(no engine for their model\)", out), out
    rows = re.findall(r"^\s+(\d)\s+[\d.]+%\s+\d+ ", out, re.M)
    assert rows == ["0", "1", "2", "3"] * 2, out  # a TTFT/TPOT row per model, each mode
    assert re.search(r"cold load of an evicted model: median [\d.]+ s", out), out
    assert re.search(r"one model alone \(the same arrivals, all the memory\): [\d.]+ tok/s; the pool's aggregate "
                     r"is \d+% of it", out), out
    assert re.search(r"pool / static: models 3/\d, output tok/s [\d.]+x, goodput \(TTFT <= 1 s, TPOT <= 50 ms\) "
                     r"([\d.]+|inf|nan)x", out), out
