"""A repository version folder used as a model of its own: served under its repository name
(``--model model_repo/x/1`` serves "x", never "1"), and importable as another model."""

import json
import shutil
import subprocess
import sys

import pytest

from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.repo.model_source import resolve_model


@pytest.fixture()
def repo(tmp_path, tiny_model_dirs):
    repo = ModelRepository(tmp_path / "model_repo")
    import_model(repo, str(tiny_model_dirs["llama"]), "x", progress=False)
    import_model(repo, str(tiny_model_dirs["llama"]), "x", progress=False)
    return repo


def test_a_repository_version_is_served_under_the_repository_name(repo, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for given in ("model_repo/x/1", "model_repo/x/2/", str(repo.root / "x" / "1"), "model_repo/x/1/."):
        assert resolve_model(given).served_name == "x", given
    copied = shutil.copytree(repo.root / "x" / "2", tmp_path / "x-v2-copy")  # its manifest still names it
    assert resolve_model(str(copied)).served_name == "x"


def test_other_directories_keep_their_own_name(tmp_path, tiny_model_dirs):
    plain = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "my-llama")
    assert resolve_model(str(plain)).served_name == "my-llama"
    numbered = shutil.copytree(tiny_model_dirs["llama"], tmp_path / "llama-ft" / "3")  # no manifest
    assert resolve_model(str(numbered)).served_name == "llama-ft"


def test_a_worker_given_a_version_folder_serves_the_repository_name(repo, tmp_path):
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", "prefill-worker", "--model", "model_repo/x/1",
                           "--print-config"], capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert proc.returncode == 0, proc.stderr
    config = json.loads(proc.stdout)
    assert config["model_name"] == "x"
    assert config["engine"]["model"]["served_model_name"] == "x"


def test_a_repository_version_imports_as_another_model(repo):
    """The walkthrough's second model is a copy of the first's version folder: its manifest is the new
    version's own, not the copied one, so the copy verifies."""
    copy = import_model(repo, str(repo.root / "x" / "1"), "y", progress=False)
    repo.verify(copy)
    assert copy.name == "y" and resolve_model(copy.path).served_name == "y"
