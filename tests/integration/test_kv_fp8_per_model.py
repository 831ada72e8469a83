"""``kv_cache_dtype`` per model, as ``quantization`` is: the flag on every role (a bad value is one line
naming it, exit 2), the multi-model config file per entry (a bad value is one line naming the key), the
admin API registers it (400 naming the field otherwise), every worker's load command carries it, and a
worker's models keep their own KV dtype in its one KV pool (an fp8 model beside a full-precision one,
each serving).

Real Redis, the real gateway app on a real port, real HTTP; the admin test's workers are the scripted layer
of model_pool_harness.py; the pool test runs real engines under a real ModelHost."""

from collections.abc import Iterator

import pytest
import torch

from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from tests.conftest import make_tiny_model
from tests.integration.model_pool_harness import Env, add_version, model_pool
from tests.integration.per_model_setting import (
    check_config_file_takes_it_per_model,
    check_registered_setting_reaches_every_load,
    check_unknown_value_is_a_400_naming_the_field,
    worker_config_with,
)
from tests.unit.test_model_host import generate, load, make_host, run

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def env(redis_url, tmp_path_factory) -> Iterator[Env]:
    tmp = tmp_path_factory.mktemp("kv_fp8_admin")
    for name in ("small", "plain"):
        add_version(tmp / "repo", name, 1)
    with model_pool(redis_url, tmp / "repo", tmp, db=12) as env:
        yield env


def test_registered_kv_cache_dtype_reaches_every_workers_load(env):
    check_registered_setting_reaches_every_load(env, "kv_cache_dtype", "small", "fp8", ("kpf-1", "kdc-1"))


def test_unknown_kv_cache_dtype_is_a_400_naming_the_field(env):
    check_unknown_value_is_a_400_naming_the_field(env, "kv_cache_dtype", "small", "fp16")


def test_config_file_takes_kv_cache_dtype_per_model(tmp_path):
    check_config_file_takes_it_per_model(tmp_path, "kv_cache_dtype", "fp8", "int8")


def test_worker_flags_and_config_file_reach_each_models_engine(tmp_path, redis_url):
    config = worker_config_with(tmp_path, redis_url, "decode", "kv_cache_dtype", "auto", "fp8")
    assert [m.engine.cache.kv_cache_dtype for m in config.more_models] == ["auto", "fp8"]
    assert [s.kv_cache_dtype for s in config.register] == ["auto", ""]


def test_models_of_one_worker_keep_their_own_kv_dtype_in_its_pool(tmp_path):
    repo = ModelRepository(tmp_path / "repo")
    for i, name in enumerate(("a", "b")):
        import_model(repo, str(make_tiny_model("llama", tmp_path / name, seed=i)), name, progress=False)
    host, results = make_host(repo)
    run(host, load("a", kv_cache_dtype="fp8"), load("b"))
    assert all(r.ok for r in results), results
    a, b = host.slots["a@1"].core, host.slots["b@1"].core
    assert (a.kv_dtype, b.kv_dtype) == (torch.float8_e4m3fn, torch.float32)
    # one pool's buffer under both, its blocks sized by each model's own KV dtype
    assert a.runner.kv_cache.untyped_storage().data_ptr() == b.runner.kv_cache.untyped_storage().data_ptr()
    assert a.block_bytes * 4 == b.block_bytes
    assert len(generate(host, "a@1")) == len(generate(host, "b@1")) == 4


@pytest.mark.parametrize("role", ["serve", "prefill-worker", "decode-worker", "unified-worker"])
def test_a_bad_flag_value_is_one_line_naming_it(role, tmp_path):
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", role, "--kv-cache-dtype", "fp16"],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr == (f"kvrelay {role}: error: argument --kv-cache-dtype: invalid choice: 'fp16' (choose from "
                           "'auto', 'fp8', 'fp8_e4m3')\n"), proc.stderr
