"""The distribution installs one top-level package, ``kvrelay``, with the repository's folders as its
subpackages: nothing generic (``shared``, ``kernels``, ``bench``, ...) lands at the top of site-packages,
where it would overwrite or shadow another distribution's (Hugging Face ships a ``kernels`` package that
transformers probes for)."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"kvrelay": "kvrelay", "gateway": "kvrelay/gateway", "prefill_worker": "kvrelay/prefill_worker",
           "decode_worker": "kvrelay/decode_worker", "unified_worker": "kvrelay/unified_worker",
           "kernels": "kvrelay/kernels", "shared": "kvrelay/shared", "bench": "kvrelay/bench"}


def test_the_wheel_holds_kvrelay_alone_with_every_source_file(tmp_path):
    # Build from a copy: an in-tree build would leave build/ and egg-info in the checkout.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, src / folder, ignore=shutil.ignore_patterns("__pycache__"))
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", out,
                    src], check=True, capture_output=True)
    (wheel,) = out.glob("kvrelay-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())

    tops = {n.split("/")[0] for n in names}
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert tops == {"kvrelay", f"kvrelay-{version}.dist-info"}

    expected = {f"{dest}/{p.relative_to(ROOT / folder).as_posix()}"
                for folder, dest in FOLDERS.items() for p in (ROOT / folder).rglob("*.py")
                if "__pycache__" not in p.parts}
    assert expected - names == set(), "source files the pyproject package list leaves out of the wheel"
    assert "kvrelay/gateway/openapi.yaml" in names  # served at /openapi.json


def test_every_source_folder_is_a_regular_package():
    # A folder without __init__.py would be an implicit namespace package that the explicit package list
    # in pyproject.toml silently leaves out of the wheel.
    missing = [str(d.relative_to(ROOT)) for folder in FOLDERS for d in [ROOT / folder, *(ROOT / folder).rglob("*")]
               if d.is_dir() and d.name != "__pycache__" and any(d.glob("*.py")) and not (d / "__init__.py").exists()]
    assert missing == []


def test_a_child_started_from_the_checkout_imports_what_transformers_probes():
    # kvrelay starts its workers and ranks with module_argv; `make serve` runs in the checkout, where a
    # plain `-m` would put kernels/ first on sys.path and transformers (>= 5.25 depends on Hugging Face's
    # `kernels`) would import ours.
    from kvrelay.shared.config.handover import module_argv

    env = {k: v for k, v in os.environ.items() if k != "PYTHONSAFEPATH"}
    run = subprocess.run([*module_argv("transformers.activations")], cwd=ROOT, env=env, capture_output=True,
                         text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    plain = subprocess.run([sys.executable, "-m", "transformers.activations"], cwd=ROOT, env=env,
                           capture_output=True, text=True)
    if _has_distribution("kernels"):  # the hazard this guards against is real here: the plain form fails
        assert "from 'kernels'" in plain.stderr, plain.stderr[-2000:]


def _has_distribution(name: str) -> bool:
    try:
        importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True
