"""--pipeline-batch-queue on a worker of several models (a models file) is for every model that has a pipeline, its
own pipeline_parallel_size or the flag's, and refused where none has one; a model of the file may set its own
``pipeline_batch_queue``, refused in one line naming the key on a model of one stage. Each model's choice reaches
its engine, at startup and at every later load of it (lazy ones too)."""

import json
import time

import pytest

from kvrelay.cli import build_parser, main
from kvrelay.shared.config import engine as engine_config
from kvrelay.shared.config.engine import EngineConfig, ModelConfig
from kvrelay.shared.wire.protocol import ControlCommand
from kvrelay.shared.worker.model_host import ModelHost
from kvrelay.workers import worker_config
from tests.unit.serve_children import serve_children


@pytest.fixture(autouse=True)
def auto_is_cpu(monkeypatch):
    monkeypatch.setattr(engine_config, "auto_device", lambda: "cpu")


def _models(tmp_path, *entries: str):
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n" + "".join(f"  - {{name: {e}}}\n" for e in entries))
    return cfg


def _printed(capsys, argv: list[str]) -> dict[str, bool]:
    assert main(["unified-worker", "--device", "cpu", *argv, "--print-config"]) == 0, capsys.readouterr().err
    return {m["name"]: m["engine"]["pipeline_batch_queue"] for m in json.loads(capsys.readouterr().out)["more_models"]}


def test_a_models_own_key_reaches_its_engine_without_the_flag(tmp_path, capsys):
    cfg = _models(tmp_path, "piped, path: 'dummy:tiny-llama', pipeline_parallel_size: 2, pipeline_batch_queue: true",
                  "other, path: 'dummy:tiny-llama', pipeline_parallel_size: 2")
    assert _printed(capsys, ["--config", str(cfg)]) == {"piped": True, "other": False}


def test_a_models_own_false_keeps_it_out_of_the_flags_queue(tmp_path, capsys):
    cfg = _models(tmp_path, "piped, path: 'dummy:tiny-llama'",
                  "without, path: 'dummy:tiny-llama', pipeline_batch_queue: false")
    argv = ["--config", str(cfg), "--pipeline-parallel-size", "2", "--pipeline-batch-queue"]
    assert _printed(capsys, argv) == {"piped": True, "without": False}


def test_the_flag_takes_a_model_whose_own_size_pipelines_where_the_flags_does_not(tmp_path, capsys):
    cfg = _models(tmp_path, "piped, path: 'dummy:tiny-llama', pipeline_parallel_size: 2",
                  "single, path: 'dummy:tiny-llama'")
    assert _printed(capsys, ["--config", str(cfg), "--pipeline-batch-queue"]) == {"piped": True, "single": False}
    children = serve_children(["--config", str(cfg), "--device", "cpu", "--pipeline-batch-queue"])
    for role in ("prefill-worker", "decode-worker"):
        assert {m.name: m.engine.pipeline_batch_queue for m in children[role].config.more_models} == \
            {"piped": True, "single": False}
    # the decode worker's own size pipelines every model there; the prefill worker keeps the file's pipeline
    children = serve_children(["--config", str(cfg), "--device", "cpu", "--pipeline-batch-queue",
                               "--decode-pipeline-parallel-size", "2"])
    assert {m.name: m.engine.pipeline_batch_queue for m in children["prefill-worker"].config.more_models} == \
        {"piped": True, "single": False}
    assert {m.name: m.engine.pipeline_batch_queue for m in children["decode-worker"].config.more_models} == \
        {"piped": True, "single": True}


@pytest.mark.parametrize("own", ["pipeline_batch_queue: true", "pipeline_batch_queue: false",
                                 "pipeline_parallel_size: 1, pipeline_batch_queue: true"])
def test_a_models_own_key_on_a_model_of_one_stage_is_one_line_naming_it(tmp_path, capsys, own):
    cfg = _models(tmp_path, "a, path: 'dummy:tiny-llama'", f"b, path: 'dummy:tiny-llama', {own}")
    for argv in (["unified-worker", "--device", "cpu"], ["serve", "--device", "cpu"]):
        assert main([*argv, "--config", str(cfg), "--print-config"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"kvrelay {argv[0]}: error: {cfg}: models[1].pipeline_batch_queue: b: only with a pipeline_parallel_size "
            "of 2 or more (this model's is 1: no pipeline to keep filled)"]


@pytest.mark.parametrize("flag", ["--pipeline-batch-queue", "--no-pipeline-batch-queue"])
def test_the_flag_where_no_model_has_a_pipeline_is_one_line_naming_it(tmp_path, capsys, flag):
    cfg = _models(tmp_path, "a, path: 'dummy:tiny-llama'", "b, path: 'dummy:tiny-llama', pipeline_parallel_size: 1")
    for argv in (["unified-worker", "--device", "cpu"], ["serve", "--device", "cpu"]):
        assert main([*argv, "--config", str(cfg), flag, "--print-config"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            f"kvrelay {argv[0]}: error: argument --pipeline-batch-queue: only with --pipeline-parallel-size 2 or "
            f"more, or a model of {cfg} with a pipeline_parallel_size of 2 or more (with 1 there is no pipeline to "
            "keep filled)"]


def test_a_lazy_models_own_key_reaches_the_engine_of_its_load(tmp_path):
    from kvrelay.shared.repo.model_import import import_model
    from kvrelay.shared.repo.model_repo import ModelRepository
    from tests.conftest import make_tiny_model

    import_model(ModelRepository(tmp_path / "repo"), str(make_tiny_model("llama", tmp_path / "llama")), "lazy",
                 progress=False)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model_repo: {path: repo}\nmodels:\n"
                   "  - {name: lazy, load: lazy, pipeline_parallel_size: 2, pipeline_batch_queue: true}\n")
    config = worker_config("unified", build_parser().parse_args(
        ["unified-worker", "--config", str(cfg), "--device", "cpu", "--redis-url", "redis://127.0.0.1:1/0"]))
    assert config.batch_queues == {"lazy": True}
    host = ModelHost(config.engine, hold_finished_kv=False, pool=None, weights_budget=1 << 30,
                     repo=ModelRepository(config.model_repo), parallel_sizes=config.parallel_sizes,
                     batch_queues=config.batch_queues, verify_checksums=False)
    plan = host.plan(ControlCommand(command_id=f"load-{time.monotonic_ns()}", op="load", name="lazy", version=1))
    assert (plan.engine.pipeline_parallel_size, plan.engine.pipeline_batch_queue) == (2, True)


def test_a_model_of_its_own_queue_without_a_pipeline_is_refused_as_the_flag_is():
    base = EngineConfig(ModelConfig("m"), device="cpu")
    with pytest.raises(ValueError, match="argument --pipeline-batch-queue: only with --pipeline-parallel-size 2"):
        base.with_parallel_sizes(1, 1, True)
    assert base.with_parallel_sizes(1, 2, True).pipeline_batch_queue


def test_serve_takes_a_models_key_for_the_role_where_the_model_has_a_pipeline(tmp_path):
    cfg = _models(tmp_path, "piped, path: 'dummy:tiny-llama', pipeline_batch_queue: true",
                  "other, path: 'dummy:tiny-llama'")
    children = serve_children(["--config", str(cfg), "--device", "cpu", "--decode-pipeline-parallel-size", "2"])
    assert {m.name: m.engine.pipeline_batch_queue for m in children["decode-worker"].config.more_models} == \
        {"piped": True, "other": False}
    assert {m.name: m.engine.pipeline_batch_queue for m in children["prefill-worker"].config.more_models} == \
        {"piped": False, "other": False}  # one stage here
