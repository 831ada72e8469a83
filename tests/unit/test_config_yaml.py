"""``serve.yaml`` (``kvrelay serve --config``, a worker's ``--config``) is checked strictly: an unknown key
or a value of the wrong type is one line naming the file and the key, exit 2, before anything starts,
never a silently applied default."""

import subprocess
import sys

import pytest

from kvrelay.cli import main
from kvrelay.serve_config import load_serve_config
from kvrelay.shared.config.declare import ConfigError

BAD = [
    ("pinnned: true", "models[0].pinnned: unknown key"),
    ("keep_alive: 600", "models[0].keep_alive: unknown key"),
    ("precison: float16", "models[0].precison: unknown key"),
    ('pinned: "no"', "models[0].pinned: input should be a valid boolean (got 'no')"),
    ("min_replicas: -3", "models[0].min_replicas: input should be greater than or equal to 0 (got -3)"),
    ("keep_alive_s: .nan", "models[0].keep_alive_s: input should be a finite number (got nan)"),
    ("version: 2.7", "models[0].version: input should be a valid integer (got 2.7)"),
    ("device: gpu9", "models[0].device: must be auto, cpu, cuda or cuda:N (got 'gpu9')"),
    ("precision: float8", "models[0].precision: input should be 'auto', 'float32', 'float16' or 'bfloat16' "
                          "(got 'float8')"),
    ("load: eager", "models[0].load: input should be 'startup' or 'lazy' (got 'eager')"),
]


def write(tmp_path, entry: str):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"models:\n  - {{name: tiny, path: 'dummy:tiny-llama', {entry}}}\n")
    return cfg


@pytest.mark.parametrize("entry,message", BAD, ids=[e for e, _ in BAD])
def test_loader_names_file_and_key(tmp_path, entry, message):
    cfg = write(tmp_path, entry)
    with pytest.raises(ValueError) as exc:
        load_serve_config(cfg)
    assert str(exc.value) == f"{cfg}: {message}"


@pytest.mark.parametrize("command", ["serve", "prefill-worker", "unified-worker"])
@pytest.mark.parametrize("entry,message", BAD[:4], ids=[e for e, _ in BAD[:4]])
def test_cli_says_it_in_one_line_and_exits_2(tmp_path, capsys, command, entry, message):
    cfg = write(tmp_path, entry)
    assert main([command, "--config", str(cfg), "--device", "cpu"]) == 2
    captured = capsys.readouterr()
    assert captured.err == f"kvrelay {command}: error: {cfg}: {message}\n" and captured.out == ""


def test_structure_mistakes(tmp_path):
    cfg = tmp_path / "serve.yaml"
    for text, message in [("models: []\n", "models: list should have at least 1 item after validation"),
                          ("modles:\n  - {name: a, path: /x}\n", "modles: unknown key"),
                          ("models:\n  - {path: /x}\n", "models[0].name: field required"),
                          ("model_repo: {type: s3}\nmodels:\n  - {name: a, path: /x}\n",
                           "model_repo.type: input should be 'local'"),
                          ("models:\n  - {name: a}\n", "models[0]: give a path, or a model_repo"),
                          ("models:\n  - {name: a, path: /x}\n  - {name: a, path: /y}\n",
                           "models: names must be unique"),
                          ("models:\n  - {name: a, path: /x, load: lazy}\n",
                           "models[0].load: a lazily loaded model must come from the model_repo"),
                          ("models:\n  - {name: a, path: 'dummy:tiny-llama', version: 2}\n",  # was ignored
                           "models[0].version: only for a model from the model_repo (path names its files)"),
                          ("models: [\n", "while parsing")]:
        cfg.write_text(text)
        with pytest.raises(ConfigError, match="^" + str(cfg) + ": ") as exc:
            load_serve_config(cfg)
        assert message in str(exc.value) and "\n" not in str(exc.value), str(exc.value)


def test_right_types_load(tmp_path):
    cfg = tmp_path / "serve.yaml"
    cfg.write_text("models:\n  - {name: a, path: 'dummy:tiny-llama', pinned: true, keep_alive_s: 600, "
                   "min_replicas: 1, device: 'cuda:1', precision: bfloat16}\n")
    _, [model] = load_serve_config(cfg)
    assert (model.pinned, model.keep_alive_s, model.min_replicas, model.device, model.dtype) == \
        (True, 600.0, 1, "cuda:1", "bfloat16")


def test_a_real_process_exits_2_before_starting_anything(tmp_path):
    cfg = write(tmp_path, "pinnned: true")
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--config", str(cfg)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == f"kvrelay serve: error: {cfg}: models[0].pinnned: unknown key\n"
