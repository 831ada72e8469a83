"""The pool's eviction rule under bench pool's Zipf mix, through its simulator's CLI (bench/eviction_sim.py,
the real choose_victims in simulated time; tests never import bench code): with issue #26's run (8 models, 4
slots, 320 requests at 8/s, 6 s loads, seed 0) the three most requested models stay resident and the tail takes
the loads, each at most twice, and every request is served. Simulated seconds only: no wall clock."""

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


def test_the_simulated_zipf_mix_keeps_the_three_most_requested_models_resident(tmp_path):
    out = tmp_path / "sim.json"
    subprocess.run([sys.executable, "-m", "kvrelay.bench.eviction_sim", "--seed", "0", "--json", str(out)],
                   check=True, capture_output=True, timeout=300, env=dict(os.environ, OMP_NUM_THREADS="1"))
    r = json.loads(out.read_text())
    ttft = {int(m): v for m, v in r["ttft"].items()}
    loads = {int(m): v for m, v in r["loads"].items()}
    assert all(len(ttft[m]) == r["requests"][str(m)] for m in range(8))  # every request served: no starvation
    top = [percentile(ttft[m], 99) for m in range(3)]
    tail = [percentile(ttft[m], 50) for m in range(4, 8)]
    assert max(top) < 1.0 < min(tail), (top, tail)
    assert sum(loads[m] for m in range(3)) == 0, loads
    # the tail takes the loads, each at most a couple of times (no two models taking turns on a slot)
    assert all(loads[m] >= 1 for m in range(4, 8)) and max(loads.values()) <= 2, loads
    while_asked = {victim for t, victim, _ in r["evictions"] if t <= r["last_arrival"]}  # after: rates decay
    assert while_asked and while_asked.isdisjoint({0, 1, 2}), r["evictions"]
