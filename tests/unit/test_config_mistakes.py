"""The configuration mistakes a new user made (issue 14), each through a real ``kvrelay serve`` process: one
stderr line naming the setting (and for a path, the path checked), exit 2, and nothing loaded or created:
the model cache stays empty (the default model would be imported into it) and no folder appears."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

KEY = "argument --admin-key: String should have at least 16 characters"


def serve(tmp_path: Path, argv: list[str], env: dict[str, str] | None = None) -> str:
    """Runs ``kvrelay serve`` from a folder other than the config file's; returns its one stderr line."""
    cache, cwd = tmp_path / "cache", tmp_path / "elsewhere"
    cache.mkdir()
    cwd.mkdir()
    before = sorted(tmp_path.rglob("*"))
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", *argv], cwd=cwd, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "KVRELAY_CACHE": str(cache), **(env or {})})
    assert proc.returncode == 2 and proc.stdout == "", (proc.returncode, proc.stdout, proc.stderr)
    assert sorted(tmp_path.rglob("*")) == before  # nothing imported, no repository created
    [line] = proc.stderr.splitlines()
    return line


def test_a_short_admin_key_flag(tmp_path):
    assert serve(tmp_path, ["--admin-key", "short"]) == f"kvrelay serve: error: {KEY} (got 'short')"


def test_a_short_admin_key_from_the_environment(tmp_path):
    assert serve(tmp_path, [], {"KVRELAY_ADMIN_KEY": "short"}) == f"kvrelay serve: error: {KEY} (got 'short')"


@pytest.mark.parametrize("flag", ["--model-repo", "--tokenizer"])
def test_a_missing_folder_flag(tmp_path, flag):
    assert serve(tmp_path, [flag, "models"]) == \
        f"kvrelay serve: error: argument {flag}: no directory {tmp_path}/elsewhere/models (got 'models')"


def test_an_unknown_dummy_preset(tmp_path):
    line = serve(tmp_path, ["--model", "dummy:tiny"])
    assert line.startswith("kvrelay serve: error: argument --model: unknown model preset 'tiny'; known: ")
    assert "tiny-llama" in line and line.endswith("(got 'dummy:tiny')")


@pytest.mark.parametrize("text,message", [
    ("model_repo: {path: repo, versioning: true}\nmodels:\n  - {name: a}\n",
     "model_repo.versioning: input should be 'numbered' (got True)"),
    ("model_repo: {path: repo}\nmodels:\n  - {name: a}\n",
     "model_repo.path: no directory {folder}/repo (a relative path is taken from the file's folder)"),
    ("models:\n  - {name: a, path: models/a}\n",
     "models[0].path: {folder}/models/a is neither an HF model directory (with config.json) nor a .gguf file "
     "(a relative path is taken from the file's folder)"),
    ("model_repo: {path: present}\nmodels:\n  - {name: a}\n",
     "models[0].name: model 'a' is not in the repository ({folder}/present)"),
], ids=["versioning", "repo-path", "model-path", "not-in-repo"])
def test_a_serve_config_mistake(tmp_path, text, message):
    folder = tmp_path / "configs"
    (folder / "present").mkdir(parents=True)
    cfg = folder / "serve.yaml"
    cfg.write_text(text)
    assert serve(tmp_path, ["--config", str(cfg)]) == f"kvrelay serve: error: {cfg}: {message.format(folder=folder)}"


@pytest.mark.parametrize("argv, message", [
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser (how the model writes its "
                                    "calls)"),
    (["--tool-call-parser", "json"], "argument --tool-call-parser: Input should be 'hermes', 'llama3_json' or "
                                     "'mistral' (got 'json')"),
], ids=["auto-without-parser", "unknown-parser"])
def test_a_tool_calling_mistake(tmp_path, argv, message):
    """Checked by the gateway's config, before it binds or dials anything."""
    env = {k: v for k, v in os.environ.items() if k != "KVRELAY_ZMQ_SECRET"}  # --insecure-zmq excludes it
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", "gateway", "--insecure-zmq", *argv], cwd=tmp_path,
                          capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 2 and proc.stderr.splitlines() == [f"kvrelay gateway: error: {message}"], proc.stderr
