"""ModelHost: several engines in one process over one KV pool, driven by ControlCommands (no Redis, no
sockets: the worker loop's part is ``tick()``). Loading, the memory estimate, eviction order, pinned
models, keep-alive, drains and failed loads."""

import time
from pathlib import Path

import pytest

from kvrelay import SamplingParams
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire.protocol import ControlCommand
from kvrelay.shared.worker.model_host import ModelHost
from kvrelay.shared.worker.model_memory import estimate_weight_bytes
from tests.conftest import make_tiny_model


class Hooks:
    def __init__(self):
        self.attached, self.detached, self.busy = [], [], set()

    def attach(self, slot):
        self.attached.append(slot.instance)

    def detach(self, slot):
        self.detached.append(slot.instance)

    def idle(self, slot):
        return slot.instance not in self.busy

    def may_unload(self, slot):
        return self.idle(slot)


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> ModelRepository:
    root = tmp_path_factory.mktemp("host")
    repo = ModelRepository(root / "repo")
    for i, name in enumerate(("a", "b", "c")):
        import_model(repo, str(make_tiny_model("llama", root / name, seed=i)), name, progress=False)
    return repo


def make_host(repo: ModelRepository, models_that_fit: float = 2.5, **kw):
    base = EngineConfig(model=ModelConfig(model="", dtype="float32", max_model_len=64),
                        cache=CacheConfig(block_size=8), device="cpu")
    one = estimate_weight_bytes(EngineConfig(model=ModelConfig(model=repo.get("a", 1).path, dtype="float32"),
                                             device="cpu"))
    results = []
    host = ModelHost(base, hold_finished_kv=False, pool=KVPool(4 << 20, "cpu"),
                     weights_budget=int(one * models_that_fit), repo=repo, report=results.append, **kw)
    host.hooks = Hooks()
    return host, results


def run(host: ModelHost, *cmds: ControlCommand, timeout: float = 60.0) -> None:
    for cmd in cmds:
        host.commands.put(cmd)
    deadline = time.monotonic() + timeout
    host.tick()
    while host.loading and time.monotonic() < deadline:
        time.sleep(0.02)
        host.tick()
    assert not host.loading


def load(name: str, **kw) -> ControlCommand:
    return ControlCommand(command_id=f"load-{name}-{time.monotonic_ns()}", op="load", name=name, version=1, **kw)


def generate(host: ModelHost, instance: str, prompt=(3, 5, 7, 9)) -> list[int]:
    core = host.slots[instance].core
    req = core.make_request(f"r{time.monotonic_ns()}", list(prompt), SamplingParams(temperature=0.0, max_tokens=4))
    core.add_request(req)
    out = []
    while core.has_unfinished():
        for o in core.step():
            out += o.new_token_ids
    return out


def test_estimate_matches_the_loaded_weights(repo):
    host, results = make_host(repo)
    run(host, load("a"))
    slot = host.slots["a@1"]
    assert results[-1].ok and slot.weight_bytes == estimate_weight_bytes(
        EngineConfig(model=ModelConfig(model=slot.path, dtype="float32"), device="cpu"))
    assert host.hooks.attached == ["a@1"]


def test_loads_share_the_pool_and_evict_the_idlest_unpinned_model(repo):
    host, results = make_host(repo)
    run(host, load("a", pinned=True), load("b"))
    assert sorted(host.slots) == ["a@1", "b@1"] and all(r.ok for r in results)
    want_b = generate(host, "b@1")
    host.slots["a@1"].last_used -= 100  # the pinned one is the idlest: still never evicted
    host.slots["b@1"].last_used -= 10
    run(host, load("c"))
    assert results[-1].ok and results[-1].evicted == ["b@1"]
    assert sorted(host.slots) == ["a@1", "c@1"] and host.hooks.detached == ["b@1"]
    host.slots["c@1"].last_used -= 10
    run(host, load("b"))
    assert generate(host, "b@1") == want_b  # reloaded, same weights, same tokens
    assert sorted(host.slots) == ["a@1", "b@1"]


def test_a_busy_model_is_never_evicted(repo):
    host, results = make_host(repo)
    run(host, load("a"), load("b"))
    for inst in ("a@1", "b@1"):
        host.slots[inst].last_used -= 10
    host.hooks.busy = {"a@1", "b@1"}
    run(host, load("c"))
    assert not results[-1].ok and "not enough memory" in results[-1].error
    assert sorted(host.slots) == ["a@1", "b@1"]
    assert [s.state for s in host.status() if s.instance == "c@1"] == ["failed"]


def test_no_eviction_when_the_command_forbids_it(repo):
    host, results = make_host(repo)
    run(host, load("a"), load("b"))
    host.slots["b@1"].last_used -= 10
    run(host, load("c", evict=False))
    assert not results[-1].ok and "eviction not allowed" in results[-1].error


def test_keep_alive_unloads_an_idle_model(repo):
    host, _ = make_host(repo)
    run(host, load("a", keep_alive_s=0.5), load("b"))
    host.slots["a@1"].last_used -= 5
    host.slots["b@1"].last_used -= 5  # no keep-alive: stays
    host._checked_keep_alive = 0
    assert host.tick()
    assert sorted(host.slots) == ["b@1"]


def test_unload_drains_until_idle(repo):
    host, results = make_host(repo)
    run(host, load("a"))
    host.hooks.busy = {"a@1"}
    run(host, ControlCommand(command_id="u", op="unload", name="a", version=1))
    assert results[-1].ok and host.slots["a@1"].state == "draining"
    host.tick()
    assert "a@1" in host.slots
    host.hooks.busy = set()
    host.tick()
    assert not host.slots and host.pool.free_bytes == host.pool.nbytes


def test_corrupt_or_unknown_models_fail_cleanly(repo, tmp_path):
    host, results = make_host(repo)
    run(host, load("a"))
    bad_repo = ModelRepository(tmp_path / "repo")
    mv = import_model(bad_repo, repo.get("b", 1).path, "bad", progress=False)
    weights = next(Path(mv.path).glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-64:] = bytes(64)
    weights.write_bytes(bytes(data))
    host.repo = bad_repo
    run(host, load("bad"))
    assert not results[-1].ok and "corrupt" in results[-1].error
    run(host, load("nope"))
    assert not results[-1].ok and "not in the repository" in results[-1].error
    run(host, ControlCommand(command_id="x", op="load", name="..", version=1))
    assert not results[-1].ok
    assert sorted(host.slots) == ["a@1"] and generate(host, "a@1")  # the loaded model is untouched
    failed = {s.instance: s.error for s in host.status() if s.state == "failed"}
    assert "corrupt" in failed["bad@1"]


def test_eviction_prefers_what_the_other_role_evicted(repo):
    host, results = make_host(repo)
    run(host, load("a"), load("b"))
    host.slots["a@1"].last_used -= 100  # the idlest: evicted by default ...
    host.slots["b@1"].last_used -= 10
    run(host, load("c", prefer_evict=["b@1"]))  # ... but the prefill side dropped b for this load
    assert results[-1].ok and results[-1].evicted == ["b@1"]
    assert sorted(host.slots) == ["a@1", "c@1"]
