"""The checks every per-model setting (``quantization``, ``kv_cache_dtype``) passes: the admin API registers
it and both roles' load commands carry it, an unknown value is a 400 naming the field, the multi-model
config file takes it per entry (a bad value: one line naming the entry's key), and a worker's config holds
what its flag and its config file say."""

from pathlib import Path

import pytest

from kvrelay.serve_config import load_serve_config
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.worker import WorkerConfig
from tests.integration.model_pool_harness import Env


def check_registered_setting_reaches_every_load(env: Env, field: str, model: str, value: str,
                                                worker_ids: tuple[str, str]) -> None:
    """``model`` registered with ``field: value``, then "plain" (which the pool's repo must hold) without it:
    an empty value, so the worker applies its own flag."""
    p, d = env.worker(worker_ids[0], role="prefill"), env.worker(worker_ids[1], role="decode")
    try:
        r = env.admin("POST", "/admin/models", json={"name": model, field: value})
        assert r.status_code == 201 and r.json()[field] == value, r.text
        assert env.admin("POST", f"/admin/models/{model}/load").status_code == 200
        assert [getattr(c, field) for c in p.ops("load") + d.ops("load")] == [value, value]  # both roles agree
        env.admin("POST", "/admin/models", json={"name": "plain"})
        assert env.admin("POST", "/admin/models/plain/load").status_code == 200
        assert [getattr(c, field) for c in p.ops("load") if c.name == "plain"] == [""]
    finally:
        p.stop()
        d.stop()


def check_unknown_value_is_a_400_naming_the_field(env: Env, field: str, model: str, value: str) -> None:
    r = env.admin("POST", "/admin/models", json={"name": model, field: value})
    assert r.status_code == 400 and r.json()["error"]["param"] == field, r.text


def check_config_file_takes_it_per_model(tmp_path: Path, field: str, value: str, bad: str) -> None:
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"models:\n  - {{name: a, path: 'dummy:tiny-llama', {field}: {value}}}\n"
                   "  - {name: b, path: 'dummy:tiny-llama'}\n")
    _, [a, b] = load_serve_config(cfg)
    assert (getattr(a, field), getattr(b, field)) == (value, "")
    cfg.write_text(f"models:\n  - {{name: a, path: 'dummy:tiny-llama', {field}: {bad}}}\n")
    with pytest.raises(ConfigError, match=rf"models\[0\]\.{field}: ") as exc:
        load_serve_config(cfg)
    assert "\n" not in str(exc.value)


def worker_config_with(tmp_path: Path, redis_url: str, role: str, field: str, entry_value: str,
                       flag_value: str) -> WorkerConfig:
    """A ``role`` worker's config from ``--<field> flag_value`` and a config file of two models, the first
    with ``field: entry_value``."""
    from kvrelay.cli import build_parser
    from kvrelay.workers import worker_config

    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"models:\n  - {{name: a, path: 'dummy:tiny-llama', {field}: {entry_value}}}\n"
                   "  - {name: b, path: 'dummy:tiny-llama'}\n")
    args = build_parser().parse_args([f"{role}-worker", "--config", str(cfg), "--device", "cpu", "--redis-url",
                                      redis_url, "--" + field.replace("_", "-"), flag_value])
    return worker_config(role, args)
