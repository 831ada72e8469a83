"""Checks the import contracts declared in pyproject.toml ([tool.importlinter]) with import-linter.

The repository maps its folders into one package, ``kvrelay`` (``package-dir``), and an editable install
resolves them through an import hook: import-linter's graph builder walks the ``kvrelay`` folder alone and
would see none of ``kvrelay.gateway``, ``kvrelay.shared``, ... So the package is first laid out as a wheel
lays it out, in a temporary folder, from pyproject's own package list, and the linter reads that copy.

import-linter's own contracts see cycles between sibling packages only; a package's ``__init__`` importing
one of its modules that imports the package back is a cycle too, so every module's import graph is also
searched for strongly connected components (imports inside functions count: they are the cycles that hide).

    python .ci/import_contracts.py          # exit 0 when every contract is kept and no cycle exists
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = ROOT / "pyproject.toml"


def source_dir(package: str, package_dir: dict[str, str]) -> Path:
    """The repository folder holding ``package``: its own mapping, or its nearest mapped ancestor's
    folder joined with the rest of its dotted name."""
    parts = package.split(".")
    for cut in range(len(parts), 0, -1):
        mapped = package_dir.get(".".join(parts[:cut]))
        if mapped is not None:
            return ROOT.joinpath(mapped, *parts[cut:])
    return ROOT.joinpath(*parts)


def stage(dest: Path) -> None:
    """Copy every package's .py files into ``dest`` under their installed names."""
    setuptools = tomllib.loads(PYPROJECT.read_text())["tool"]["setuptools"]
    for package in setuptools["packages"]:
        src = source_dir(package, setuptools.get("package-dir", {}))
        out = dest.joinpath(*package.split("."))
        out.mkdir(parents=True, exist_ok=True)
        for module in src.glob("*.py"):
            shutil.copy2(module, out / module.name)


def lint(staged: Path) -> subprocess.CompletedProcess:
    """import-linter over a staged copy, with the repository's contracts; its own output is returned."""
    env = {**os.environ, "PYTHONPATH": str(staged), "COLUMNS": "400"}  # one contract, one line
    linter = Path(sys.executable).with_name("lint-imports")
    return subprocess.run([str(linter), "--no-cache", str(PYPROJECT)], cwd=staged, env=env,
                          capture_output=True, text=True)


def cycles(staged: Path) -> list[list[str]]:
    """Every set of modules that import each other in a circle, in a staged copy (built in a child process:
    this one may already hold the installed ``kvrelay``, which grimp would find instead)."""
    env = {**os.environ, "PYTHONPATH": str(staged)}
    out = subprocess.run([sys.executable, __file__, "--cycles-in", str(staged)], cwd=staged, env=env,
                         capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def _strongly_connected(graph) -> list[list[str]]:
    """Tarjan's algorithm, iterative: components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for root in sorted(graph.modules):
        if root in index:
            continue
        work = [(root, iter(sorted(graph.find_modules_directly_imported_by(root))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            module, edges = work[-1]
            step = next(edges, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(graph.find_modules_directly_imported_by(step)))))
                elif step in on_stack:
                    low[module] = min(low[module], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == module:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def main() -> int:
    if sys.argv[1:2] == ["--cycles-in"]:
        import grimp

        print(json.dumps(_strongly_connected(grimp.build_graph("kvrelay", cache_dir=None))))
        return 0
    with tempfile.TemporaryDirectory(prefix="kvrelay-imports-") as tmp:
        staged = Path(tmp)
        stage(staged)
        result = lint(staged)
        found = cycles(staged)
    sys.stdout.write(result.stdout)
    sys.stderr.write(result.stderr)
    for component in found:
        print("import cycle among: " + ", ".join(component))
    return result.returncode or (1 if found else 0)


if __name__ == "__main__":
    sys.exit(main())
