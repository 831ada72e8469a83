"""--calculate-kv-scales on a worker of several models (a models file) is for every model whose KV cache is fp8, the
flag's or its own kv_cache_dtype, and refused where none is; a model of an unscaled cache runs without it. A model of
the file may set its own ``calculate_kv_scales`` (false keeps it out of the flag), refused in one line naming the key
on a model whose KV is not fp8. Each model's choice reaches its engine, at startup and at every later load of it;
serve gives both roles of a model the same choice, so their scale digests agree at the handoff."""

import json
import time

import pytest

from kvrelay.cli import build_parser, main
from kvrelay.shared.config import engine as engine_config
from kvrelay.shared.wire.protocol import ControlCommand
from kvrelay.shared.worker.model_host import ModelHost
from kvrelay.workers import worker_config
from tests.unit.serve_children import serve_children

FP8 = ["--kv-cache-dtype", "fp8"]


@pytest.fixture(autouse=True)
def auto_is_cpu(monkeypatch):
    monkeypatch.setattr(engine_config, "auto_device", lambda: "cpu")


def _models(tmp_path, *entries: str):
    cfg = tmp_path / "models.yaml"
    cfg.write_text("models:\n" + "".join(f"  - {{name: {e}, path: 'dummy:tiny-llama'}}\n" for e in entries))
    return cfg


def _printed(capsys, argv: list[str]) -> dict[str, bool]:
    assert main(["unified-worker", "--device", "cpu", *argv, "--print-config"]) == 0, capsys.readouterr().err
    return {m["name"]: m["engine"]["cache"]["calculate_kv_scales"]
            for m in json.loads(capsys.readouterr().out)["more_models"]}


def _refused(capsys, cfg, argv: list[str]) -> dict[str, list[str]]:
    """The stderr lines of a unified worker and of serve given ``argv`` with ``cfg``, each refused (exit 2)."""
    lines = {}
    for command in ("unified-worker", "serve"):
        assert main([command, "--device", "cpu", "--config", str(cfg), *argv, "--print-config"]) == 2
        lines[command] = capsys.readouterr().err.splitlines()
    return lines


def test_the_flag_leaves_out_a_model_of_an_unscaled_cache(tmp_path, capsys):
    cfg = _models(tmp_path, "scaled", "plain, kv_cache_dtype: auto")
    assert _printed(capsys, ["--config", str(cfg), *FP8, "--calculate-kv-scales"]) == {"scaled": True, "plain": False}


def test_the_flag_takes_a_model_whose_own_kv_is_fp8_where_the_workers_is_not(tmp_path, capsys):
    cfg = _models(tmp_path, "scaled, kv_cache_dtype: fp8", "plain")
    assert _printed(capsys, ["--config", str(cfg), "--calculate-kv-scales"]) == {"scaled": True, "plain": False}


def test_a_models_own_key_reaches_its_engine_without_the_flag(tmp_path, capsys):
    cfg = _models(tmp_path, "mine, calculate_kv_scales: true", "other")
    assert _printed(capsys, ["--config", str(cfg), *FP8]) == {"mine": True, "other": False}


def test_a_models_own_false_keeps_it_out_of_the_flag(tmp_path, capsys):
    cfg = _models(tmp_path, "scaled", "without, calculate_kv_scales: false")
    assert _printed(capsys, ["--config", str(cfg), *FP8, "--calculate-kv-scales"]) == {"scaled": True, "without": False}


@pytest.mark.parametrize(("own", "flags"), [("calculate_kv_scales: true", []),
                                            ("calculate_kv_scales: false", []),
                                            ("kv_cache_dtype: auto, calculate_kv_scales: true", FP8)])
def test_a_models_own_key_on_an_unscaled_cache_is_one_line_naming_it(tmp_path, capsys, own, flags):
    cfg = _models(tmp_path, "a", f"b, {own}")
    for command, lines in _refused(capsys, cfg, flags).items():
        assert lines == [f"kvrelay {command}: error: {cfg}: models[1].calculate_kv_scales: b: only with a "
                         "kv_cache_dtype of fp8 (this model's is auto: K and V are stored unscaled)"]


@pytest.mark.parametrize("flag", ["--calculate-kv-scales", "--no-calculate-kv-scales"])
def test_the_flag_where_no_models_kv_is_fp8_is_one_line_naming_it(tmp_path, capsys, flag):
    cfg = _models(tmp_path, "a", "b, kv_cache_dtype: auto")
    for command, lines in _refused(capsys, cfg, [flag]).items():
        assert lines == [f"kvrelay {command}: error: argument --calculate-kv-scales: only with a model whose KV cache "
                         f"is fp8 (--kv-cache-dtype fp8, or a model of {cfg} with a kv_cache_dtype of fp8; auto stores "
                         "K and V unscaled)"]


def test_a_model_of_several_ranks_is_refused_the_flag_unless_its_key_keeps_it_out(tmp_path, capsys):
    cfg = _models(tmp_path, "a", "staged, pipeline_parallel_size: 2")
    assert _refused(capsys, cfg, [*FP8, "--calculate-kv-scales"])["unified-worker"] == [
        f"kvrelay unified-worker: error: argument --calculate-kv-scales: {cfg}: models[1]: staged: not with a "
        "tensor_parallel_size or pipeline_parallel_size above 1 (this model's are 1 and 2: each rank computes only "
        "its own heads or layers; calculate_kv_scales: false keeps it out of the flag)"]
    cfg = _models(tmp_path, "a", "staged, pipeline_parallel_size: 2, calculate_kv_scales: false")
    assert _printed(capsys, ["--config", str(cfg), *FP8, "--calculate-kv-scales"]) == {"a": True, "staged": False}


def test_serve_gives_both_roles_of_a_model_the_same_choice(tmp_path):
    cfg = _models(tmp_path, "scaled", "plain, kv_cache_dtype: auto", "mine, calculate_kv_scales: false")
    children = serve_children(["--config", str(cfg), "--device", "cpu", *FP8, "--calculate-kv-scales"])
    for role in ("prefill-worker", "decode-worker"):
        config = children[role].config
        assert {m.name: m.engine.cache.calculate_kv_scales for m in config.more_models} == \
            {"scaled": True, "plain": False, "mine": False}
        assert config.calculated_kv_scales == {"scaled": True, "plain": False, "mine": False}


def _lazy_host(tmp_path, entries: str, argv: list[str]):
    from kvrelay.shared.repo.model_import import import_model
    from kvrelay.shared.repo.model_repo import ModelRepository
    from tests.conftest import make_tiny_model

    llama = str(make_tiny_model("llama", tmp_path / "llama"))
    for name in ("lazy", "plain", "staged"):
        import_model(ModelRepository(tmp_path / "repo"), llama, name, progress=False)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("model_repo: {path: repo}\nmodels:\n" + entries)
    config = worker_config("unified", build_parser().parse_args(
        ["unified-worker", "--config", str(cfg), "--device", "cpu", "--redis-url", "redis://127.0.0.1:1/0", *argv]))
    host = ModelHost(config.engine, hold_finished_kv=False, pool=None, weights_budget=1 << 30,
                     repo=ModelRepository(config.model_repo), parallel_sizes=config.parallel_sizes,
                     calculated_kv_scales=config.calculated_kv_scales, later_kv_scales=config.later_kv_scales,
                     verify_checksums=False)
    return config, host


def _load(host: ModelHost, name: str, kv_cache_dtype: str = ""):
    cmd = ControlCommand(command_id=f"load-{time.monotonic_ns()}", op="load", name=name, version=1,
                         kv_cache_dtype=kv_cache_dtype)
    return host.plan(cmd).engine.cache


def test_a_lazy_models_own_key_reaches_the_engine_of_its_load(tmp_path):
    config, host = _lazy_host(tmp_path, "  - {name: lazy, load: lazy, calculate_kv_scales: true}\n", FP8)
    assert config.calculated_kv_scales == {"lazy": True}
    assert _load(host, "lazy").calculate_kv_scales


def test_a_later_load_of_an_unscaled_cache_runs_without_the_flag(tmp_path):
    entries = ("  - {name: lazy, load: lazy}\n  - {name: plain, load: lazy, kv_cache_dtype: auto}\n"
               "  - {name: staged, load: lazy, pipeline_parallel_size: 2, calculate_kv_scales: false}\n")
    config, host = _lazy_host(tmp_path, entries, [*FP8, "--calculate-kv-scales"])
    assert config.calculated_kv_scales == {"lazy": True, "plain": False, "staged": False}
    cache = _load(host, "plain", kv_cache_dtype="auto")  # as the registry's entry gives it
    assert (cache.kv_cache_dtype, cache.calculate_kv_scales) == ("auto", False)
    assert _load(host, "lazy").calculate_kv_scales
    assert not _load(host, "staged").calculate_kv_scales


def test_serve_refuses_a_choice_one_role_of_the_model_could_not_make(tmp_path, capsys):
    # the decode worker's own pipeline gives the model ranks there alone: measured on the prefill side only, its
    # scales would not be the decode side's, so serve refuses rather than start a pair whose handoff it refuses
    cfg = _models(tmp_path, "scaled")
    assert main(["serve", "--device", "cpu", "--config", str(cfg), *FP8, "--calculate-kv-scales",
                 "--decode-pipeline-parallel-size", "2", "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"kvrelay serve: error: argument --calculate-kv-scales: {cfg}: models[0]: scaled: not with a "
        "tensor_parallel_size or pipeline_parallel_size above 1 (this model's are 1 and 2: each rank computes only "
        "its own heads or layers; calculate_kv_scales: false keeps it out of the flag)"]


def test_a_model_the_admin_api_registers_with_an_fp8_kv_gets_the_flag_on_a_worker_whose_own_kv_is_auto(tmp_path):
    # the flag is accepted beside a model repository whatever the worker's own KV, so it must reach a model that
    # arrives later with a kv_cache_dtype of its own, and leave one of an unscaled cache alone
    config, host = _lazy_host(tmp_path, "  - {name: lazy, load: lazy, kv_cache_dtype: fp8}\n", ["--calculate-kv-scales"])
    assert config.engine.cache.kv_cache_dtype == "auto"
    cache = _load(host, "plain", kv_cache_dtype="fp8")  # not in the models file: as the admin API registers it
    assert (cache.kv_cache_dtype, cache.calculate_kv_scales) == ("fp8", True)
    cache = _load(host, "staged")
    assert (cache.kv_cache_dtype, cache.calculate_kv_scales) == ("auto", False)


def test_a_worker_of_a_repository_alone_takes_the_flag_for_the_models_it_loads_later(tmp_path, capsys):
    (tmp_path / "repo").mkdir()
    argv = ["unified-worker", "--device", "cpu", "--model-repo", str(tmp_path / "repo"), "--calculate-kv-scales"]
    assert main([*argv, "--print-config"]) == 0, capsys.readouterr().err
    assert json.loads(capsys.readouterr().out)["later_kv_scales"]
    assert main([*argv, "--pipeline-parallel-size", "2", "--print-config"]) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        "argument --calculate-kv-scales: not with --tensor-parallel-size or --pipeline-parallel-size above 1 (each "
        "rank computes only its own heads or layers)")
