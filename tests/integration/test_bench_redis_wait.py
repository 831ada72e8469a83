"""``python -m kvrelay.bench.redis_wait`` runs against its real master and replica and prints its table."""

import subprocess
import sys


def test_the_wait_bench_prints_a_row_per_mode():
    out = subprocess.run([sys.executable, "-m", "kvrelay.bench.redis_wait", "--requests", "40", "--concurrency", "2"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    rows = [line.split() for line in out.stdout.splitlines()[1:]]
    assert [(r[0], r[1]) for r in rows] == [("2", "no"), ("2", "yes")] and all(float(r[2]) > 0 for r in rows)
