"""The engine has one public surface (EngineCore, its ``kv`` connector seam, the request and output records):
no code outside shared/engine/ imports the engine's internal modules or reaches for an engine's
scheduler, block manager or model runner. import-linter checks imports between layers; attribute access
(``core.scheduler.x``) it cannot see, so this walks the source."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ["gateway", "shared", "prefill_worker", "decode_worker", "unified_worker", "kvrelay", "bench", "kernels"]
ENGINE = ROOT / "shared" / "engine"
INTERNAL_MODULES = {"scheduler", "block_manager", "model_runner", "swap", "fair_queue", "step_inputs",
                    "cuda_graphs", "weight_upload", "sampler", "async_step", "scheduler_output", "admission",
                    "token_budget", "kv_cache", "handoff_hooks", "piecewise_graphs", "core_memory"}
INTERNAL_ATTRIBUTES = {"scheduler", "block_manager", "runner"}


# left out of the walk: its EngineConfig has a field ``scheduler`` (a SchedulerConfig, no internal) that the walk
# cannot tell from an engine's. Code outside it reads settings through what the config offers (a worker's memory
# estimate through EngineConfig.memory_knobs()), never through ``.scheduler``: any ``.scheduler`` there is an engine's
CONFIG = ROOT / "shared" / "config"


def sources() -> list[Path]:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    return sorted(p for p in files if ENGINE not in p.parents and CONFIG not in p.parents)


def violations(path: Path, root: Path = ROOT) -> list[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:3] == ["kvrelay", "shared", "engine"] and len(parts) > 3 and parts[3] in INTERNAL_MODULES:
                found.append(f"{path.relative_to(root)}:{node.lineno}: imports {name}")
                break
        if isinstance(node, ast.Attribute) and node.attr in INTERNAL_ATTRIBUTES:
            found.append(f"{path.relative_to(root)}:{node.lineno}: reaches for .{node.attr}")
    return found


def test_the_walk_sees_the_roles_and_the_handoff():
    seen = {p.relative_to(ROOT).as_posix() for p in sources()}
    assert {"decode_worker/worker.py", "prefill_worker/worker.py", "shared/handoff/receiver.py"} <= seen
    assert not any(s.startswith("shared/engine/") for s in seen)


def test_nothing_outside_the_engine_names_its_internals():
    found = [v for p in sources() for v in violations(p)]
    assert not found, "outside shared/engine/, use EngineCore and its kv seam:\n" + "\n".join(found)


@pytest.mark.parametrize("code", [
    "core.scheduler.release_held(rid)",
    "slot.core.block_manager.free(rid)",
    "kv = core.runner.kv_cache",
    "from kvrelay.shared.engine.block_manager import BlockManager",
    "from kvrelay.shared.engine import scheduler",
    "import kvrelay.shared.engine.model_runner",
])
def test_the_check_catches(tmp_path, code):
    src = tmp_path / "x.py"
    src.write_text(code + "\n")
    assert violations(src, tmp_path)
