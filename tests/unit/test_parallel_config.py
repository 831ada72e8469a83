"""Each model of a worker's ``--config`` may have its own ``tensor_parallel_size`` / ``pipeline_parallel_size``
(default: the worker's flags), reaching that model's engine and every later load of it (lazy ones too); a
group its model cannot form is one line naming the key, exit 2, before any process starts or any weight loads."""

import pytest
import torch

from kvrelay.cli import build_parser, main
from kvrelay.shared.config.declare import ConfigError
from kvrelay.workers import worker_config

# dummy:tiny-llama has 4 attention heads (2 KV heads) and 2 layers
BAD = [
    ("tensor_parallel_size: 3", "models[1].tensor_parallel_size: b: tensor_parallel_size 3 does not divide the "
                                "attention heads 4"),
    ("pipeline_parallel_size: 3", "models[1].pipeline_parallel_size: b: pipeline_parallel_size 3 exceeds the "
                                  "model's 2 layers: a stage would hold no layers"),
    ("tensor_parallel_size: 0", "models[1].tensor_parallel_size: input should be greater than or equal to 1 (got 0)"),
    ("tensor_parallel_size: 2, quantization: awq", "models[1].tensor_parallel_size: b: GPT2LMHeadModel supports "
                                                  "quantization int8 and fp8 of full-precision checkpoints only; got "
                                                  "awq (a pre-quantized checkpoint)"),
]


def _write(tmp_path, entry: str):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("models:\n  - {name: a, path: 'dummy:tiny-llama'}\n"
                   f"  - {{name: b, path: 'dummy:tiny-gpt2', {entry}}}\n")
    return cfg


def test_each_model_takes_its_own_sizes_or_the_flags(tmp_path):
    cfg = _write(tmp_path, "tensor_parallel_size: 2, pipeline_parallel_size: 2")
    args = build_parser().parse_args(["unified-worker", "--config", str(cfg), "--device", "cpu",
                                      "--pipeline-parallel-size", "2"])
    config = worker_config("unified", args)
    assert [(m.name, m.engine.tensor_parallel_size, m.engine.pipeline_parallel_size) for m in config.more_models] == \
        [("a", 1, 2), ("b", 2, 2)]
    assert config.parallel_sizes == {"a": (1, 2), "b": (2, 2)}  # what a reload after an eviction uses


@pytest.mark.parametrize(("entry", "message"), BAD, ids=[e for e, _ in BAD])
def test_a_group_the_model_cannot_form_is_one_line_naming_the_key(tmp_path, capsys, entry, message):
    cfg = _write(tmp_path, entry)
    assert main(["serve", "--config", str(cfg), "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvrelay serve: error: ") and err.endswith(f"{cfg}: {message}\n") and err.count("\n") == 1


def test_the_flag_is_named_when_it_is_the_flags_size(tmp_path):
    cfg = _write(tmp_path, "precision: auto")
    args = build_parser().parse_args(["unified-worker", "--config", str(cfg), "--device", "cpu",
                                      "--tensor-parallel-size", "8"])
    with pytest.raises(ConfigError, match=r"^argument --tensor-parallel-size: a: tensor_parallel_size 8 does not "
                                          r"divide the attention heads 4$"):
        worker_config("unified", args)
    args = build_parser().parse_args(["unified-worker", "--model", "dummy:tiny-llama", "--device", "cpu",
                                      "--pipeline-parallel-size", "4"])
    with pytest.raises(ConfigError, match=r"^argument --pipeline-parallel-size: pipeline_parallel_size 4 exceeds"):
        worker_config("unified", args)


def test_a_lazy_models_sizes_are_checked_at_start_and_kept_for_its_load(tmp_path, capsys):
    from kvrelay.shared.repo.model_import import import_model
    from kvrelay.shared.repo.model_repo import ModelRepository
    from tests.conftest import make_tiny_model

    import_model(ModelRepository(tmp_path / "repo"), str(make_tiny_model("llama", tmp_path / "llama")), "lazy",
                 progress=False)
    capsys.readouterr()  # what making the model printed
    cfg = tmp_path / "serve.yaml"

    def config(entry: str) -> list[str]:
        cfg.write_text(f"model_repo: {{path: repo}}\nmodels:\n  - {{name: lazy, load: lazy, {entry}}}\n")
        return ["--config", str(cfg), "--device", "cpu", "--redis-url", "redis://127.0.0.1:1/0"]

    assert worker_config("unified", build_parser().parse_args(
        ["unified-worker", *config("pipeline_parallel_size: 2")])).parallel_sizes == {"lazy": (1, 2)}
    assert main(["unified-worker", *config("tensor_parallel_size: 3")]) == 2
    assert capsys.readouterr().err == (f"kvrelay unified-worker: error: {cfg}: models[0].tensor_parallel_size: lazy: "
                                       "tensor_parallel_size 3 does not divide the attention heads 4\n")


@pytest.mark.skipif(torch.cuda.device_count() >= 4, reason="this machine has the devices")
def test_more_ranks_than_devices_is_one_line_before_anything_starts(capsys):
    argv = ["serve", "--mode", "unified", "--model", "dummy:tiny-llama", "--device", "cuda", "--tensor-parallel-size",
            "2", "--pipeline-parallel-size", "2"]
    assert main(argv) == 2
    assert capsys.readouterr().err == ("kvrelay serve: error: argument --tensor-parallel-size: tensor_parallel_size 2 "
                                       "x pipeline_parallel_size 2 needs CUDA devices 0..3; this machine has "
                                       f"{torch.cuda.device_count()}\n")
