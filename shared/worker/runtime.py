"""What every worker process shares: the models it hosts (``shared/worker/model_host.py``: one engine core per
model instance over one KV pool), its Redis registration and heartbeat, the control and abort
listeners, the ZMQ sockets that carry token events back to gateways, and a clean shutdown.

Threads: the heartbeat, the control listener, the abort listener and the gateway watch only talk to
Redis and hand commands, ids and dead gateways to the main loop through queues; the engines, their
tensors and every ZMQ socket belong to the main loop alone (model loads build a new engine on their own
thread, see model_host). A thread rides out Redis errors only: anything else is a bug, which stops the
worker with a non-zero exit for its supervisor to restart, rather than a warning a second for ever.

Shutdown: the first SIGTERM/SIGINT starts a drain (the role stops taking new work and its loop runs
until nothing is in flight or ``drain_timeout_s`` passed, then the role hands back or ends what is
left); a second signal stops at once. Either way the worker unregisters before it exits.
"""

import logging
import os
import queue
import signal
import socket
import threading
import time
from collections.abc import Callable

import redis
import torch
import zmq

from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.kv_pool import KVPool
from kvrelay.shared.engine.outputs import EngineCoreOutput
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import (
    Abort,
    ControlCommand,
    ControlResult,
    ModelInfo,
    ModelSpec,
    TokenEvent,
    WorkerInfo,
    instance_key,
)
from kvrelay.shared.wire.redis_conn import sync_client
from kvrelay.shared.wire.tenant_label import metrics_salt, tenant_labeler
from kvrelay.shared.wire.zmq_auth import keys_from_secret
from kvrelay.shared.worker.event_sink import EventSink
from kvrelay.shared.worker.gateway_watch import GatewayWatch
from kvrelay.shared.worker.metrics import MergedMetrics, WorkerMetrics
from kvrelay.shared.worker.model_host import ModelHost, ModelPlan, ModelSlot, RoleHooks

log = logging.getLogger(__name__)

REREGISTER_RETRY_S = 0.2
CPU_DEFAULT_KV_BYTES = 1 << 30
CPU_DEFAULT_WEIGHTS_BYTES = 8 << 30
ACTIVATION_RESERVE = 4 << 30  # CUDA: peak activations of a prefill step, CUDA graphs, allocator slack




class WorkerRuntime:
    def __init__(self, config: WorkerConfig, hold_finished_kv: bool = False):
        self.config = config
        self.redis = sync_client(config.redis_url)
        self.metrics = MergedMetrics()
        pool, budget = host_budget(config)
        self.host = ModelHost(
            config.engine, hold_finished_kv=hold_finished_kv, pool=pool, weights_budget=budget,
            repo=ModelRepository(config.model_repo) if config.model_repo else None,
            configured_paths={m.name: m.engine.model.model for m in config.startup_models()},
            verify_checksums=config.verify_checksums, eos_ids=_eos_ids, report=self._report,
            min_replicas=self._min_replicas, freeze_gc=config.freeze_gc, skip_warmup=config.skip_warmup)
        self.tokenizer_dirs: dict[str, str] = {}  # instance -> tokenizer directory published for gateways
        self.ctx = zmq.Context()
        self.curve = keys_from_secret(config.zmq_secret, config.insecure_zmq)  # every socket of ours authenticates with it
        self.events = EventSink(self.ctx, curve=self.curve)
        self.aborts: queue.Queue[str] = queue.Queue()
        self.gateways = GatewayWatch(self.redis)
        self.stop = threading.Event()
        self.crashed: BaseException | None = None  # what killed one of our threads
        self.started = time.time()
        self.draining = False  # set by the first SIGTERM; roles stop taking new work
        self.drain_deadline = 0.0
        self.zmq_addr = ""  # set by the role once it binds its socket
        self._threads: list[threading.Thread] = []
        self._beat_now = threading.Event()
        for m in config.startup_models():
            self.tokenizer_dirs[instance_key(m.name, m.version)] = m.tokenizer_dir or m.engine.model.model
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
        self.zmq_addr = zmq_addr
        self.hooks = hooks
        self.tenant_label = tenant_labeler(None if self.config.metrics_tenant_labels else metrics_salt(self.redis))
        self.host.hooks = _PublishingHooks(self, hooks)
        for slot in self.host.slots.values():  # loaded before the role existed
            self.host.hooks.attach(slot)
        if self.config.monitoring_port is not None:
            self.metrics.serve(self.config.host, self.config.monitoring_port)
        for spec in self.config.register:
            if self.redis.set(keys.registry_key(spec.name), encode(spec), nx=True):
                self.redis.sadd(keys.REGISTRY_INDEX, spec.name)
        self.heartbeat()
        loops = [self._heartbeat_loop, self._abort_loop, self._gateway_loop]
        for target in loops + ([self._control_loop] if self.config.model_repo else []):
            t = threading.Thread(target=self._fatal_on_error, args=(target,), daemon=True, name=target.__name__)
            t.start()
            self._threads.append(t)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        # prefill and unified workers bind no socket: their jobs come from the model's Redis stream
        log.info("%s worker %s serving %s %s", self.config.role, self.config.worker_id,
                 ", ".join(self.host.slots) or "no model yet",
                 f"at {zmq_addr}" if zmq_addr else "from its Redis streams")

    def _fatal_on_error(self, loop: Callable[[], None]) -> None:
        try:
            loop()
        except BaseException as exc:
            log.critical("%s crashed: stopping the worker", loop.__name__, exc_info=True)
            self.crashed = self.crashed or exc
            self.stop.set()

    def _gateway_loop(self) -> None:
        self.gateways.run(self.stop)

    def _on_signal(self, signum: int, _frame) -> None:
        if self.draining:
            self.stop.set()  # asked twice: stop now
            return
        self.drain_deadline = time.monotonic() + self.config.drain_timeout_s
        self.draining = True
        log.info("signal %d: draining (up to %gs)", signum, self.config.drain_timeout_s)

    def shutdown(self) -> None:
        self.stop.set()
        try:
            self.redis.delete(keys.worker_key(self.config.worker_id))
            self.redis.srem(keys.WORKERS_INDEX, self.config.worker_id)
        except redis.RedisError:  # Redis gone: the TTL removes the registration anyway
            log.warning("could not unregister from Redis", exc_info=True)
        self.events.close()
        self.ctx.destroy(linger=500)
        self.metrics.close()
        if self.config.model_repo:  # commands nobody will read: placement must not wait on them
            try:
                self.redis.delete(keys.control_key(self.config.worker_id))
            except redis.RedisError:
                pass

    def publish_model(self, slot: ModelSlot) -> None:
        core = slot.core
        info = ModelInfo(name=slot.instance, path=self.tokenizer_dirs.get(slot.instance, slot.path),
                         max_model_len=core.max_model_len, vocab_size=core.vocab_size,
                         eos_token_ids=slot.eos_ids, block_size=core.block_size,
                         dtype=str(core.dtype).removeprefix("torch."), served_name=slot.name,
                         version=slot.version)
        self.redis.set(keys.model_key(info.name), encode(info))
        self.redis.sadd(keys.MODELS_INDEX, info.name)

    def heartbeat(self) -> None:
        self._publish_heartbeat(self._worker_info())

    def _worker_info(self) -> WorkerInfo:
        slots = list(self.host.slots.values())
        pool = self.host.pool
        # A draining worker advertises no free blocks, so prefill workers pick other decode workers first.
        free = 0 if self.draining else sum(s.core.num_free_blocks for s in slots)
        info = WorkerInfo(worker_id=self.config.worker_id, role=self.config.role,
                          models=[s.instance for s in slots], zmq_addr=self.zmq_addr, free_blocks=free,
                          total_blocks=sum(s.core.num_total_blocks for s in slots),
                          running=sum(s.core.num_running for s in slots),
                          waiting=sum(s.core.num_waiting for s in slots), pid=os.getpid(),
                          host=socket.gethostname(), started=self.started, heartbeat=time.time(),
                          instances=self.host.status(), weights_budget=self.host.weights_budget,
                          weights_used=self.host.weights_used,
                          kv_pool_bytes=pool.nbytes if pool is not None else 0,
                          kv_free_bytes=0 if pool is None or self.draining else pool.reclaimable_bytes(),
                          can_load=bool(self.config.model_repo) and not self.draining)
        return info

    def _publish_heartbeat(self, info: WorkerInfo) -> None:
        pipe = self.redis.pipeline()
        pipe.set(keys.worker_key(info.worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
        pipe.sadd(keys.WORKERS_INDEX, info.worker_id)
        pipe.execute()

    def beat_soon(self) -> None:
        """What we advertise changed (a model loaded or left): tell placement now, not in 2 s."""
        self._beat_now.set()

    def _heartbeat_loop(self) -> None:
        delay = keys.HEARTBEAT_INTERVAL_S
        while not self.stop.is_set():
            self._beat_now.wait(delay)
            self._beat_now.clear()
            if self.stop.is_set():
                return
            try:
                with self.host.lock:  # the loop may be adding or removing a model; Redis waits outside
                    info, slots = self._worker_info(), list(self.host.slots.values())
                self._publish_heartbeat(info)
                missing = [s for s in slots if not self.redis.exists(keys.model_key(s.instance))]
                if missing:  # Redis restarted empty: gateways must see the models again
                    with self.host.lock:
                        for slot in missing:
                            if self.host.slots.get(slot.instance) is slot:  # not unloaded meanwhile
                                self.publish_model(slot)
                delay = keys.HEARTBEAT_INTERVAL_S
            except redis.RedisError:  # Redis restarting: keep serving, re-register as soon as it is back
                log.warning("heartbeat failed", exc_info=True)
                # Retry quickly: after a Redis restart the gateway queues nothing for this model until
                # its workers are registered again, and a prefill worker finds no decode worker before.
                delay = REREGISTER_RETRY_S

    def _control_loop(self) -> None:
        """Load/unload commands from ``control_key(worker_id)`` into the host's queue."""
        key = keys.control_key(self.config.worker_id)
        while not self.stop.is_set():
            try:
                item = self.redis.brpop([key], timeout=1)
            except redis.RedisError:
                log.warning("control listener lost Redis; retrying", exc_info=True)
                self.stop.wait(1.0)
                continue
            if item is None:
                continue
            try:
                self.host.commands.put(decode(item[1], ControlCommand))
            except ValueError as exc:
                log.warning("dropped a malformed control command: %s", exc)

    def _report(self, result: ControlResult) -> None:
        result.worker_id = self.config.worker_id
        try:
            self.redis.set(keys.control_result_key(result.command_id), encode(result),
                           ex=keys.CONTROL_RESULT_TTL_S)
        except redis.RedisError:
            log.warning("could not report the result of command %s", result.command_id, exc_info=True)
        self.beat_soon()

    def _min_replicas(self, name: str) -> int:
        try:
            raw = self.redis.get(keys.registry_key(name))
            return decode(raw, ModelSpec).min_replicas if raw else 0
        except (redis.RedisError, ValueError):
            return 1  # unknown: do not unload on a guess

    def _abort_loop(self) -> None:
        while not self.stop.is_set():
            try:
                pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
                pubsub.subscribe(keys.ABORT_CHANNEL)
                while not self.stop.is_set():
                    msg = pubsub.get_message(timeout=0.5)
                    if msg and msg["type"] == "message":
                        try:
                            for rid in decode(msg["data"], Abort).request_ids:
                                self.aborts.put(rid)
                        except ValueError:
                            log.warning("dropped a malformed abort message")
            except redis.RedisError:
                log.warning("abort subscription lost; retrying", exc_info=True)
                self.stop.wait(1.0)

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
                        self.heartbeat()
                    with self.host.lock.turn():
                        if self.host.tick():
                            self.beat_soon()
                        step()
                except (redis.ConnectionError, redis.TimeoutError) as exc:
                    log.warning("Redis unavailable (%s); retrying", exc)
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

    def drain_aborts(self) -> list[str]:
        ids = []
        while True:
            try:
                ids.append(self.aborts.get_nowait())
            except queue.Empty:
                return ids


def token_event(out: EngineCoreOutput, output_index: int, worker_id: str) -> TokenEvent:
    """EngineCoreOutput -> the wire's TokenEvent (logprob dicts become [id, logprob] lists)."""
    logprobs = top = None
    if out.new_logprobs is not None:
        logprobs = [entry[tok].logprob for tok, entry in zip(out.new_token_ids, out.new_logprobs, strict=True)]
        top = [[(t, lp.logprob) for t, lp in entry.items() if lp.rank is not None]
               for entry in out.new_logprobs]
        top = [sorted(t, key=lambda x: -x[1]) for t in top]
    prompt_lp = None
    if out.prompt_logprobs is not None:
        prompt_lp = [None if e is None else [(t, lp.logprob) for t, lp in e.items()] for e in out.prompt_logprobs]
    return TokenEvent(request_id=out.request_id, token_ids=out.new_token_ids, logprobs=logprobs, top_logprobs=top,
                      prompt_logprobs=prompt_lp, finish_reason=out.finish_reason,
                      stop_reason=out.stop_reason if isinstance(out.stop_reason, int | str) else None,
                      num_prompt_tokens=out.num_prompt_tokens, num_cached_tokens=out.num_cached_tokens,
                      output_index=output_index, worker_id=worker_id)


def _eos_ids(core: EngineCore, model_path: str) -> list[int]:
    from kvrelay.shared.text.tokenizer import eos_token_ids

    return eos_token_ids(None, core.hf_config, model_path if model_path and not model_path.startswith(
        "dummy:") else None)


def host_budget(config: WorkerConfig) -> tuple[KVPool | None, int]:
    """(the KV pool several models share, the bytes of weights they may hold together).

    One model and no repository: no shared pool (the engine sizes its own KV exactly as a single-model
    server does) and no budget to enforce. Otherwise the pool is ``--kv-cache-memory`` bytes (CPU
    default 1 GiB); weights get ``--weights-memory`` (CPU default 8 GiB; CUDA default: what
    ``--gpu-memory-utilization`` leaves after the pool, less ACTIVATION_RESERVE)."""
    if not config.multi_model:
        return None, 0
    engine = config.engine
    device = torch.device(engine.device)
    if device.type == "cuda":
        usable = int(torch.cuda.get_device_properties(device).total_memory * engine.cache.gpu_memory_utilization)
        kv = engine.cache.kv_cache_memory or usable // 2
        weights = config.weights_memory or max(0, usable - kv - ACTIVATION_RESERVE)
    else:
        kv = engine.cache.kv_cache_memory or CPU_DEFAULT_KV_BYTES
        weights = config.weights_memory or CPU_DEFAULT_WEIGHTS_BYTES
    return KVPool(kv, device), weights


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
        rt.publish_model(slot)
        rt.beat_soon()

    def detach(self, slot: ModelSlot) -> None:
        self.role.detach(slot)
        self.runtime.metrics.registries.pop(slot.instance, None)
        self.runtime.beat_soon()

    def idle(self, slot: ModelSlot) -> bool:
        return self.role.idle(slot)

    def may_unload(self, slot: ModelSlot) -> bool:
        return self.role.may_unload(slot)
