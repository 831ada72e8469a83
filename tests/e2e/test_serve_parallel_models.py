"""``kvrelay serve --mode unified --config`` with models of their own parallel sizes in one worker: a
single-rank model, a tensor-parallel pair and a two-stage pipeline, each its own rank group over the worker's
KV pool, answer with the offline engine's greedy text; ``GET /admin/models`` shows each instance's group:
its sizes, every rank's process (alive, under serve), device and shard, and the weights it counts."""

import psutil
import pytest

from kvrelay import LLM, SamplingParams
from tests.e2e.served import Served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = "The capital of France is"
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--kv-cache-memory", str(16 << 20)]


def test_models_of_their_own_parallel_sizes_are_served_and_shown_as_groups(tiny_model_dir, tmp_path):
    with LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=256) as llm:
        want = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"models:\n  - {{name: single, path: '{tiny_model_dir}'}}\n"
                   f"  - {{name: pair, path: '{tiny_model_dir}', tensor_parallel_size: 2}}\n"
                   f"  - {{name: stages, path: '{tiny_model_dir}', pipeline_parallel_size: 2}}\n")
    with Served(["--mode", "unified", "--config", str(cfg), "--device", "cpu", *ENGINE], tmp_path / "serve.log",
                timeout=300) as served:
        client = served.client()
        for name in ("single", "pair", "stages"):
            got = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0.0)
            assert got.choices[0].text == want, name
        models = served.models()
        under_serve = {p.pid: p.cmdline() for p in psutil.Process(served.proc.pid).children(recursive=True)}
    rows = {name: models[name]["instances"][0]["workers"] for name in ("single", "pair", "stages")}
    assert all(len(workers) == 1 for workers in rows.values())
    single, pair, stages = (rows[n][0] for n in ("single", "pair", "stages"))
    worker_pid = single["ranks"][0]["pid"]
    assert (single["tensor_parallel_size"], single["pipeline_parallel_size"]) == (1, 1)
    assert single["ranks"] == [{"rank": 0, "pid": worker_pid, "device": "cpu", "weight_bytes": single["weight_bytes"]}]
    for row, sizes in ((pair, (2, 1)), (stages, (1, 2))):
        assert (row["tensor_parallel_size"], row["pipeline_parallel_size"]) == sizes
        assert [(r["rank"], r["device"]) for r in row["ranks"]] == [(0, "cpu"), (1, "cpu")]
        assert row["ranks"][0]["pid"] == worker_pid  # rank 0 is the worker process itself
        assert "kvrelay.shared.engine.ranks.rank_main" in under_serve[row["ranks"][1]["pid"]]
        # on the CPU every rank's shard is in the one host memory: the group counts them all
        assert row["weight_bytes"] == sum(r["weight_bytes"] for r in row["ranks"])
    # the tied LM head is the embedding, which the first and the last stage both hold; a pair splits it
    assert stages["weight_bytes"] > single["weight_bytes"] * 1.5
    assert single["weight_bytes"] < pair["weight_bytes"] < single["weight_bytes"] * 1.1  # the norms are on both
