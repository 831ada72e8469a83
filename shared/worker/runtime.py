"""What every worker process shares: the models it hosts (``shared/worker/model_host.py``: one engine core per
model instance over one KV pool), the threads that talk to Redis for it, the ZMQ sockets that carry token
events back to gateways, and a clean shutdown.

Threads: the heartbeat (registration.py), the control listener (control.py), the abort listener
(abort_listener.py) and the gateway watch (gateway_watch.py) only talk to Redis and hand commands, ids and
dead gateways to the main loop through queues; the engines, their tensors and every ZMQ socket belong to
the main loop alone (model loads build a new engine on their own thread, see model_host). Neither the
heartbeat nor a role's job keeper (intake.py) waits for a step: each works from a snapshot the loop takes at
the end of a turn (turn_snapshot.py). The stall watch (stall_watch.py) ends a worker whose step has run longer
than ``--step-timeout``: it takes down the rank groups the step waits on, or, when nothing can interrupt the
step, unregisters and exits. A thread rides out Redis errors only: anything else is a bug, which stops the
worker with a non-zero exit for its supervisor to restart, rather than a warning a second for ever.

Shutdown: the first SIGTERM/SIGINT starts a drain (the role stops taking new work and its loop runs
until nothing is in flight or ``drain_timeout_s`` passed, then the role hands back or ends what is
left); a second signal stops at once. Either way the worker unregisters before it exits.
"""

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from pathlib import Path

import redis
import zmq

from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.kv_connector import KVLinks
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire.handoff import MAX_FRAME_STREAMS
from kvrelay.shared.wire.protocol import instance_key
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.wire.redis_health import RedisHealth
from kvrelay.shared.wire.startup_report import report_ready
from kvrelay.shared.wire.tenant_label import metrics_salt, tenant_labeler
from kvrelay.shared.wire.zmq_auth import keys_from_secret
from kvrelay.shared.worker.abort_listener import AbortListener
from kvrelay.shared.worker.control import ControlChannel
from kvrelay.shared.worker.event_sink import EventSink
from kvrelay.shared.worker.gateway_watch import GatewayWatch
from kvrelay.shared.worker.host_budget import host_budget
from kvrelay.shared.worker.metrics import WorkerMetrics
from kvrelay.shared.worker.metrics_server import MergedMetrics
from kvrelay.shared.worker.model_host import ModelHost
from kvrelay.shared.worker.model_slot import ModelPlan, ModelSlot, RoleHooks
from kvrelay.shared.worker.registration import Registration
from kvrelay.shared.worker.shared_weights import SharedWeights
from kvrelay.shared.worker.stall_watch import StallWatch
from kvrelay.shared.worker.turn_snapshot import TurnSnapshot
from kvrelay.shared.worker.weight_registry import default_dir

log = logging.getLogger(__name__)


def _io_threads(config: WorkerConfig, sends_kv: bool, receives_kv: bool) -> int:
    """libzmq I/O threads of the worker's context: a connection's bytes move on one, so host-staged KV frames
    dealt over several bulk sockets (--kv-frame-streams) need one each, beside one for everything else. A prefill
    worker does not know how many streams its decode workers take: up to one a core, which stay idle unless used."""
    if receives_kv:  # its bulk sockets are bound only where frames come MAC'd (decode_worker/worker.py)
        return 1 + (config.kv_frame_streams if not (config.insecure_zmq or config.encrypt_kv_frames) else 0)
    return 1 + min(MAX_FRAME_STREAMS, os.cpu_count() or 1) if sends_kv else 1


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, hold_finished_kv: bool = False, receives_kv: bool = False):
        self.config = config
        self.redis = sync_client(config.redis_url)
        self.health = RedisHealth(log)  # every thread reports outages here; the heartbeat says when it ends
        self.metrics = MergedMetrics()
        # reported results change what the worker advertises: the heartbeat tells placement at once
        self.control = ControlChannel(self.redis, config.worker_id, lambda: self.registration.beat_soon(),
                                      self.health)
        pool, budget = host_budget(config)
        self.curve = keys_from_secret(config.zmq_secret, config.insecure_zmq)  # every socket of ours authenticates with it
        self.host = ModelHost(
            config.engine, hold_finished_kv=hold_finished_kv, pool=pool, weights_budget=budget,
            repo=ModelRepository(config.model_repo) if config.model_repo else None,
            configured_paths={m.name: m.engine.model.model for m in config.startup_models()},
            verify_checksums=config.verify_checksums, eos_ids=_eos_ids, report=self.control.report,
            drain_timeout_s=config.drain_timeout_s, min_residency_s=config.min_residency_s,
            min_replicas=self.control.min_replicas, freeze_gc=config.freeze_gc, skip_warmup=config.skip_warmup,
            shared=_shared_weights(config), parallel_sizes=config.parallel_sizes,
            batch_queues=config.batch_queues, calculated_kv_scales=config.calculated_kv_scales,
            later_kv_scales=config.later_kv_scales,
            # a prefill worker's ranks send their own parts of a prompt's KV, a decode worker's take their own
            # shares of it on sockets of their own (beside the worker's), authenticated as the worker is
            kv_links=(KVLinks.of(self.curve) if hold_finished_kv
                      else KVLinks.of(self.curve, config.host, config.advertise_host) if receives_kv else None))
        self.registration = Registration(self.redis, config, self.host, draining=lambda: self.draining,
                                         health=self.health)
        # what threads that must not wait for a step read: the loop takes each at the end of a turn, if asked
        self.turn_snapshots: list[TurnSnapshot] = [self.registration.advert]
        self.role_threads: dict[str, Callable[[threading.Event], None]] = {}  # a role's own, started with ours
        self.ctx = zmq.Context(io_threads=_io_threads(config, hold_finished_kv, receives_kv))
        self.events = EventSink(self.ctx, curve=self.curve)
        self.aborts = AbortListener(self.redis, self.health)
        self.gateways = GatewayWatch(self.redis, self.health)
        self.stop = threading.Event()
        self.crashed: BaseException | None = None  # what killed one of our threads
        self.draining = False  # set by the first SIGTERM; roles stop taking new work
        self.drain_deadline = 0.0
        self._threads: list[threading.Thread] = []
        for m in config.startup_models():
            tokenizer_dir = m.tokenizer_dir or m.engine.model.model
            self.registration.tokenizer_dirs[instance_key(m.name, m.version)] = tokenizer_dir
            root = self.host.repo.root if m.version and self.host.repo is not None else None
            plan = ModelPlan(name=m.name, version=m.version, path=m.engine.model.model, engine=m.engine,
                             pinned=m.pinned, keep_alive_s=m.keep_alive_s, root=root)
            self.host.load_now(plan)

    @property
    def core(self):
        """The engine of a single-model worker (tests and benchmarks drive one directly)."""
        (slot,) = self.host.slots.values()
        return slot.core

    @property
    def slots(self):
        return self.host.slots

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, zmq_addr: str, hooks: RoleHooks) -> None:
        self.registration.zmq_addr = zmq_addr
        self.hooks = hooks
        self.tenant_label = tenant_labeler(None if self.config.metrics_tenant_labels else metrics_salt(self.redis))
        self.host.hooks = _PublishingHooks(self, hooks)
        for slot in self.host.slots.values():  # loaded before the role existed
            self.host.hooks.attach(slot)
        if self.config.monitoring_port is not None:
            self.metrics.serve(self.config.host, self.config.monitoring_port)
        self.registration.register_models()
        self.registration.heartbeat()
        loops: dict[str, Callable[[threading.Event], None]] = {
            "heartbeat": self.registration.run,
            "abort listener": self.aborts.run,
            "gateway watch": self.gateways.run,
            "stall watch": StallWatch(self.host, self.config.step_timeout_s, self.registration.unregister).run,
            **self.role_threads,
        }
        if self.config.model_repo:
            loops["control listener"] = lambda stop: self.control.listen(stop, self.host.commands)
        for name, loop in loops.items():
            t = threading.Thread(target=self._fatal_on_error, args=(name, loop), daemon=True, name=name)
            t.start()
            self._threads.append(t)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # prefill and unified workers bind no socket: their jobs come from the model's Redis stream
        log.info("%s worker %s serving %s %s", self.config.role, self.config.worker_id,
                 ", ".join(self.host.slots) or "no model yet",
                 f"at {zmq_addr}" if zmq_addr else "from its Redis streams")
        report_ready()  # to kvrelay serve: its models loaded and registered; a later exit is a crash to restart

    def _fatal_on_error(self, name: str, loop: Callable[[threading.Event], None]) -> None:
        try:
            loop(self.stop)
        except BaseException as exc:
            log.critical("%s crashed: stopping the worker", name, exc_info=True)
            self.crashed = self.crashed or exc
            self.stop.set()

    def _on_signal(self, signum: int, _frame) -> None:
        if self.draining:
            self.stop.set()  # asked twice: stop now
            return
        self.drain_deadline = time.monotonic() + self.config.drain_timeout_s
        self.draining = True
        log.info("signal %d: draining (up to %gs)", signum, self.config.drain_timeout_s)

    def shutdown(self) -> None:
        self.stop.set()
        self.registration.unregister()
        for slot in list(self.slots.values()):  # tensor-parallel ranks are asked to stop, not killed at exit
            slot.core.shutdown()
        if self.host.shared is not None:
            self.host.shared.close()
        self.events.close()
        self.ctx.destroy(linger=500)
        self.metrics.close()
        if self.config.model_repo:
            self.control.close()

    def serve_forever(self, step, busy=lambda: False, abandon=lambda: None) -> None:
        """Run ``step`` until stopped, or, once draining, until ``busy()`` is false or the drain deadline
        passed; then ``abandon()`` whatever is still in flight. Redis outages are waited out, not fatal:
        the engine keeps its running requests and the loop resumes pulling jobs when Redis is back."""
        announced = False
        try:
            while not self.stop.is_set():
                if self.draining and (not busy() or time.monotonic() >= self.drain_deadline):
                    break
                try:
                    if self.draining and not announced:
                        # tell placement now, not at the next beat (a draining worker advertises no room);
                        # here rather than in the signal handler, which must not take Redis's pool lock
                        announced = True
                        self.registration.heartbeat()
                    with self.host.lock.turn():
                        if self.host.tick():
                            self.registration.beat_soon()
                        for slot in list(self.slots.values()):  # a dead rank ends the worker even when idle
                            slot.core.check()
                        step()
                        for snapshot in self.turn_snapshots:
                            snapshot.turn_ended()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    self.health.failed(exc)  # logged once; the heartbeat tells when Redis is back
                    self.stop.wait(0.5)
            if self.draining and busy():
                log.warning("drain timeout: handing back or ending what is still in flight")
                try:
                    abandon()
                except redis.RedisError as exc:  # un-ACKed jobs are reclaimed by a peer anyway
                    log.warning("could not hand jobs back (%s); peers will reclaim them", exc)
                self.events.flush()
            log.info("%s worker %s stopped", self.config.role, self.config.worker_id)
        finally:
            self.shutdown()
        if self.crashed is not None:
            raise RuntimeError(f"a thread of {self.config.role} worker {self.config.worker_id} crashed") \
                from self.crashed


def _shared_weights(config: WorkerConfig) -> SharedWeights | None:
    if not config.share_weights:
        return None
    directory = Path(config.share_weights_dir) if config.share_weights_dir else default_dir()
    try:
        return SharedWeights(config.engine.device, directory)
    except OSError as exc:
        raise ConfigError(f"--share-weights-dir {directory}: {exc.strerror or exc}") from exc


def _eos_ids(core: EngineCore, model_path: str) -> list[int]:
    from kvrelay.shared.text.tokenizer import eos_token_ids

    return eos_token_ids(None, core.hf_config, model_path if model_path and not model_path.startswith(
        "dummy:") else None)


class _PublishingHooks:
    """The role's hooks, plus what the runtime does around them: publish, metrics, heartbeat."""

    def __init__(self, runtime: WorkerRuntime, role: RoleHooks):
        self.runtime, self.role = runtime, role

    def attach(self, slot: ModelSlot) -> None:
        rt = self.runtime
        metrics = WorkerMetrics(slot.core, slot.instance, rt.config.role, rt.config.worker_id,
                                rt.config.engine.device, process_collectors=not rt.metrics.registries,
                                tenant_label=rt.tenant_label)
        slot.core.observer = metrics
        slot.metrics = metrics
        rt.metrics.registries[slot.instance] = metrics.registry
        self.role.attach(slot)
        rt.registration.publish_model(slot)
        rt.registration.beat_soon()

    def detach(self, slot: ModelSlot) -> None:
        self.role.detach(slot)
        self.runtime.metrics.registries.pop(slot.instance, None)
        self.runtime.registration.beat_soon()

    def idle(self, slot: ModelSlot) -> bool:
        return self.role.idle(slot)

    def may_unload(self, slot: ModelSlot) -> bool:
        return self.role.may_unload(slot)

    def busy(self, slot: ModelSlot) -> bool:
        return self.role.busy(slot)
