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
from kvrelay.shared.worker import model_loads
from kvrelay.shared.worker.eviction import UNSEEN_S
from kvrelay.shared.worker.model_host import ModelHost
from kvrelay.shared.worker.model_memory import estimate_weight_bytes
from tests.conftest import make_tiny_model


class Hooks:
    def __init__(self):
        self.attached, self.detached, self.in_use, self.running = [], [], set(), set()

    def attach(self, slot):
        self.attached.append(slot.instance)

    def detach(self, slot):
        self.detached.append(slot.instance)

    def idle(self, slot):
        return slot.instance not in self.in_use

    def may_unload(self, slot):
        return self.idle(slot)

    def busy(self, slot):
        return slot.instance in self.running


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


def test_a_busy_model_is_not_evicted_for_a_load_nobody_waits_for(repo):
    host, results = make_host(repo)
    run(host, load("a"), load("b"))
    for inst in ("a@1", "b@1"):
        host.slots[inst].last_used -= 10
    host.hooks.in_use = {"a@1", "b@1"}
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
    host.hooks.in_use = {"a@1"}
    run(host, ControlCommand(command_id="u", op="unload", name="a", version=1))
    assert results[-1].ok and host.slots["a@1"].state == "draining"
    host.tick()
    assert "a@1" in host.slots
    host.hooks.in_use = set()
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


def short_room_wait(monkeypatch) -> None:
    """A load with no room waits 0.3 s for some, whatever the residencies (eviction.room_wait_s)."""
    monkeypatch.setattr("kvrelay.shared.worker.eviction.ROOM_WAIT_RESIDENCIES", 0.0)
    monkeypatch.setattr("kvrelay.shared.worker.eviction.ROOM_WAIT_MIN_S", 0.3)


def _demand(host: ModelHost, instance: str, requests: int) -> None:
    for _ in range(requests):
        host.slots[instance].note_request()


def test_a_busy_low_demand_model_is_drained_and_evicted_for_a_load_requests_wait_for(repo, monkeypatch):
    short_room_wait(monkeypatch)
    host, results = make_host(repo)
    run(host, load("a"), load("b"))
    _demand(host, "a@1", 50)
    _demand(host, "b@1", 1)
    host.slots["b@1"].loaded_at -= UNSEEN_S  # its rate has seen its traffic; still within its minimum residency
    host.hooks.in_use = host.hooks.running = {"a@1", "b@1"}  # both serving
    host.commands.put(load("c", waiting=20))
    host.tick()
    b = host.slots["b@1"]  # the lower demand: draining, its stream no longer read, not yet gone
    assert b.state == "draining" and not b.reading and host.slots["a@1"].reading
    assert "c@1" in host.loading and host.loading["c@1"].thread is None  # waits for b's running requests
    host.commands.put(load("b", waiting=1))  # b asked back meanwhile: loaded again once it is gone
    for _ in range(3):
        host.tick()
    assert "b@1" in host.slots and "c@1" not in host.slots
    host.hooks.running = {"a@1"}  # b's running requests finished (its queued ones stay in Redis)
    run(host)
    ok = {r.instance: r for r in results}
    assert ok["c@1"].ok and ok["c@1"].evicted == ["b@1"] and "c@1" in host.slots
    assert host.hooks.detached == ["b@1"]
    # b's reload has less demand than a (busy) and c (just loaded): it is refused, nothing more evicted
    assert not ok["b@1"].ok and "not enough memory" in ok["b@1"].error
    assert sorted(host.slots) == ["a@1", "c@1"]


def test_nothing_busy_is_evicted_for_a_load_in_lower_demand(repo, monkeypatch):
    short_room_wait(monkeypatch)
    host, results = make_host(repo)
    run(host, load("a"), load("b"))
    _demand(host, "a@1", 50)
    _demand(host, "b@1", 50)
    host.hooks.in_use = host.hooks.running = {"a@1", "b@1"}
    run(host, load("c", waiting=2))  # waits for room a moment, then refused
    assert not results[-1].ok and "not enough memory" in results[-1].error
    assert sorted(host.slots) == ["a@1", "b@1"] and all(s.reading for s in host.slots.values())


def test_a_victim_that_does_not_drain_in_time_serves_on_and_the_load_is_refused(repo):
    host, results = make_host(repo, drain_timeout_s=0.3)
    run(host, load("a"), load("b"))
    _demand(host, "a@1", 50)
    host.hooks.in_use = host.hooks.running = {"a@1", "b@1"}
    run(host, load("c", waiting=20), load("b", waiting=1))  # b asked back while it drains
    host.tick()
    ok = {r.instance: r for r in results}
    assert not ok["c@1"].ok and "did not finish its running requests" in ok["c@1"].error
    assert ok["b@1"].ok  # it serves on: its load is answered
    b = host.slots["b@1"]
    assert b.state == "ready" and b.reading and sorted(host.slots) == ["a@1", "b@1"]


def test_a_worker_with_a_shorter_minimum_residency_evicts_a_busy_model_loaded_that_long_ago(repo, monkeypatch):
    short_room_wait(monkeypatch)
    for residency_s, evicted in ((15.0, []), (5.0, ["b@1"])):  # the default, then --min-residency-s 5
        host, results = make_host(repo, min_residency_s=residency_s)
        run(host, load("a"), load("b"))
        _demand(host, "a@1", 50)
        _demand(host, "b@1", 10)
        host.slots["b@1"].loaded_at -= 10  # past 5 s and its reloads, not the default 15 s
        host.hooks.in_use = host.hooks.running = {"a@1", "b@1"}
        host.commands.put(load("c", waiting=15))  # 1.5 times b's demand: under the no-thrash margin
        host.tick()
        host.hooks.running = {"a@1"}  # b's running requests finish (if it drains)
        run(host)
        c = next(r for r in results if r.instance == "c@1")
        assert c.ok == bool(evicted) and c.evicted == evicted, c


def test_a_load_waits_for_room_as_long_as_the_minimum_residency_holds_it(repo):
    """--min-residency-s 60: a busy model keeps its place for 60 s against a load under the no-thrash margin,
    and the load waits that long for it, past the 30 s it once waited at most. Time passes by moving the
    host's clock stamps back, as in the test above."""
    host, results = make_host(repo, min_residency_s=60.0)
    run(host, load("a"), load("b"))
    _demand(host, "a@1", 50)
    _demand(host, "b@1", 10)
    host.hooks.in_use = host.hooks.running = {"a@1", "b@1"}
    host.commands.put(load("c", waiting=15))  # 1.5 times b's demand: b is evicted only past its residency
    host.tick()
    for _ in range(2):  # 31 s, then 61 s after b's load and c's request
        host.loading["c@1"].wait_until -= 30.5
        host.slots["b@1"].loaded_at -= 30.5
        host.tick()
        assert "c@1" in host.loading and not host.loading["c@1"].failed, results
    assert host.slots["b@1"].state == "draining"  # past its residency: evicted for c
    host.hooks.running = {"a@1"}
    run(host)
    c = next(r for r in results if r.instance == "c@1")
    assert c.ok and c.evicted == ["b@1"], c


def test_a_load_whose_warm_up_fails_mid_shape_reports_that_failure(repo, monkeypatch):
    def warm_up_failing_mid_shape(core, **kw):  # as a CUDA out-of-memory error in a warm-up step would
        core.add_request(core.make_request("w", [3, 5, 7], SamplingParams(temperature=0.0, max_tokens=4)))
        core.step()
        raise RuntimeError("out of memory in a warm-up step")

    monkeypatch.setattr(model_loads, "warm_up_measured", warm_up_failing_mid_shape)
    host, results = make_host(repo)
    run(host, load("a"))
    assert not results[-1].ok and "out of memory in a warm-up step" in results[-1].error, results[-1].error
    assert "a@1" in host.failed and host.pool.members == {}  # its KV back in the pool
