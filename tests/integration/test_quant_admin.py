"""A model's quantization per model: the admin API registers it (vLLM's names only, 400 naming the field
otherwise) and every worker's load command carries it; the multi-model config file takes it per entry.

Real Redis, the real gateway app on a real port, real HTTP; the workers are the scripted layer of
model_pool_harness.py.
"""

from collections.abc import Iterator

import pytest

from tests.integration.model_pool_harness import Env, add_version, model_pool
from tests.integration.per_model_setting import (
    check_config_file_takes_it_per_model,
    check_registered_setting_reaches_every_load,
    check_unknown_value_is_a_400_naming_the_field,
    worker_config_with,
)

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def env(redis_url, tmp_path_factory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("quant_admin")
    for name in ("q4", "plain"):
        add_version(tmp / "repo", name, 1)
    with model_pool(redis_url, tmp / "repo", tmp, db=11) as env:
        yield env


def test_registered_quantization_reaches_every_workers_load(env):
    check_registered_setting_reaches_every_load(env, "quantization", "q4", "awq", ("qpf-1", "qdc-1"))


def test_unknown_quantization_is_a_400_naming_the_field(env):
    check_unknown_value_is_a_400_naming_the_field(env, "quantization", "q4", "int4")


def test_config_file_takes_quantization_per_model(tmp_path):
    check_config_file_takes_it_per_model(tmp_path, "quantization", "int8", "nf4")


def test_worker_flags_and_config_file_reach_each_models_engine(tmp_path, redis_url):
    from kvrelay.cli import build_parser
    from kvrelay.workers import worker_config

    config = worker_config_with(tmp_path, redis_url, "unified", "quantization", "int8", "fp8")
    assert [m.engine.model.quantization for m in config.more_models] == ["int8", "fp8"]
    assert [s.quantization for s in config.register] == ["int8", ""]
    args = build_parser().parse_args(["unified-worker", "--model", "dummy:tiny-llama", "--device", "cpu",
                                      "--redis-url", redis_url, "--quantization", "awq"])
    assert worker_config("unified", args).engine.model.quantization == "awq"
