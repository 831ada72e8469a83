"""``kvrelay bench pool`` as CI runs it: tiny dummy models on the CPU, a few seconds, every part of its report
printed (models that fit each way, per-model TTFT/TPOT, tok/s, the cold load, goodput, the ratios); the plan
follows the measured cost of a model; every evicted engine is gone before the next load; an error mid-run is
the error reported. No assertion about speed: the numbers of a busy 2-core box mean nothing."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine import EngineCore
from kvrelay.shared.worker.model_memory import estimate_weight_bytes, kv_floor_bytes

pytestmark = pytest.mark.slow


def bench(*flags: str) -> tuple[str, str, int]:
    argv = [sys.executable, "-m", "kvrelay.cli", "--log-level", "WARNING", "bench", "pool", "--device", "cpu",
            "--threads", "1", *flags]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    return proc.stdout, proc.stderr, proc.returncode


def test_bench_pool_reports_both_modes_on_the_cpu():
    out, err, rc = bench("--num-models", "4", "--num-requests", "24", "--request-rate", "48", "--input-len", "16",
                         "--output-len", "8")
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    # room for all but one model: the pool keeps three resident over one KV pool and loads the fourth on
    # demand; a static split of the same memory holds fewer, and the rest of its requests fail
    fit = re.search(r"models that fit: pool (\d+) resident of 4 .* static split (\d+) of 4", out)
    assert fit and int(fit[1]) == 3 and int(fit[2]) < 3, out
    assert re.search(r"pool: \d+ output tokens in [\d.]+ s = [\d.]+ tok/s; goodput \d+/24 requests = [\d.]+ req/s", out), out
    assert re.search(r"static: \d+ output tokens .* \d+ failed \(no engine for their model\)", out), out
    rows = re.findall(r"^\s+(\d)\s+[\d.]+%\s+\d+ ", out, re.M)
    assert rows == ["0", "1", "2", "3"] * 2, out  # a TTFT/TPOT row per model, each mode
    assert re.search(r"cold load of an evicted model: median [\d.]+ s", out), out
    # the resident steps a load ran beside, told apart by the load's phase (what to blame for a slow one)
    assert re.search(r"resident steps while a load ran: (none|a round .*\n    resident steps by the load's phase: "
                     r"(weights|engine build|warm-up) p50 [\d.]+ / p99 [\d.]+ ms \(\d+\))", out), out
    assert re.search(r"one model alone \(the same arrivals, all the memory\): [\d.]+ tok/s; the pool's aggregate "
                     r"is \d+% of it", out), out
    assert re.search(r"pool / static: models 3/\d, output tok/s [\d.]+x, goodput \(TTFT <= 1 s, TPOT <= 50 ms\) "
                     r"([\d.]+|inf|nan)x", out), out


def test_the_resident_count_follows_the_measured_cost_of_a_model():
    # a budget that holds 3 resident models by their parameters alone (a shape-based estimate) but 2 by what
    # a loaded engine holds besides its KV (its rotary table too): the plan must be the measured one
    config = EngineConfig(model=ModelConfig("dummy:tiny-llama", max_model_len=256, load_format="dummy"),
                          cache=CacheConfig(block_size=16), device="cpu")
    weights, seq_kv = estimate_weight_bytes(config), kv_floor_bytes(config)
    core = EngineCore(config)
    measured = core.model_bytes
    assert measured > weights
    need_kv = 4 * seq_kv  # --min-kv-seqs 4
    memory = 3 * weights + 2 * seq_kv + need_kv
    assert 3 * measured + 2 * seq_kv + need_kv > memory >= 2 * measured + seq_kv + need_kv
    out, err, rc = bench("--num-models", "4", "--num-requests", "8", "--request-rate", "48", "--input-len", "16",
                         "--output-len", "4", "--memory", str(memory), "--no-single-baseline")
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    assert re.search(r"memory: budget [\d.]+ MiB \(--memory\); a model takes [\d.]+ MiB besides its KV", out), out
    assert re.search(r"models that fit: pool 2 resident of 4 ", out), out


def test_every_evicted_engine_is_gone_before_the_next_load():
    # async scheduling (a CUDA worker's default) makes each engine a reference cycle: one still referenced when
    # it is freed outlives the free, and the bench checks every free (it raises on one still referenced)
    out, err, rc = bench("--num-models", "4", "--zipf", "1", "--num-requests", "48", "--request-rate", "12",
                         "--input-len", "16", "--output-len", "8", "--async-scheduling", "--no-single-baseline")
    assert rc == 0, f"{out[-3000:]}\n{err[-3000:]}"
    evictions = re.search(r"(\d+) eviction\(s\) during the run", out)
    assert evictions and int(evictions[1]) >= 1, out  # model 3's requests need a load, so an eviction
    assert re.search(r"every evicted engine was gone before the next load", out), out


def test_an_interrupt_mid_run_is_the_error_reported():
    # requests in flight when the run stops: freeing the engines must not refuse and replace the interrupt
    argv = [sys.executable, "-m", "kvrelay.cli", "--log-level", "WARNING", "bench", "pool", "--device", "cpu",
            "--threads", "1", "--num-models", "2", "--num-requests", "400", "--request-rate", "1000", "--input-len",
            "16", "--output-len", "64", "--no-single-baseline"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"))
    for line in proc.stdout:
        if line.startswith("pool (one KV pool"):
            break
    time.sleep(0.5)  # into the run: the requests arrive within 0.4 s and each decodes 64 tokens
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err[-3000:]
    assert "still hold KV blocks" not in err and "another exception occurred" not in err, err[-3000:]
