"""The gateway's rooms import in one direction: ``tenancy`` and ``control`` only what the app shares
(the modules beside ``app.py``), ``api`` those and the other two rooms, and only the app's own modules
(the factory, the routes table, the probes) all of them. No gateway module takes part in an import
cycle, counting imports inside functions and under ``TYPE_CHECKING`` too."""

import ast
from pathlib import Path

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
ROOMS = ("api", "tenancy", "control")
# What may import a room: the app's own modules, and the rooms that build on another.
APP_OWN = {"app", "routes", "probes"}
ROOM_USES = {"api": {"tenancy", "control"}, "tenancy": set(), "control": set()}


def module_name(path: Path) -> str:
    return ".".join(path.relative_to(GATEWAY).with_suffix("").parts).removesuffix(".__init__")


def gateway_imports(path: Path) -> set[str]:
    """Every kvrelay.gateway module ``path`` imports, wherever the import statement stands."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        for name in names:
            if name.startswith("kvrelay.gateway."):
                rel = name.removeprefix("kvrelay.gateway.")
                if (GATEWAY / f"{rel.replace('.', '/')}.py").exists() or (GATEWAY / rel.replace(".", "/")).is_dir():
                    found.add(rel)
    return found


def graph() -> dict[str, set[str]]:
    return {module_name(p): gateway_imports(p) for p in GATEWAY.rglob("*.py")}


def room(module: str) -> str | None:
    head = module.split(".")[0]
    return head if head in ROOMS else None


def test_rooms_import_in_one_direction():
    wrong = []
    for module, targets in graph().items():
        if module in APP_OWN:
            continue
        own = room(module)
        for target in targets:
            other = room(target)
            if target in APP_OWN or (other not in (None, own) and (own is None or other not in ROOM_USES[own])):
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_no_import_cycles():
    edges = graph()
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for target in sorted(edges.get(module, ())):
            if target not in edges:
                continue  # a package's __init__ counted under its own name
            if state.get(target) == 1:
                cycles.append(" -> ".join(path[path.index(target):] + [target]))
            elif target not in state:
                visit(target, path + [target])
        state[module] = 2

    for module in sorted(edges):
        if module not in state:
            visit(module, [module])
    assert cycles == []
