"""The architecture's import contracts (pyproject.toml, [tool.importlinter]) hold, and breaking one fails
with the contract's name; every module of the package sits in a layer, and every gateway module in a room;
no module takes part in an import cycle, counting imports inside functions.
Benchmarks and tests, outside the package, never import each other."""

import ast
import importlib.util
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("import_contracts", ROOT / ".ci" / "import_contracts.py")
contracts = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(contracts)


def verdict(report: str, contract_prefix: str) -> str:
    """KEPT or BROKEN, as import-linter's report (wrapped to the terminal's width) gives it for the one
    contract whose name starts with ``contract_prefix``."""
    flat = " ".join(report.split())
    found = re.findall(re.escape(contract_prefix) + r"[^\n]*?\s?(KEPT|BROKEN)\b", flat)
    assert len(found) == 1, f"{contract_prefix!r}: {found} in {report}"
    return found[0]


@pytest.fixture
def staged(tmp_path: Path) -> Path:
    contracts.stage(tmp_path)
    return tmp_path


def test_the_tree_keeps_every_contract(staged: Path):
    result = contracts.lint(staged)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_the_staged_copy_holds_every_room(staged: Path):
    # a copy missing the mapped folders would keep every contract vacuously
    for room in ("gateway", "prefill_worker", "decode_worker", "shared/engine", "shared/handoff", "kernels"):
        assert list((staged / "kvrelay" / room).glob("*.py")), room


@pytest.mark.parametrize("module, line, contract", [
    ("gateway/__init__.py", "import torch", "the gateway imports no torch"),
    ("shared/wire/__init__.py", "from kvrelay.shared.engine import engine_core", "layers:"),
    ("prefill_worker/__init__.py", "import kvrelay.decode_worker", "layers:"),
    ("shared/handoff/__init__.py", "from kvrelay.shared.engine import scheduler", "only the engine names"),
    ("gateway/tenancy/__init__.py", "def f():\n    from kvrelay.gateway.api import generation", "gateway rooms:"),
    ("gateway/errors.py", "from kvrelay.gateway.control import routing", "gateway rooms:"),
    ("shared/wire/__init__.py", "from kvrelay import rate_search", "layers:"),
])
def test_a_new_import_across_a_line_fails_with_the_contracts_name(staged: Path, module: str, line: str, contract: str):
    assert verdict(contracts.lint(staged).stdout, contract) == "KEPT"
    target = staged / "kvrelay" / module
    target.write_text(target.read_text() + f"\n{line}\n")
    result = contracts.lint(staged)
    assert result.returncode != 0
    assert verdict(result.stdout, contract) == "BROKEN"


def _layers(contract_prefix: str) -> list[str]:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (layers,) = [c["layers"] for c in declared if c["type"] == "layers" and c["name"].startswith(contract_prefix)]
    return layers


def _named(layers: list[str], container: str = "") -> list[str]:
    """The modules and packages a layers contract names, in full (a contained layer's names are relative
    to its container)."""
    names = [name.strip(" ()") for layer in layers for name in re.split(r"[:|]", layer)]
    return [f"{container}.{name}" if container else name for name in names]


def _modules(staged: Path, package: str) -> list[str]:
    """Every module of ``package`` as installed (the staged copy is laid out as a wheel), the package's
    own ``__init__`` left out: a contract cannot place the package that contains its layers."""
    folder = staged.joinpath(*package.split("."))
    modules = [".".join(path.relative_to(staged).with_suffix("").parts).removesuffix(".__init__")
               for path in sorted(folder.rglob("*.py"))]
    return [module for module in modules if module != package]


def _holds_layers(module: str, named: list[str]) -> bool:
    return any(n.startswith(module + ".") for n in named)


def _outside(modules: list[str], named: list[str]) -> list[str]:
    """The modules neither in a named layer nor a package whose subpackages are layers (``kvrelay.shared``)."""
    return [module for module in modules if not _holds_layers(module, named)
            and not any(module == n or module.startswith(n + ".") for n in named)]


def test_every_module_of_the_package_belongs_to_a_declared_layer(staged: Path):
    # a module outside every layer is held by no layers contract: it may import anything, and anything may import it
    named = _named(_layers("layers:"))
    assert _outside(_modules(staged, "kvrelay"), named) == []
    # a package whose subpackages are layers is in none itself, so its own __init__ imports nothing
    holders = [m for m in _modules(staged, "kvrelay") if _holds_layers(m, named)]
    assert holders == ["kvrelay.shared"]
    for holder in holders:
        tree = ast.parse(staged.joinpath(*holder.split("."), "__init__.py").read_text())
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.Import | ast.ImportFrom)], holder


def test_every_module_of_the_gateway_belongs_to_one_of_its_rooms(staged: Path):
    # the same, one level in: a gateway module in no room may import any room and be imported by any
    named = _named(_layers("gateway rooms:"), container="kvrelay.gateway")
    assert _outside(_modules(staged, "kvrelay.gateway"), named) == []


def test_a_new_module_outside_every_layer_is_found(staged: Path):
    # the check above reads the staged tree, not a list: a module added anywhere in the package is seen
    (staged / "kvrelay" / "stray.py").write_text("")
    (staged / "kvrelay" / "gateway" / "stray.py").write_text("")
    assert _outside(_modules(staged, "kvrelay"), _named(_layers("layers:"))) == ["kvrelay.stray"]
    gateway_rooms = _named(_layers("gateway rooms:"), container="kvrelay.gateway")
    assert _outside(_modules(staged, "kvrelay.gateway"), gateway_rooms) == ["kvrelay.gateway.stray"]


def test_no_module_is_part_of_an_import_cycle(staged: Path):
    assert contracts.cycles(staged) == []


def test_a_cycle_through_a_function_level_import_is_found(staged: Path):
    wire = staged / "kvrelay" / "shared" / "wire"
    (wire / "cycle_a.py").write_text("def f():\n    from kvrelay.shared.wire import cycle_b\n")
    (wire / "cycle_b.py").write_text("from kvrelay.shared.wire import cycle_a\n")
    assert ["kvrelay.shared.wire.cycle_a", "kvrelay.shared.wire.cycle_b"] in contracts.cycles(staged)


def _imported(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_benchmarks_and_tests_never_import_each_other():
    crossing = [f"{p.relative_to(ROOT)} imports {m}" for p in sorted((ROOT / "bench").rglob("*.py"))
                for m in _imported(p) if m == "tests" or m.startswith("tests.")]
    crossing += [f"{p.relative_to(ROOT)} imports {m}" for p in sorted((ROOT / "tests").rglob("*.py"))
                 for m in _imported(p) if m.startswith(("kvrelay.bench", "bench"))]
    assert crossing == []
