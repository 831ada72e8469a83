"""``kvrelay bench serve`` against a real deployment (gateway, prefill and decode worker as processes)
on a tiny model: every request succeeds and the counts in the result JSON add up. The numbers
themselves are the benchmark's business (BENCHMARKS.md), so nothing here asserts on timing."""

import json

import numpy as np
import pytest

from kvrelay.cli import main
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster

pytestmark = pytest.mark.slow
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8"]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 24, 8
COLD = 2  # --cold-requests: the first 2 requests' TTFT beside the other 4's


@pytest.fixture()
def cluster(tiny_dir, tmp_path):
    with EmbeddedRedis() as redis_url:
        with Cluster(redis_url, str(tiny_dir), ENGINE + ["--served-model-name", "tiny"], tmp_path).disaggregated() as c:
            yield c


def test_bench_serve_counts_every_token(cluster, tiny_dir, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = main(["--log-level", "WARNING", "bench", "serve", "--base-url", cluster.base_url, "--num-prompts",
                 str(NUM_PROMPTS), "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                 "--max-concurrency", "3", "--compare-offline", "--save-result", str(out),
                 "--cold-start", "--cold-requests", str(COLD),
                 "--", "--model", str(tiny_dir), *ENGINE])
    assert code == 0, capsys.readouterr().out
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed
    assert f"First {COLD} requests after /ready vs the rest" in printed
    doc = json.loads(out.read_text())
    [run] = doc["runs"]
    assert run["model_id"] == "tiny"  # found through /v1/models
    assert (run["completed"], run["failed"]) == (NUM_PROMPTS, 0)
    assert run["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert run["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos: exactly output_len each
    assert run["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert all(t > 0 for t in run["ttfts"])
    # the client's own CPU over the run, printed: what tells a client-bound run from a server-bound one
    assert run["client_cpu_share"] > 0 and "Client CPU (share of one core):" in printed
    # the split is the per-request TTFTs of this same run, in send order: first COLD, then the rest
    cold, ms = run["cold_start"], np.asarray(run["ttfts"]) * 1000.0
    assert (cold["first"], cold["rest"], cold["from_ready"]) == (COLD, NUM_PROMPTS - COLD, True)
    for stat, fn in (("median", np.median), ("p99", lambda a: np.percentile(a, 99))):
        assert cold[f"{stat}_ttft_first_ms"] == pytest.approx(fn(ms[:COLD]))
        assert cold[f"{stat}_ttft_rest_ms"] == pytest.approx(fn(ms[COLD:]))
        assert cold[f"{stat}_ttft_ratio"] == pytest.approx(fn(ms[:COLD]) / fn(ms[COLD:]))
    # the server's own TTFT split covers this run's requests alone (scraped after the warm-up, if any) and tiles
    # the gateway's TTFT
    stages = run["ttft_stages"]
    assert "TTFT stages (ms, server)" in printed
    assert (stages["requests"], stages["unsplit"]) == (NUM_PROMPTS, 0)
    assert sum(s["mean_ms"] for s in stages["stages"].values()) == pytest.approx(stages["ttft_mean_ms"], rel=0.02)
    assert set(doc["offline"]) == {"offline, all at once", "offline, same schedule"}
    for offline in doc["offline"].values():
        assert offline["completed"] == NUM_PROMPTS
        assert offline["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert len(doc["comparison"]) == 2


def test_bench_serve_refuses_a_remote_target(capsys):
    with pytest.raises(SystemExit, match="not a loopback address"):
        main(["bench", "serve", "--base-url", "http://192.0.2.1:8000/v1", "--num-prompts", "1"])


def test_offline_only_runs_the_engine_on_the_served_prompts_and_schedule(tiny_dir, tmp_path, capsys):
    out = tmp_path / "offline.json"
    args = ["--log-level", "WARNING", "bench", "serve", "--num-prompts", str(NUM_PROMPTS), "--input-len", str(INPUT_LEN),
            "--output-len", str(OUTPUT_LEN), "--request-rate", "50", "--offline-only", "--save-result", str(out)]
    assert main([*args, "--", "--model", str(tiny_dir), *ENGINE]) == 0, capsys.readouterr().out
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" not in printed  # no server loaded
    doc = json.loads(out.read_text())
    assert doc["runs"] == []
    # a served run at a finite rate is paced: so is the offline engine's second pass, beside all-at-once
    assert set(doc["offline"]) == {"offline, all at once", "offline, same schedule"}
    for offline in doc["offline"].values():
        assert (offline["completed"], offline["failed"]) == (NUM_PROMPTS, 0)
        assert offline["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
        assert offline["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN


@pytest.mark.parametrize("extra", [["--base-url", "http://127.0.0.1:8000/v1"], ["--compare-offline"], []])
def test_offline_only_refuses_a_server_or_no_engine(extra, capsys):
    engine = [] if not extra else ["--", "--model", "smollm2"]
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--offline-only", *extra, *engine])
    assert "--offline-only" in str(exc.value)
