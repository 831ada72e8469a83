"""A model load beside serving models (a worker's, ``kvrelay bench pool``'s) takes the step lock in pieces, and
the engine loop steps between them (issue #26): the lock hands a loop that waited through a load's piece its
turn before the load's next piece; the warm-up takes it once per shape; CUDA graph capture once per decode
graph and once per piecewise bucket (walked on the CPU through ``record=False``); the holds are timed per load
and phase (HoldTimes). Counts and order only, never seconds."""

import threading
import time
from contextlib import AbstractContextManager

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.engine import EngineCore, KVPool
from kvrelay.shared.engine.cuda_graphs import DecodeGraphs, graphs_held
from kvrelay.shared.engine.piecewise_graphs import PiecewiseGraphs
from kvrelay.shared.engine.warmup import plan, warm_up
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker.step_lock import HoldTimes, LockedPool, StepLock

WAIT_S = 60.0  # the most any wait below may take before the test fails (a stuck thread, not a slow one)


def _engine(seed: int = 0) -> EngineCore:
    config = EngineConfig(
        model=ModelConfig("dummy:tiny-llama", max_model_len=96, load_format="dummy", seed=seed, dtype="float32"),
        cache=CacheConfig(block_size=16, kv_cache_memory=1 << 20),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64), device="cpu")
    return EngineCore(config)


class Loop:
    """The engine loop of a worker serving ``core``: a step per turn of the step lock, a request always running."""

    def __init__(self, lock: StepLock, core: EngineCore, events: list):
        self.lock, self.core, self.events = lock, core, events
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self._n = 0

    def _run(self) -> None:
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        while not self.stop.is_set():
            with self.lock.turn():
                if not self.core.has_unfinished():
                    self._n += 1
                    self.core.add_request(self.core.make_request(f"r{self._n}", [5, 6, 7, 8], params))
                self.core.step()
                self.events.append("step")

    def __enter__(self) -> "Loop":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(WAIT_S)
        assert not self.thread.is_alive()


class Piece(AbstractContextManager):
    """What a load holds for one piece, as the test sees it: the piece logged, and the hold let go only once the
    loop waits for its turn, the moment the lock must hand the loop its turn before the load's next piece."""

    def __init__(self, hold: AbstractContextManager, lock: StepLock, events: list, name: str):
        self.hold, self.lock, self.events, self.name = hold, lock, events, name

    def __enter__(self) -> "Piece":
        self.hold.__enter__()
        self.events.append(self.name)
        return self

    def __exit__(self, *exc) -> None:
        deadline = time.monotonic() + WAIT_S
        while self.lock.wait_since is None and time.monotonic() < deadline:
            time.sleep(0.0005)
        assert self.lock.wait_since is not None, "the loop never waited for its turn"
        self.hold.__exit__(*exc)


def _steps_between(events: list, piece: str) -> list[int]:
    """Steps of the loop between each two consecutive pieces."""
    at = [k for k, e in enumerate(events) if e == piece]
    return [sum(e == "step" for e in events[a + 1:b]) for a, b in zip(at, at[1:], strict=False)]


def test_a_loop_that_waited_through_a_piece_steps_before_the_next_one():
    lock = StepLock()
    events: list = []

    def loop() -> None:
        with lock.turn():
            events.append("step")

    for _ in range(20):  # the load lets go and at once asks again, as between two warm-up shapes
        with lock:
            events.append("piece")
            t = threading.Thread(target=loop)
            t.start()
            while lock.wait_since is None:  # the loop waits for its turn
                time.sleep(0.0005)
        with lock:
            events.append("piece")
        t.join(WAIT_S)
    assert events == ["piece", "step", "piece"] * 20


def test_a_waiting_loader_still_gets_in_after_at_most_one_turn_of_a_busy_loop():
    lock = StepLock()
    events: list = []
    with Loop(lock, _engine(), events):
        while "step" not in events:
            time.sleep(0.001)
        for _ in range(10):
            with lock:
                events.append("piece")
    between = _steps_between(events, "piece")
    assert len(between) == 9 and max(between) <= 2, between  # the step in progress, then the one that waited


def test_warm_up_holds_the_lock_once_per_shape_and_the_loop_steps_between_shapes():
    lock, events = StepLock(), []
    serving, loaded = _engine(seed=1), _engine(seed=2)
    with Loop(lock, serving, events):
        holds = HoldTimes(lock)
        ran = warm_up(loaded, compiles=True, hold=Piece(holds.hold("warm-up"), lock, events, "shape"))
        holds.done()
    assert ran == len(plan(loaded)) > 10
    assert [p for p, _ in holds.holds] == ["warm-up"] * ran  # one hold per shape, each timed
    assert events.count("shape") == ran
    between = _steps_between(events, "shape")
    assert min(between) >= 1, between  # the serving model stepped between every two shapes


def test_each_graph_is_captured_under_its_own_hold_and_the_loop_steps_between():
    # record=False walks the capture as on CUDA, each graph's forward where it would be recorded
    lock, events = StepLock(), []
    serving, loaded = _engine(seed=1), _engine(seed=2)
    runner = loaded.runner
    decode = DecodeGraphs(runner.model, runner.kv_cache, 4, runner.max_model_len, runner.block_size, record=False,
                          short_context=32)
    pieces = PiecewiseGraphs(runner.model, runner.kv_cache, 24, record=False, sizes=[8, 16, 24])
    with Loop(lock, serving, events):
        holds = HoldTimes(lock)
        with graphs_held(Piece(holds.hold("graph capture"), lock, events, "graph")):
            assert decode.capture() and pieces.capture()
        holds.done()
    # a hold per decode graph, per piecewise bucket (its L + 1 pieces), and one more for each: its first
    # forward under the sync check, which is the process's setting
    captures = len(decode.sizes) * len(decode.len_classes) + len(pieces.sizes)
    assert captures == 3 * 2 + 3
    assert events.count("graph") == len(holds.holds) == captures + 2
    assert min(_steps_between(events, "graph")) >= 1


def test_the_build_takes_the_lock_only_for_the_pool_attach_and_the_hold_times_are_the_load_s_own():
    lock = StepLock()
    holds = HoldTimes(lock)
    config = _engine().config
    pool = LockedPool(KVPool(1 << 20, "cpu"), holds.hold("engine build"))
    with graphs_held(holds.hold("graph capture")):
        EngineCore(config, kv_pool=pool, kv_pool_key="m")
    assert [p for p, _ in holds.holds] == ["engine build"]  # the attach: nothing captures on the CPU
    with holds.hold("warm-up"):
        with holds.hold("engine build"):  # nested (a warm-up step growing the pool): part of the outer hold
            pass
    assert [p for p, _ in holds.holds] == ["engine build", "warm-up"]
    holds.done()

    grown = []

    def grow() -> None:  # the loop growing the loaded model's KV after the load: untimed
        with lock.turn():
            grown.append(pool.grow("m", 1))

    t = threading.Thread(target=grow)
    t.start()
    t.join(WAIT_S)
    assert len(grown) == 1 and len(holds.holds) == 2
    phase, longest = holds.longest()
    assert phase in ("engine build", "warm-up") and longest == max(s for _, s in holds.holds)
    assert set(holds.by_phase()) == {"engine build", "warm-up"}
    assert "2 holds" in holds.describe()
