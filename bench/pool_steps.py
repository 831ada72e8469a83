"""One mode's pass over the workload of ``kvrelay bench pool`` (bench/pool_density.py): arrivals admitted as
they come, the engines stepped in turn on this one thread under the step lock (one turn a round, as a worker's
loop takes one per step of its models), token times recorded per request, and how long the rounds waited for
the lock and each step took, apart for the steps taken while a load ran."""

import abc
import argparse
import logging
import time

from kvrelay.bench.pool_models import Models
from kvrelay.bench.pool_workload import Arrival, Outcome
from kvrelay.shared.engine import EngineCore
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker.step_lock import StepLock

log = logging.getLogger(__name__)


class Run(abc.ABC):
    def __init__(self, args: argparse.Namespace, models: Models, arrivals: list[Arrival]):
        self.args, self.models, self.arrivals = args, models, arrivals
        self.cores: dict[int, EngineCore] = {}
        self.outcomes = [Outcome(a) for a in arrivals]
        self._by_id = {f"r{k}": o for k, o in enumerate(self.outcomes)}
        self.waiting: dict[int, list[int]] = {}  # model -> request indexes waiting for its load
        self.last_used: dict[int, float] = {}
        self.params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
        self.t0 = 0.0
        self.lock = StepLock()  # a side thread's load takes it in pieces, between rounds of steps
        self.lock_waits: list[float] = []  # seconds each round waited for its turn while a load ran
        self.steps: dict[bool, list[float]] = {False: [], True: []}  # seconds of each step, by whether a load ran
        self.load_phase = ""  # the running load's phase (pool_models.PHASES), set by its thread
        self.phase_steps: dict[str, list[float]] = {}  # seconds of each step taken while a load ran, by its phase

    def submit(self, k: int) -> None:
        a = self.arrivals[k]
        core = self.cores[a.model]
        core.add_request(core.make_request(f"r{k}", a.prompt, self.params))
        self.last_used[a.model] = time.perf_counter()

    @abc.abstractmethod
    def arrive(self, k: int) -> None:
        """The mode's admission of arrival ``k``."""

    def between_steps(self) -> None:  # noqa: B027 (a hook: the static split does nothing between rounds)
        pass

    def loading(self) -> bool:
        """Whether a load runs on a side thread now."""
        return False

    def execute(self) -> float:
        self.t0 = time.perf_counter()
        self.last_used = dict.fromkeys(self.cores, self.t0)  # the preloaded models start the run just used
        nxt = 0
        while True:
            now = time.perf_counter() - self.t0
            while nxt < len(self.arrivals) and self.arrivals[nxt].at <= now:
                self.outcomes[nxt].arrived = self.t0 + self.arrivals[nxt].at
                self.arrive(nxt)
                nxt += 1
            self.between_steps()
            busy = self.step_all()
            if nxt >= len(self.arrivals) and not busy and not any(self.waiting.values()):
                return time.perf_counter() - self.t0
            if not busy:  # the next arrival, or a load finishing
                wait = self.arrivals[nxt].at - (time.perf_counter() - self.t0) if nxt < len(self.arrivals) else 0.01
                time.sleep(max(0.0, min(0.01, wait)))

    def step_all(self) -> bool:
        """One step of each model that has work, in turn, in one turn of the step lock; whether any had. A frame
        of its own: a loop variable left in ``execute`` would hold the last core it stepped through
        ``between_steps``, which may evict it."""
        todo = [i for i, core in self.cores.items() if core.has_unfinished()]
        if not todo:
            return False
        loading = self.loading()
        asked = time.perf_counter()
        with self.lock.turn():
            if loading:
                self.lock_waits.append(time.perf_counter() - asked)
            for i in todo:
                t = time.perf_counter()
                outs = self.cores[i].step()
                took = time.perf_counter() - t
                self.steps[loading].append(took)
                if loading:
                    self.phase_steps.setdefault(self.load_phase, []).append(took)
                for out in outs:
                    o = self._by_id[out.request_id]
                    if out.new_token_ids:
                        t = time.perf_counter()
                        o.first = o.first or t
                        o.last, o.tokens = t, o.tokens + len(out.new_token_ids)
                self.last_used[i] = time.perf_counter()
        return True

    def close(self, failed: bool = False) -> None:
        """Free every engine. ``failed``: after an error mid-run, which is the one to report: what runs is
        aborted first (a release refuses while requests hold KV), the release is not checked (the error's
        traceback holds the frames that stepped the engines), and what still goes wrong is logged, not raised."""
        for i in list(self.cores):
            if not failed:
                self.models.free(self.cores.pop(i))
                continue
            try:
                self.cores[i].abort_all()
                self.models.free(self.cores.pop(i), checked=False)
            except Exception as exc:
                log.warning("model %d not freed after the run's error: %s", i, exc)
                self.cores.pop(i, None)
