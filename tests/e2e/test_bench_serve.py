"""``kvrelay bench serve`` against a real deployment (gateway, prefill and decode worker as processes)
on a tiny model: every request succeeds and the counts in the result JSON add up. The numbers
themselves are the benchmark's business (BENCHMARKS.md), so nothing here asserts on timing."""

import json
import shutil

import pytest

from kvrelay.cli import main
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.conftest import make_tiny_model
from tests.e2e.cluster import Cluster

pytestmark = pytest.mark.slow
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8"]
NUM_PROMPTS, INPUT_LEN, OUTPUT_LEN = 6, 24, 8


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory, smollm2_dir):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("bench") / "tiny", seed=3)
    for f in smollm2_dir.iterdir():  # a real tokenizer, so the gateway can detokenize ids < 512
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture()
def cluster(tiny_dir, tmp_path):
    with EmbeddedRedis() as redis_url:
        c = Cluster(redis_url, str(tiny_dir), ENGINE + ["--served-model-name", "tiny"], tmp_path)
        c.start_gateway()
        c.start_worker("prefill", "p1")
        c.start_worker("decode", "d1")
        try:
            c.wait_ready()
            yield c
        finally:
            c.stop()


def test_bench_serve_counts_every_token(cluster, tiny_dir, tmp_path, capsys):
    out = tmp_path / "result.json"
    code = main(["--log-level", "WARNING", "bench", "serve", "--base-url", cluster.base_url, "--num-prompts",
                 str(NUM_PROMPTS), "--input-len", str(INPUT_LEN), "--output-len", str(OUTPUT_LEN),
                 "--max-concurrency", "3", "--compare-offline", "--save-result", str(out),
                 "--", "--model", str(tiny_dir), *ENGINE])
    assert code == 0, capsys.readouterr().out
    assert "Serving Benchmark Result" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    [run] = doc["runs"]
    assert run["model_id"] == "tiny"  # found through /v1/models
    assert (run["completed"], run["failed"]) == (NUM_PROMPTS, 0)
    assert run["total_input_tokens"] == NUM_PROMPTS * INPUT_LEN
    assert run["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN  # ignore_eos: exactly output_len each
    assert run["output_lens"] == [OUTPUT_LEN] * NUM_PROMPTS
    assert all(t > 0 for t in run["ttfts"])
    assert set(doc["offline"]) == {"offline, all at once", "offline, same schedule"}
    for offline in doc["offline"].values():
        assert offline["completed"] == NUM_PROMPTS
        assert offline["total_output_tokens"] == NUM_PROMPTS * OUTPUT_LEN
    assert len(doc["comparison"]) == 2


def test_bench_serve_refuses_a_remote_target(capsys):
    with pytest.raises(SystemExit, match="not a loopback address"):
        main(["bench", "serve", "--base-url", "http://192.0.2.1:8000/v1", "--num-prompts", "1"])
