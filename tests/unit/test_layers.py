"""The layers import downwards only, so a reader following a request opens one file per hop and never
climbs back up: wire and text at the bottom, then config, repo, engine, handoff, the worker runtime, the
roles and the gateway, and the CLI on top. Benchmarks and tests never import each other."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = {"kvrelay": "kvrelay", "gateway": "kvrelay.gateway", "prefill_worker": "kvrelay.prefill_worker",
           "decode_worker": "kvrelay.decode_worker", "unified_worker": "kvrelay.unified_worker",
           "kernels": "kvrelay.kernels", "shared": "kvrelay.shared", "bench": "kvrelay.bench"}
SHARED = {"shared.wire", "shared.text", "shared.config", "shared.engine", "shared.repo", "shared.handoff",
          "shared.worker"}
ALLOWED = {
    "kernels": set(),
    "shared.wire": set(),
    "shared.text": {"shared.wire"},
    "shared.config": {"shared.wire"},
    "shared.repo": {"shared.wire", "shared.text", "shared.config"},
    "shared.engine": {"kernels", "shared.wire", "shared.text", "shared.config", "shared.repo"},
    "shared.handoff": {"kernels", "shared.wire", "shared.config", "shared.engine"},
    "shared.worker": SHARED - {"shared.worker"},
    "prefill_worker": SHARED,
    "decode_worker": SHARED,
    "unified_worker": SHARED,
    "gateway": {"shared.wire", "shared.text", "shared.config", "shared.repo"},
    "kvrelay": SHARED | {"gateway", "prefill_worker", "decode_worker", "unified_worker", "bench"},
    "bench": SHARED | {"kernels", "kvrelay", "gateway", "prefill_worker", "decode_worker", "unified_worker"},
}


def layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] == "tests":
        return "tests"
    if parts[0] != "kvrelay":
        return None
    if len(parts) > 2 and parts[1] == "shared":
        return f"shared.{parts[2]}"
    return parts[1] if len(parts) > 1 and parts[1] in FOLDERS else "kvrelay"


def is_module(module: str) -> bool:
    parts = module.split(".")[1:]
    if not parts:
        return True
    base = ROOT / {v: k for k, v in FOLDERS.items()}.get(f"kvrelay.{parts[0]}", "kvrelay")
    rest = parts[1:] if f"kvrelay.{parts[0]}" in FOLDERS.values() else parts
    path = base.joinpath(*rest)
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def imports(path: Path):
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                yield full if node.module.startswith("kvrelay") and is_module(full) else node.module


def sources(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        rel = path.relative_to(ROOT / folder).with_suffix("")
        module = ".".join([FOLDERS[folder], *rel.parts]).removesuffix(".__init__")
        yield path, layer(module) if folder != "kernels" else "kernels"


def test_layers_import_downwards_only():
    climbing = []
    for folder in FOLDERS:
        for path, own in sources(folder):
            for module in imports(path):
                target = layer(module)
                if target not in (None, own) and target not in ALLOWED[own]:
                    climbing.append(f"{path.relative_to(ROOT)} ({own}) imports {module} ({target})")
    assert climbing == []


def test_benchmarks_and_tests_never_import_each_other():
    crossing = [f"{p.relative_to(ROOT)} imports {m}" for p, _ in sources("bench") for m in imports(p)
                if layer(m) == "tests"]
    crossing += [f"{p.relative_to(ROOT)} imports {m}" for p in sorted((ROOT / "tests").rglob("*.py"))
                 for m in imports(p) if layer(m) == "bench" or m.startswith("kvrelay.bench")]
    assert crossing == []
