"""Confinement covers every file of a repository version, not only its folder: a file linked out of the
repository is refused when the version is read (registration, swap, the worker's plan) and again when it
loads; a link to a sibling version's file stays inside and is allowed; a manifest must describe its folder."""

import json
import os
from pathlib import Path

import pytest

from kvrelay.cli import main
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import MANIFEST, ModelRepository, RepositoryError
from kvrelay.shared.repo.verified_files import verify_parallel
from kvrelay.shared.wire.protocol import ControlCommand
from kvrelay.shared.worker.model_host import ModelHost


@pytest.fixture()
def repo(tmp_path, tiny_model_dirs) -> ModelRepository:
    repo = ModelRepository(tmp_path / "repo")
    import_model(repo, str(tiny_model_dirs["llama"]), "m", progress=False)
    import_model(repo, str(tiny_model_dirs["llama"]), "m", progress=False)
    return repo


def outside_copy(tmp_path: Path, src: Path) -> Path:
    """A real file with the same bytes, outside the repository (what an attacker's link points at)."""
    target = tmp_path / "outside" / src.name
    target.parent.mkdir(exist_ok=True)
    target.write_bytes(src.read_bytes())
    return target


def link(path: Path, target: Path) -> None:
    path.unlink()
    path.symlink_to(target)


@pytest.mark.parametrize("fname", ["config.json", "model.safetensors", "tokenizer.json", "generation_config.json"])
def test_a_file_linked_out_of_the_repository_is_refused(repo, tmp_path, fname):
    path = repo.root / "m" / "2" / fname
    # a file the manifest does not list may be added later: the loader or tokenizer would still open it
    target = outside_copy(tmp_path, path if path.exists() else path.with_name("config.json"))
    path.unlink(missing_ok=True)
    path.symlink_to(target)
    with pytest.raises(RepositoryError, match=f"m v2: {fname} resolves outside the model repository"):
        repo.get("m", 2)
    assert repo.get("m", 1).version == 1  # the other version is untouched


def test_a_linked_folder_inside_a_version_is_refused(repo, tmp_path):
    (tmp_path / "outside").mkdir()
    (repo.root / "m" / "2" / "extra").symlink_to(tmp_path / "outside")
    with pytest.raises(RepositoryError, match="m v2: extra resolves outside"):
        repo.get("m", 2)


def test_a_link_to_a_sibling_versions_shard_is_allowed(repo):
    """Inside the repository a link is only sharing bytes (hot_swap's hard links do the same)."""
    shard = repo.root / "m" / "2" / "model.safetensors"
    link(shard, Path("..") / "1" / "model.safetensors")
    mv = repo.get("m", 2)
    repo.verify(mv)
    verify_parallel(mv, repo)
    model, _ = load_model(ModelConfig(model=mv.path, dtype="float32"), "cpu", progress=False, root=repo.root)
    assert sum(p.numel() for p in model.parameters()) > 0


@pytest.mark.parametrize("field,value", [("name", "other"), ("version", 1), ("version", "2")])
def test_a_manifest_describing_another_version_is_refused(repo, field, value):
    manifest = repo.root / "m" / "2" / MANIFEST
    data = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**data, field: value}))
    with pytest.raises(RepositoryError, match=f"m/2/{MANIFEST} describes"):
        repo.get("m", 2)


def test_a_manifest_linked_from_another_version_is_refused(repo):
    link(repo.root / "m" / "2" / MANIFEST, repo.root / "m" / "1" / MANIFEST)
    with pytest.raises(RepositoryError, match="describes 'm' version 1"):
        repo.get("m", 2)


def test_a_manifest_naming_a_file_out_of_the_folder_is_not_hashed(repo):
    mv = repo.get("m", 2)
    mv.files["../../../../../../etc/hostname"] = "0" * 64
    with pytest.raises(RepositoryError, match="not allowed"):
        verify_parallel(mv, repo)


def test_the_loader_refuses_a_link_made_after_the_check(repo, tmp_path):
    mv = repo.get("m", 2)  # checked: all files inside
    for fname in ("config.json", "model.safetensors"):
        original = Path(mv.path) / fname
        saved = original.read_bytes()
        link(original, outside_copy(tmp_path, original))
        with pytest.raises(RepositoryError, match=f"m v2: {fname} resolves outside"):
            load_model(ModelConfig(model=mv.path, dtype="float32"), "cpu", progress=False, root=repo.root)
        original.unlink()
        original.write_bytes(saved)
    # the same checkout, not from the repository (--model DIR names it explicitly): links are the operator's
    link(Path(mv.path) / "config.json", outside_copy(tmp_path, Path(mv.path) / "config.json"))
    load_model(ModelConfig(model=mv.path, dtype="float32"), "cpu", progress=False)


def test_the_worker_checks_again_when_the_load_starts(repo, tmp_path):
    base = EngineConfig(model=ModelConfig(model="", dtype="float32", max_model_len=64),
                        cache=CacheConfig(block_size=8), device="cpu")
    host = ModelHost(base, hold_finished_kv=False, pool=None, weights_budget=1 << 30, repo=repo,
                     verify_checksums=False)
    plan = host.plan(ControlCommand(command_id="c1", op="load", name="m", version=2))
    config = Path(plan.path) / "config.json"
    link(config, outside_copy(tmp_path, config))
    with pytest.raises(RepositoryError, match="m v2: config.json resolves outside"):
        host.load_now(plan)
    assert not host.slots


def test_cli_list_says_it_in_one_line(repo, tmp_path, capsys):
    config = repo.root / "m" / "2" / "config.json"
    link(config, outside_copy(tmp_path, config))
    assert main(["models", "list", "--repo", str(repo.root)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == "kvrelay models list: error: m v2: config.json resolves outside the model repository"
    assert os.path.islink(config)
