"""The shared-weights registry's rules with real processes (shared/worker/shared_weights.py): a mapped copy
equals a private load and outlives its exporter's ``kill -9``; an export its exporter never finished is
taken over; a copy every user of which crashed is freed by the next access; a layout that does not match
loads a private copy. The served path (two workers, tokens, accounting) is tests/e2e/test_shared_weights.py."""

import json
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from kvrelay.shared.config.engine import EngineConfig, ModelConfig
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.quant.linear import W4Linear
from kvrelay.shared.worker.shared_weights import SharedWeights
from kvrelay.shared.worker.weight_registry import WeightRegistry
from tests.unit.act_order_checkpoints import write_act_order_gptq

ENGINE = EngineConfig(ModelConfig("dummy:tiny-llama", load_format="dummy", max_model_len=128, seed=7), device="cpu")

# another process: load (or only start exporting) the model through the registry in ``dir``, say so, wait
_PEER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from kvrelay.shared.config.engine import EngineConfig, ModelConfig
    from kvrelay.shared.engine.loader import load_model
    from kvrelay.shared.worker.shared_weights import SharedWeights
    quantization = sys.argv[3] if len(sys.argv) > 3 else None
    model = sys.argv[4] if len(sys.argv) > 4 else "dummy:tiny-llama"
    engine = EngineConfig(ModelConfig(model, load_format="dummy" if model.startswith("dummy:") else "auto",
                                      max_model_len=128, seed=7, quantization=quantization), device="cpu")
    shared = SharedWeights("cpu", Path(sys.argv[1]))
    arena = shared.arena(shared.key(engine), "tiny")
    if sys.argv[2] == "unfinished":
        arena.allocate(16, "not-finished")  # registered, never filled
    else:
        model, _ = load_model(engine.model, "cpu", progress=False, arena=arena)
        shared.loaded(arena)
    print(arena.how, flush=True)
    time.sleep(600)
""")


@pytest.fixture()
def peer(tmp_path):
    procs: list[subprocess.Popen] = []

    def start(mode: str = "ready", *quantization_and_model: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", _PEER, str(tmp_path / "shared"), mode, *quantization_and_model],
                                stdout=subprocess.PIPE, text=True)
        procs.append(proc)
        assert proc.stdout.readline().strip() == "exported"
        return proc

    yield start
    for proc in procs:
        proc.kill()
        proc.wait()


def kill9(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)


def same_weights(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    pa, pb = dict(a.named_parameters()), dict(b.named_parameters())
    return pa.keys() == pb.keys() and all(torch.equal(pa[n], pb[n]) for n in pa)


def test_a_mapped_copy_equals_a_private_load_and_outlives_its_exporters_kill(tmp_path, peer):
    exporter = peer()
    shared = SharedWeights("cpu", tmp_path / "shared")
    arena = shared.arena(shared.key(ENGINE), "tiny")
    mapped, _ = load_model(ENGINE.model, "cpu", progress=False, arena=arena)
    shared.loaded(arena)
    private, _ = load_model(ENGINE.model, "cpu", progress=False)
    assert arena.how == "mapped" and arena.filled and same_weights(mapped, private)
    assert shared.device_bytes() == sum(p.numel() * p.element_size() for p in private.parameters())

    kill9(exporter)
    (entry,) = WeightRegistry(tmp_path / "shared").snapshot().values()
    assert [u.pid for u in entry.users] == [shared.me.pid]
    assert same_weights(mapped, private)  # the segment outlived the process that created it
    hidden = torch.randn(3, mapped.output_embedding().shape[1], generator=torch.Generator().manual_seed(0))
    assert torch.equal(mapped.compute_logits(hidden), private.compute_logits(hidden))

    del mapped
    shared.release("tiny")
    assert WeightRegistry(tmp_path / "shared").snapshot() == {}
    assert not list((tmp_path / "shared").glob("seg-*"))


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
def test_a_quantized_model_is_shared_apart_from_its_full_precision_copy(tmp_path, peer, quantization):
    """The packed weights and scales are parameters in the arena like any other, keep what loading reads off
    them (their output_dim), and a quantized load never maps the full-precision copy of the same model."""
    engine = EngineConfig(ModelConfig("dummy:tiny-llama", load_format="dummy", max_model_len=128, seed=7,
                                      quantization=quantization), device="cpu")
    peer("ready", quantization)
    shared = SharedWeights("cpu", tmp_path / "shared")
    assert shared.key(engine) != shared.key(ENGINE)
    arena = shared.arena(shared.key(engine), "tiny")
    mapped, _ = load_model(engine.model, "cpu", progress=False, arena=arena)
    shared.loaded(arena)
    private, _ = load_model(engine.model, "cpu", progress=False)
    assert arena.how == "mapped" and same_weights(mapped, private)
    assert any(p.dtype in (torch.int8, torch.int32, torch.float8_e4m3fn) for p in mapped.parameters())
    dims = [[getattr(p, "output_dim", None) for p in m.parameters()] for m in (mapped, private)]
    assert dims[0] == dims[1]
    del mapped
    shared.release("tiny")


def test_gptq_act_order_rows_are_sorted_once_by_the_exporter(tiny_model_dirs, tmp_path, peer):
    """The exporter sorts the rows in the arena before offering it; a process that maps it derives the same
    order from the shared g_idx and sorts nothing again (its mapping is read-only)."""
    ckpt, _ = write_act_order_gptq(tiny_model_dirs["llama"], tmp_path, 32)
    engine = EngineConfig(ModelConfig(str(ckpt), max_model_len=128, seed=7, quantization="gptq"), device="cpu")
    peer("ready", "gptq", str(ckpt))
    shared = SharedWeights("cpu", tmp_path / "shared")
    arena = shared.arena(shared.key(engine), "tiny")
    mapped, _ = load_model(engine.model, "cpu", progress=False, arena=arena)
    shared.loaded(arena)
    private, _ = load_model(engine.model, "cpu", progress=False)
    assert arena.how == "mapped" and same_weights(mapped, private)
    layers = [[m for m in model.modules() if isinstance(m, W4Linear)] for model in (mapped, private)]
    assert layers[0] and all(a.perm is not None and torch.equal(a.perm, b.perm) and
                             torch.equal(a.dequantize(), b.dequantize()) for a, b in zip(*layers, strict=True))
    del mapped
    shared.release("tiny")


def test_an_export_whose_exporter_died_unfinished_is_taken_over(tmp_path, peer):
    kill9(peer("unfinished"))
    shared = SharedWeights("cpu", tmp_path / "shared")
    arena = shared.arena(shared.key(ENGINE), "tiny")
    model, _ = load_model(ENGINE.model, "cpu", progress=False, arena=arena)
    shared.loaded(arena)
    assert arena.how == "exported" and same_weights(model, load_model(ENGINE.model, "cpu", progress=False)[0])
    (entry,) = WeightRegistry(tmp_path / "shared").snapshot().values()
    assert entry.ready and entry.exporter.pid == shared.me.pid
    assert [p.name for p in (tmp_path / "shared").glob("seg-*")] == [entry.segment]  # the dead one's is gone


def test_a_copy_whose_every_user_crashed_is_freed_by_the_next_access(tmp_path, peer):
    exporter = peer()
    registry = WeightRegistry(tmp_path / "shared")
    assert len(list(registry.dir.glob("seg-*"))) == 1
    kill9(exporter)
    assert registry.snapshot() == {}
    assert not list(registry.dir.glob("seg-*"))


def test_another_layout_loads_a_private_copy(tmp_path, peer):
    exporter = peer()
    registry = WeightRegistry(tmp_path / "shared")
    raw = json.loads((registry.dir / "registry.json").read_text())
    (entry,) = raw.values()
    entry["digest"] = "another-layout"  # as a peer whose build of the same files differs
    (registry.dir / "registry.json").write_text(json.dumps(raw))
    shared = SharedWeights("cpu", registry.dir)
    arena = shared.arena(shared.key(ENGINE), "tiny")
    model, _ = load_model(ENGINE.model, "cpu", progress=False, arena=arena)
    shared.loaded(arena)
    assert arena.how == "private" and same_weights(model, load_model(ENGINE.model, "cpu", progress=False)[0])
    assert [u.pid for u in registry.snapshot()[entry["key"]].users] == [exporter.pid]  # not counted as a user
