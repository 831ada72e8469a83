"""A worker's KV pool follows its weights: unloading one of two models lets the other's KV grow into the
memory its weights freed (more sequences run at once), and loading it back gives that memory back first.
Real engines over a real growable pool (an mmap), driven through ModelHost as the worker loop drives it."""

import time

import pytest

from kvrelay import SamplingParams
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.kv_memory import PAGE
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire.protocol import ControlCommand
from kvrelay.shared.worker.model_host import ModelHost
from kvrelay.shared.worker.model_memory import estimate_weight_bytes
from kvrelay.shared.worker.model_overhead import estimate_costs
from tests.conftest import make_tiny_model
from tests.unit.model_host_requests import serve_greedy

BLOCK = 4096  # the tiny llama's KV block: 2 layers x K/V x 8 tokens x 2 heads x 16 dims x fp32
BASE_BLOCKS = 32  # the pool's own size: both floors (8 blocks each, max_model_len 64) and 16 more
PROMPT, NEW, N = 40, 4, 12  # 5 blocks to admit, 6 to finish: a 24-block share runs 4 of these at once


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> ModelRepository:
    root = tmp_path_factory.mktemp("grow")
    repo = ModelRepository(root / "repo")
    for i, name in enumerate(("a", "b")):
        import_model(repo, str(make_tiny_model("llama", root / name, seed=i)), name, progress=False)
    return repo


class EngineHooks:
    """The role's view, as a worker has it: an instance with unfinished requests is busy."""

    def attach(self, slot) -> None:
        pass

    def detach(self, slot) -> None:
        pass

    def idle(self, slot) -> bool:
        return not slot.core.has_unfinished()

    def may_unload(self, slot) -> bool:
        return self.idle(slot)

    def busy(self, slot) -> bool:
        return slot.core.has_unfinished()


def make_host(repo: ModelRepository) -> ModelHost:
    base = EngineConfig(model=ModelConfig(model="", dtype="float32", max_model_len=64),
                        cache=CacheConfig(block_size=8), device="cpu")
    one = EngineConfig(model=ModelConfig(model=repo.get("a", 1).path, dtype="float32", max_model_len=64),
                       cache=CacheConfig(block_size=8), device="cpu")
    # two models' weights and what each keeps beside them (its rotary table: on the CPU the estimate is the count)
    weights = 2 * (estimate_weight_bytes(one) + estimate_costs(one, None)[0])
    kv = BASE_BLOCKS * BLOCK
    pool = KVPool(kv, "cpu", chunk_bytes=PAGE, max_bytes=kv + weights)  # as host_budget makes it
    results = []
    host = ModelHost(base, hold_finished_kv=False, pool=pool, weights_budget=weights, repo=repo, skip_warmup=True,
                     report=results.append)
    host.hooks, host.results = EngineHooks(), results
    return host


def command(op: str, name: str) -> ControlCommand:
    return ControlCommand(command_id=f"{op}-{name}-{time.monotonic_ns()}", op=op, name=name, version=1)


def run(host: ModelHost, cmd: ControlCommand) -> None:
    host.commands.put(cmd)
    deadline = time.monotonic() + 60
    host.tick()
    while host.loading and time.monotonic() < deadline:
        time.sleep(0.02)
        host.tick()
    assert not host.loading


def test_unloading_a_model_grows_the_others_kv_and_loading_it_shrinks_it(repo):
    host = make_host(repo)
    pool = host.pool
    run(host, command("load", "a"))
    run(host, command("load", "b"))
    assert pool.cap == BASE_BLOCKS * BLOCK  # the weights budget is all in use: the pool is its own size
    peak_shared, tokens = serve_greedy(host, "a@1", N, PROMPT, NEW)
    assert 2 <= peak_shared <= 4  # a's share of the pool: 24 blocks
    assert pool.committed_bytes <= BASE_BLOCKS * BLOCK

    run(host, command("unload", "b"))
    assert "b@1" not in host.slots and pool.cap == BASE_BLOCKS * BLOCK + host.weights_budget // 2
    peak_alone, tokens_alone = serve_greedy(host, "a@1", N, PROMPT, NEW)
    assert peak_alone == 12 > peak_shared  # all of them at once, in memory b's weights held
    assert pool.committed_bytes > BASE_BLOCKS * BLOCK  # grown beyond the pool's old size
    assert tokens_alone == tokens  # greedy: the same tokens from blocks anywhere in the range

    run(host, command("load", "b"))
    assert "b@1" in host.slots and pool.cap == BASE_BLOCKS * BLOCK
    assert pool.committed_bytes <= BASE_BLOCKS * BLOCK  # a's grown chunks were given back for b's weights
    assert host.slots["a@1"].core.num_total_blocks <= BASE_BLOCKS - 8
    peak_again, tokens_again = serve_greedy(host, "a@1", N, PROMPT, NEW)
    assert peak_again <= 4 and tokens_again == tokens
    assert serve_greedy(host, "b@1", 2, PROMPT, NEW)[1][0]  # b serves from the pool it got back


def test_a_load_is_refused_while_the_grown_kv_is_in_use_and_loads_once_it_is_free(repo):
    host = make_host(repo)
    run(host, command("load", "a"))
    core = host.slots["a@1"].core
    for i in range(12):  # 72 blocks when they all run: more than the pool's own 32
        prompt = [(5 * i + t) % 500 + 1 for t in range(PROMPT)]
        core.add_request(core.make_request(f"busy{i}", prompt, SamplingParams(temperature=0.0, max_tokens=NEW)))
    while core.num_waiting:
        core.step()
    assert host.pool.committed_bytes > BASE_BLOCKS * BLOCK
    run(host, command("load", "b"))  # its weights need memory a's running requests hold
    assert not host.results[-1].ok and "not enough memory" in host.results[-1].error, host.results[-1]
    assert "KV" in host.results[-1].error and "b@1" not in host.slots
    while core.has_unfinished():
        core.step()
    run(host, command("load", "b"))
    assert host.results[-1].ok and "b@1" in host.slots
    assert host.pool.committed_bytes <= BASE_BLOCKS * BLOCK
