"""A setting that takes effect only under another setting's value (shared/config/depends.py) is refused where it
would have none, in one line naming both keys, before anything loads: on a worker's command line, kvrelay serve's,
in a config handed over or built whole (the offline LLM), and in each model of a models file. Given with the value
that enables it, it is taken; left at its default, it never trips."""

import dataclasses
import io
import json
import re

import pytest

from kvrelay import LLM
from kvrelay.cli import main
from kvrelay.shared.config import engine as engine_config
from kvrelay.shared.config import handover
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.config.worker import WorkerConfig
from tests.unit.serve_children import serve_children, setting_at

TINY = ["--model", "dummy:tiny-llama"]
NO_PIPELINE = ("argument --pipeline-batch-queue: only with --pipeline-parallel-size 2 or more (with 1 there is no "
               "pipeline to keep filled)")
NOT_CHUNKED = ("argument --max-prefill-tokens-with-decodes: only with chunked prefill (--no-enable-chunked-prefill "
               "runs each prompt whole, which no cap can split)")
NO_FP8 = ("argument --calculate-kv-scales: only with --kv-cache-dtype fp8 (--kv-cache-dtype auto stores K and V "
          "unscaled)")
TARGET_NOT_CHUNKED = ("argument --target-step-ms: only with chunked prefill (--no-enable-chunked-prefill runs each "
                      "prompt whole, which no step-time target can split)")
ON_CPU = "only on a CUDA device (the device here is the CPU: --device cpu, or auto where torch sees no GPU)"

REFUSED = [  # (flags, the line): each given at a value other than its default, and at its default
    (["--pipeline-batch-queue"], NO_PIPELINE),
    (["--pipeline-parallel-size", "1", "--no-pipeline-batch-queue"], NO_PIPELINE),
    (["--no-enable-chunked-prefill", "--max-prefill-tokens-with-decodes", "64"], NOT_CHUNKED),
    (["--no-enable-chunked-prefill", "--max-prefill-tokens-with-decodes", "512"], NOT_CHUNKED),
    (["--calculate-kv-scales"], NO_FP8),
    (["--kv-cache-dtype", "auto", "--no-calculate-kv-scales"], NO_FP8),
    (["--no-enable-chunked-prefill", "--target-step-ms", "20"], TARGET_NOT_CHUNKED),
    (["--no-enable-chunked-prefill", "--target-step-ms", "0"], TARGET_NOT_CHUNKED),
    (["--device", "cpu", "--enforce-eager"], f"argument --enforce-eager: {ON_CPU}"),
    (["--device", "cpu", "--no-enforce-eager"], f"argument --enforce-eager: {ON_CPU}"),
    (["--device", "cpu", "--gpu-memory-utilization", "0.5"], f"argument --gpu-memory-utilization: {ON_CPU}"),
    (["--device", "cpu", "--cudagraph-mode", "FULL_AND_PIECEWISE"], f"argument --cudagraph-mode: {ON_CPU}"),
    (["--device", "cpu", "--cudagraph-mode", "FULL_DECODE_ONLY"], f"argument --cudagraph-mode: {ON_CPU}"),
    (["--device", "cuda", "--enforce-eager", "--cudagraph-mode", "FULL_AND_PIECEWISE"],
     "argument --cudagraph-mode: not with --enforce-eager, which is --cudagraph-mode NONE"),
    (["--device", "auto", "--gpu-memory-utilization", "0.9"], f"argument --gpu-memory-utilization: {ON_CPU}"),
]
TAKEN = [  # (flags, the setting's path in the engine config, its value there)
    (["--pipeline-parallel-size", "2", "--pipeline-batch-queue"], ("pipeline_batch_queue",), True),
    (["--max-prefill-tokens-with-decodes", "64"], ("scheduler", "max_prefill_tokens_with_decodes"), 64),
    (["--kv-cache-dtype", "fp8", "--calculate-kv-scales"], ("cache", "calculate_kv_scales"), True),
    (["--target-step-ms", "20"], ("scheduler", "target_step_ms"), 20.0),
    # no fixed cap: the target alone caps, up to the step's whole budget
    (["--max-prefill-tokens-with-decodes", "0", "--target-step-ms", "12.5"], ("scheduler", "target_step_ms"), 12.5),
    (["--device", "cuda", "--enforce-eager"], ("model", "enforce_eager"), True),
    (["--device", "cuda", "--cudagraph-mode", "FULL_AND_PIECEWISE"], ("model", "cudagraph_mode"), "FULL_AND_PIECEWISE"),
    (["--device", "cuda", "--enforce-eager", "--cudagraph-mode", "NONE"], ("model", "cudagraph_mode"), "NONE"),
    (["--device", "auto", "--gpu-memory-utilization", "0.5"], ("cache", "gpu_memory_utilization"), 0.5),
]


@pytest.fixture(autouse=True)
def auto_is_cpu(monkeypatch):
    """--device auto resolves to the CPU, as on a machine where torch sees no GPU."""
    monkeypatch.setattr(engine_config, "auto_device", lambda: "cpu")


def _plan(argv: list[str]) -> dict:
    return {command: child.config for command, child in serve_children([*TINY, *argv]).items()}


@pytest.mark.parametrize("role", ["decode", "unified"])
@pytest.mark.parametrize("argv,said", REFUSED)
def test_a_worker_refuses_a_flag_its_other_setting_leaves_without_effect_in_one_line(capsys, role, argv, said):
    assert main([f"{role}-worker", *TINY, *argv, "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [f"kvrelay {role}-worker: error: {said}"]


@pytest.mark.parametrize("argv,said", REFUSED)
def test_serve_refuses_it_before_any_process_starts(argv, said):
    with pytest.raises(ConfigError) as err:
        _plan(argv)
    assert str(err.value) == said


@pytest.mark.parametrize("argv,path,value", TAKEN)
def test_with_the_setting_that_enables_it_the_flag_is_taken(monkeypatch, capsys, argv, path, value):
    if "auto" in argv:
        monkeypatch.setattr(engine_config, "auto_device", lambda: "cuda")
    for role in ("decode", "unified"):
        assert main([f"{role}-worker", *TINY, *argv, "--print-config"]) == 0, capsys.readouterr().err
        assert setting_at(json.loads(capsys.readouterr().out)["engine"], path) == value
    for config in _plan(["--mode", "unified", *argv]).values():
        if isinstance(config, WorkerConfig):
            assert setting_at(config.engine, path) == value


def test_no_flag_given_trips_nothing_on_the_cpu(capsys):
    assert main(["unified-worker", *TINY, "--print-config"]) == 0
    children = _plan([])
    # serve splits --gpu-memory-utilization between the roles on a GPU only: on the CPU each keeps the default
    assert [c.engine.cache.gpu_memory_utilization for c in children.values() if isinstance(c, WorkerConfig)] == \
        [0.9, 0.9]
    assert EngineConfig(ModelConfig("m"), device="cpu").device == "cpu"


def test_serve_splits_the_memory_of_a_gpu_between_the_roles():
    children = _plan(["--device", "cuda", "--gpu-memory-utilization", "0.5"])
    assert children["prefill-worker"].engine.cache.gpu_memory_utilization == 0.15
    assert children["decode-worker"].engine.cache.gpu_memory_utilization == 0.35


def test_serve_gives_the_batch_queue_to_the_worker_with_a_pipeline():
    children = _plan(["--pipeline-batch-queue", "--decode-pipeline-parallel-size", "2"])
    assert children["decode-worker"].engine.pipeline_batch_queue
    assert not children["prefill-worker"].engine.pipeline_batch_queue  # it has no pipeline: the default


def test_each_model_of_a_models_file_has_the_batch_queue_where_it_has_a_pipeline(tmp_path, capsys):
    models = tmp_path / "models.yaml"
    models.write_text("models:\n  - {name: piped, path: 'dummy:tiny-llama'}\n"
                      "  - {name: single, path: 'dummy:tiny-llama', pipeline_parallel_size: 1}\n")
    argv = ["unified-worker", "--device", "cpu", "--config", str(models)]
    assert main([*argv, "--pipeline-parallel-size", "2", "--pipeline-batch-queue", "--print-config"]) == 0
    models = json.loads(capsys.readouterr().out)["more_models"]
    assert {m["name"]: m["engine"]["pipeline_batch_queue"] for m in models} == {"piped": True, "single": False}
    # where no model has a pipeline, and a model's own key: tests/unit/test_model_batch_queue.py


CONFIGS = [  # a config built whole: a value other than the default where it has no effect; the same in its JSON
    (dict(pipeline_batch_queue=True), ('"pipeline_batch_queue":false', '"pipeline_batch_queue":true'), NO_PIPELINE),
    (dict(scheduler=SchedulerConfig(enable_chunked_prefill=False, max_prefill_tokens_with_decodes=0)),
     ('"enable_chunked_prefill":true,"max_prefill_tokens_with_decodes":512',
      '"enable_chunked_prefill":false,"max_prefill_tokens_with_decodes":0'), NOT_CHUNKED),
    (dict(scheduler=SchedulerConfig(enable_chunked_prefill=False, target_step_ms=20)),
     ('"enable_chunked_prefill":true,"max_prefill_tokens_with_decodes":512,"target_step_ms":0.0',
      '"enable_chunked_prefill":false,"max_prefill_tokens_with_decodes":512,"target_step_ms":20.0'),
     TARGET_NOT_CHUNKED),
    (dict(model=ModelConfig("m", enforce_eager=True)), ('"enforce_eager":false', '"enforce_eager":true'),
     f"argument --enforce-eager: {ON_CPU}"),
    (dict(cache=CacheConfig(gpu_memory_utilization=0.8)),
     ('"gpu_memory_utilization":0.9', '"gpu_memory_utilization":0.8'), f"argument --gpu-memory-utilization: {ON_CPU}"),
]


@pytest.mark.parametrize("changes,json,said", CONFIGS)
def test_a_config_built_or_handed_over_with_a_setting_that_has_no_effect_is_refused(changes, json, said):
    engine = EngineConfig(ModelConfig("m"), device="cpu")
    with pytest.raises(ValueError, match=re.escape(said)):
        dataclasses.replace(engine, **changes)
    sent = handover.encode(WorkerConfig("unified", engine)).decode()
    assert sent.count(json[0]) == 1
    with pytest.raises(ConfigError) as err:
        handover.receive(WorkerConfig, io.StringIO(sent.replace(*json)))
    assert str(err.value) == f"config from the parent: engine: {said}"


@pytest.mark.parametrize("kwargs,said", [
    (dict(pipeline_batch_queue=True), NO_PIPELINE),
    (dict(enable_chunked_prefill=False, max_prefill_tokens_with_decodes=64), NOT_CHUNKED),
    (dict(enable_chunked_prefill=False, target_step_ms=20), TARGET_NOT_CHUNKED),
    (dict(device="cpu", enforce_eager=True), f"argument --enforce-eager: {ON_CPU}"),
    (dict(gpu_memory_utilization=0.5), f"argument --gpu-memory-utilization: {ON_CPU}"),  # auto: the CPU here
])
def test_the_offline_llm_refuses_it_in_one_line_before_loading(kwargs, said):
    with pytest.raises(ConfigError) as err:
        LLM(model="dummy:tiny-llama", **kwargs)
    assert str(err.value) == said
