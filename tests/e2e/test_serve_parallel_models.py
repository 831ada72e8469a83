"""``kvrelay serve --config`` with models of their own parallel sizes in one worker per role: a single-rank
model, a tensor-parallel pair and (unified) a two-stage pipeline, each its own rank group over its worker's KV
pool, answer with the offline engine's greedy text; ``GET /admin/models`` shows each instance's group per
worker: its sizes, every rank's process (alive, under serve), device and shard, and the weights it counts."""

import psutil
import pytest

from kvrelay import SamplingParams
from tests.e2e.served import Served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = "The capital of France is"
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--kv-cache-memory", str(16 << 20)]


@pytest.mark.parametrize("mode", ["unified", "disaggregated"])
def test_models_of_their_own_parallel_sizes_are_served_and_shown_as_groups(mode, tiny_model_dir, tiny_offline,
                                                                           tmp_path):
    """Disaggregated, each role hosts each group (the pair's KV handed from prefill ranks to decode ranks,
    each side's cache in its worker's pool); the stages are the unified worker's alone (the handoff's roles
    take pipeline parallelism elsewhere)."""
    names = ("single", "pair", "stages") if mode == "unified" else ("single", "pair")
    want = tiny_offline.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    cfg = tmp_path / "serve.yaml"
    sizes = {"single": "", "pair": ", tensor_parallel_size: 2", "stages": ", pipeline_parallel_size: 2"}
    cfg.write_text("models:\n" + "".join(f"  - {{name: {n}, path: '{tiny_model_dir}'{sizes[n]}}}\n" for n in names))
    with Served(["--mode", mode, "--config", str(cfg), "--device", "cpu", *ENGINE], tmp_path / "serve.log",
                timeout=300) as served:
        client = served.client()
        for name in names:
            got = client.completions.create(model=name, prompt=PROMPT, max_tokens=12, temperature=0.0)
            assert got.choices[0].text == want, name
        models = served.models()
        under_serve = {p.pid: p.cmdline() for p in psutil.Process(served.proc.pid).children(recursive=True)}
    roles = ("unified",) if mode == "unified" else ("prefill", "decode")
    for role in roles:
        rows = {n: [w for w in models[n]["instances"][0]["workers"] if w["role"] == role] for n in names}
        assert all(len(workers) == 1 for workers in rows.values()), rows
        check_groups({n: rows[n][0] for n in names}, under_serve)


def check_groups(rows: dict[str, dict], under_serve: dict[int, list[str]]) -> None:
    """One worker's rows of /admin/models: its single-rank model, its pair (and its stages)."""
    single = rows["single"]
    worker_pid = single["ranks"][0]["pid"]
    assert (single["tensor_parallel_size"], single["pipeline_parallel_size"]) == (1, 1)
    assert single["ranks"] == [{"rank": 0, "pid": worker_pid, "device": "cpu", "weight_bytes": single["weight_bytes"]}]
    for name, sizes in (("pair", (2, 1)), ("stages", (1, 2))):
        if name not in rows:
            continue
        row = rows[name]
        assert (row["tensor_parallel_size"], row["pipeline_parallel_size"]) == sizes
        assert [(r["rank"], r["device"]) for r in row["ranks"]] == [(0, "cpu"), (1, "cpu")]
        assert row["ranks"][0]["pid"] == worker_pid  # rank 0 is the worker process itself
        assert "kvrelay.shared.engine.ranks.rank_main" in under_serve[row["ranks"][1]["pid"]]
        # on the CPU every rank's shard is in the one host memory: the group counts them all
        assert row["weight_bytes"] == sum(r["weight_bytes"] for r in row["ranks"])
    if "stages" in rows:  # the tied LM head is the embedding, which the first and the last stage both hold
        assert rows["stages"]["weight_bytes"] > single["weight_bytes"] * 1.5
    assert single["weight_bytes"] < rows["pair"]["weight_bytes"] < single["weight_bytes"] * 1.1  # norms on both
