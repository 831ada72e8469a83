"""Rank 0's handle on ranks 1..N-1 of a tensor-parallel group (or of a pipeline of such groups, layout.py):
starts their processes, joins the group with them, sends them each step (broadcast.py), watches them, and
stops them.

Ranks die together. Each rank exits when rank 0 dies (the kernel's parent-death signal, and a check of
its parent while idle). When a rank dies, a watchdog thread here kills the others at once, so a
collective rank 0 is blocked in fails on the closed connections instead of waiting for its timeout; the
engine's next (or current) step raises ``TensorParallelError`` naming the rank and how it ended. A rank
that hangs instead (stopped, wedged) is not seen here: whoever knows how long a step may take (a worker,
shared/worker/stall_watch.py) calls ``abandon``, which ends the step the same way.
"""

import logging
import os
import shutil
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path

import torch
import zmq

from kvrelay.shared.config import handover
from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.kv_connector import KVLinks
from kvrelay.shared.engine.parallel.layout import RankLayout, join_groups
from kvrelay.shared.engine.parallel.state import ParallelState
from kvrelay.shared.engine.ranks.broadcast import StepSender
from kvrelay.shared.engine.ranks.checks import check_group
from kvrelay.shared.engine.ranks.rank_config import RankConfig
from kvrelay.shared.wire.rank_step import RankMessage, RankStep, RankStop

log = logging.getLogger(__name__)

WATCH_INTERVAL_S = 0.1
STOP_GRACE_S = 5.0


class TensorParallelError(RuntimeError):
    """A rank of the group (tensor- or pipeline-parallel) died or stopped answering; the group is down and
    the engine cannot step."""


def start_ranks(config: EngineConfig, shared: bool, root: Path | None = None, links: KVLinks | None = None,
                kv_scales: list[list[float]] | None = None) -> "RankGroup | None":
    """The group's other ranks, started and joined (None with tensor_parallel_size 1), after every check:
    a setting the group cannot serve or a size the ranks cannot split fails here, before a process starts
    or a weight loads. ``shared``: the caller loaded the weights already; ``root``: the model repository the
    model's files must resolve inside; ``links``: what the ranks dial decode workers with (kv_parts.py);
    ``kv_scales``: an fp8 cache's per-layer scales (shared/engine/kv_scales.py), each rank takes its layers'."""
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    world = tp * pp
    if world == 1:
        return None
    if shared:
        flag = "tensor_parallel_size" if pp == 1 else "pipeline_parallel_size"
        raise ValueError(f"{flag} > 1: each rank loads its own shard (no preloaded or shared weights)")
    check_group(config, root)
    return RankGroup(config, root, links, kv_scales)


def _long_lived_thread() -> bool:
    """Whether this thread lives as long as the process. The kernel's parent-death signal fires when the
    *thread* that started a child exits, so a rank started by a worker's loading thread must not arm it
    (it would die when the load finishes); such ranks rely on their idle check of rank 0's pid."""
    return threading.current_thread() is threading.main_thread()


def rank_device(device: str, rank: int) -> torch.device:
    """Rank ``rank``'s device: the CPU, or the rank-th CUDA device counted from the configured one."""
    base = torch.device(device)
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index or 0) + rank)


class RankGroup:
    def __init__(self, config: EngineConfig, root: Path | None = None, links: KVLinks | None = None,
                 kv_scales: list[list[float]] | None = None) -> None:
        """Start ranks 1..N-1 and join the group with them as rank 0 (returns once all have joined)."""
        world = config.tensor_parallel_size * config.pipeline_parallel_size
        self.world_size = world
        # with a pipeline, the whole group carries the stages' send/recv and each stage's TP ranks reduce
        # over a group of their own (parallel/layout.py)
        self.pipeline = config.pipeline_parallel_size
        self._kind = "pipeline-parallel" if self.pipeline > 1 else "tensor-parallel"
        self._folder = Path(tempfile.mkdtemp(prefix="kvrelay-tp-"))  # 0700: the sockets' access control
        self._failure: str | None = None
        self._closing = False
        self._lock = threading.Lock()
        self._procs: list[subprocess.Popen] = []
        self._sender = StepSender(self._folder, world)
        # run before any message but a step's: a pipeline's batch queue waits there for its micro-batches
        # in flight, whose stages would otherwise be busy when the message pairs them with rank 0
        self.before_other: Callable[[], None] | None = None
        # the processes are killed at interpreter exit even if close() is never called
        self._finalizer = weakref.finalize(self, _kill_all, self._procs, self._sender, self._folder)
        payload = handover.encode(RankConfig(config, links, kv_scales))
        for rank in range(1, world):
            proc = subprocess.Popen(
                [*handover.module_argv("kvrelay.shared.engine.ranks.rank_main"), str(rank), str(world),
                 str(self._folder), str(os.getpid()), str(root or ""), str(int(_long_lived_thread()))],
                stdin=subprocess.PIPE)
            self._procs.append(proc)
            try:
                proc.stdin.write(payload)
                proc.stdin.close()
            except BrokenPipeError:
                pass  # it died at once: the watchdog reports it while the group forms
        self._watcher = threading.Thread(target=self._watch, name="tp-rank-watchdog", daemon=True)
        self._watcher.start()
        self.layout = RankLayout(0, config.tensor_parallel_size, self.pipeline)
        # the whole group; and the group stage 0's layers reduce over (layout.py)
        self.state, self.model_state = self._join(rank_device(config.device, 0))

    def _join(self, device: torch.device) -> tuple[ParallelState, ParallelState]:
        """Join the group, on a helper thread: a rank that dies while starting up ends the wait at once (the
        watchdog sees it) instead of after the rendezvous timeout; the abandoned join times out on its own."""
        joined: list = []

        def join() -> None:
            try:
                joined.append(join_groups(self.layout, self._folder, device))
            except Exception as exc:  # reported below, as the group's failure
                joined.append(exc)

        thread = threading.Thread(target=join, name="tp-join", daemon=True)
        thread.start()
        while thread.is_alive() and self._failure is None:
            thread.join(WATCH_INTERVAL_S)
        result = joined[0] if joined else None
        if isinstance(result, tuple):
            return result
        reason = self._failure or result
        self.close()
        raise TensorParallelError(f"{self._kind} group of {self.world_size} did not form: {reason}")

    @property
    def folder(self) -> Path:
        """The group's private folder (mode 0700): its ipc:// sockets' access control."""
        return self._folder

    @property
    def pids(self) -> list[int]:
        """The process ids of ranks 1..N-1."""
        return [p.pid for p in self._procs]

    def send(self, msg: RankMessage, frame: memoryview | None = None) -> None:
        self.check()
        if self.before_other is not None and not isinstance(msg, RankStep):
            self.before_other()
        try:
            self._sender.send(msg, frame, gone=lambda: self._failure is not None)
        except zmq.Again:
            raise self.down(RuntimeError("a rank stopped reading its steps")) from None

    def check(self) -> None:
        if self._failure is not None:
            raise TensorParallelError(self._failure)

    def down(self, cause: BaseException) -> TensorParallelError:
        """The error to raise after a collective or send failed: names the rank that died when one did
        (the watchdog gets a moment to see it), and stops the rest."""
        for proc in self._procs:
            try:
                proc.wait(timeout=1.0)  # a peer's death is why the collective broke: it is exiting
                break
            except subprocess.TimeoutExpired:
                continue
        self._fail(None)
        with self._lock:
            if self._failure is None:
                self._failure = f"{self._kind} group failed: {cause}"
        self._kill()
        return TensorParallelError(self._failure)

    def abandon(self, waited_s: float) -> bool:
        """Take the group down from another thread because rank 0 has waited ``waited_s`` on a step: a rank
        that stopped (SIGSTOP) or wedged never joins the collective, and nothing else ends the wait before the
        collective timeout. The ranks are killed, so the step in progress fails on the closed connections with
        this as its error. False when the group is down or closing already."""
        with self._lock:
            if self._failure is not None or self._closing:
                return False
            stuck = "".join(f"; rank {r} (pid {p.pid}) is stopped" for r, p in enumerate(self._procs, start=1)
                            if _stopped(p.pid))
            self._failure = (f"{self._kind} group of {self.world_size} is stuck: a step has waited "
                             f"{waited_s:.1f} s on its ranks{stuck}; the group is down")
            log.error("%s", self._failure)
        self._kill()
        self._abort_collectives()
        return True

    def _watch(self) -> None:
        while not self._closing and self._failure is None:
            for rank, proc in enumerate(self._procs, start=1):
                if proc.poll() is not None:
                    self._fail(rank)
                    self._kill()
                    self._abort_collectives()
                    return
            time.sleep(WATCH_INTERVAL_S)

    def _abort_collectives(self) -> None:
        """NCCL: collectives are queued on the device and would wait for the dead peer until NCCL's own
        timeout; aborting the communicator fails them now. (gloo's fail when the killed peers' sockets close.)"""
        for state in {id(s): s for s in (getattr(self, "state", None), getattr(self, "model_state", None))}.values():
            if state is not None and state.device.type == "cuda" and hasattr(state.group, "abort"):
                try:
                    state.group.abort()
                except RuntimeError:
                    log.exception("aborting the NCCL communicator")

    def _fail(self, rank: int | None) -> None:
        with self._lock:
            if self._failure is not None or self._closing:
                return
            if rank is None:
                dead = [(r, p) for r, p in enumerate(self._procs, start=1) if p.poll() is not None]
                if not dead:
                    return
                rank = dead[0][0]
            proc = self._procs[rank - 1]
            code = proc.returncode
            how = f"was killed by signal {-code}" if code < 0 else f"exited with status {code}"
            self._failure = (f"{self._kind} rank {rank} of {self.world_size} (pid {proc.pid}) {how}; "
                             "the group is down")
            log.error("%s", self._failure)

    def _kill(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self._procs:
            proc.wait()

    def close(self) -> None:
        """Stop every rank (asked first, killed after a grace period) and free the group's folder."""
        if self._closing:
            return
        self._closing = True
        if self._failure is None:
            try:
                if self.before_other is not None:
                    self.before_other()  # the ranks' last steps land before they are asked to stop
                self._sender.send(RankStop())
            except (zmq.ZMQError, RuntimeError):  # a rank died meanwhile: the ranks are stopped below all the same
                pass
        for proc in self._procs:
            try:
                proc.wait(timeout=STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._finalizer()


def _stopped(pid: int) -> bool:
    """Whether the process is stopped by a signal or a tracer (Linux; False where /proc says nothing)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] in ("T", "t")


def _kill_all(procs: list[subprocess.Popen], sender: StepSender, folder: Path) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    sender.close()
    shutil.rmtree(folder, ignore_errors=True)
