"""A worker's registration in Redis: its ``WorkerInfo`` under a TTL, refreshed every heartbeat (at once
when what it advertises changed), and a ``ModelInfo`` per hosted model for gateways to find.

The heartbeat runs on its own thread, only talks to Redis and never waits for a step (the host's lock): a
step longer than the TTL (a long prefill on a CPU) leaves a live worker registered, and a step that is stuck
is the stall watch's to end (shared/worker/stall_watch.py); until then each beat says how long the loop's turn
has run (``WorkerInfo.step_age_s``), so gateways stop routing to a loop that stopped stepping. What it publishes
is a snapshot (``_Advert``) the engine loop takes at the end of a turn, still holding the lock
(shared/worker/turn_snapshot.py), so no count is read from structures a step is changing: each beat asks the
loop for one and waits up to FRESH_WAIT_S for the turn in progress to end, then publishes the latest (at most a
step old).

It is also the worker's Redis prober (``RedisHealth``): after an outage, or when Redis's ``run_id``
says it restarted (a restart between two beats shows no outage), it publishes everything again, as
soon as Redis answers: its registration, its models, the registry entries of its config (SET NX: a
restored Redis keeps what the admin changed) and whatever the role keeps there (``on_restore``: the
consumer groups). While Redis is down it retries every REREGISTER_RETRY_S, silently: the health
object logs the outage once."""

import dataclasses
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis

from kvrelay.shared.config.worker import WorkerConfig
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import encode
from kvrelay.shared.wire.protocol import ModelInfo, WorkerInfo
from kvrelay.shared.wire.redis_health import RedisHealth
from kvrelay.shared.worker.model_host import ModelHost
from kvrelay.shared.worker.model_slot import ModelSlot
from kvrelay.shared.worker.turn_snapshot import TurnSnapshot

log = logging.getLogger(__name__)

REREGISTER_RETRY_S = 0.2
# a beat waits this long for the loop's turn in progress to end and give it fresh counts; past it, it
# publishes those of the last turn that ended: a beat is never later than this for a step
FRESH_WAIT_S = 0.5


@dataclass(frozen=True)
class _Advert:
    """What the heartbeat publishes, as the loop saw it at the end of a turn."""

    info: WorkerInfo
    models: tuple[ModelInfo, ...]


class Registration:
    def __init__(self, redis_client: redis.Redis, config: WorkerConfig, host: ModelHost,
                 draining: Callable[[], bool], health: RedisHealth | None = None):
        """``draining``: whether the worker is draining (it then advertises no room)."""
        self.redis = redis_client
        self.health = health or RedisHealth(log)
        self.on_restore: list[Callable[[], None]] = []  # what the role re-creates in a Redis that lost it
        self._run_id: str | None = None
        self._restore_due = False  # set by a beat that found Redis back or new; cleared once all is published
        self.config = config
        self.host = host
        self.draining = draining
        self.started = time.time()
        self.zmq_addr = ""  # set by the role once it binds its socket
        self.tokenizer_dirs: dict[str, str] = {}  # instance -> tokenizer directory published for gateways
        self._beat_now = threading.Event()
        self.advert = TurnSnapshot(self._advert_now)  # the engine loop takes it at the end of a turn
        # a beat that waited (for a snapshot, or for Redis) must not bring back the record ``unregister``
        # deleted meanwhile: a worker that exits would stay listed until the record's TTL
        self._publishing = threading.Lock()
        self._unregistered = False

    def register_models(self) -> None:
        """The models the config asks to register, unless registered already (by a peer, or the admin API)."""
        for spec in self.config.register:
            if self.redis.set(keys.registry_key(spec.name), encode(spec), nx=True):
                self.redis.sadd(keys.REGISTRY_INDEX, spec.name)

    def publish_model(self, slot: ModelSlot) -> None:
        self._publish_model(self._model_info(slot))

    def _model_info(self, slot: ModelSlot) -> ModelInfo:
        core = slot.core
        return ModelInfo(name=slot.instance, path=self.tokenizer_dirs.get(slot.instance, slot.path),
                         max_model_len=core.max_model_len, vocab_size=core.vocab_size,
                         eos_token_ids=slot.eos_ids, block_size=core.block_size,
                         dtype=str(core.dtype).removeprefix("torch."), served_name=slot.name,
                         version=slot.version, scheduling_policy=core.scheduling_policy)

    def _publish_model(self, info: ModelInfo) -> None:
        self.redis.set(keys.model_key(info.name), encode(info), ex=keys.MODEL_TTL_S)
        self.redis.sadd(keys.MODELS_INDEX, info.name)

    def heartbeat(self) -> None:
        """Publish now, from the loop's thread between its turns (at start, when a drain begins)."""
        with self.host.lock:  # a load may be attaching to the pool
            advert = self.advert.take_now()
        restarted = self._publish_heartbeat(_stamped(advert, 0.0).info)  # between turns
        if self.health.ok() or restarted:  # the heartbeat thread publishes the rest, now
            self._restore_due = True
            self._beat_now.set()

    def _advert_now(self) -> _Advert:
        """What the heartbeat publishes, as of now: run with the host's lock held, nothing changes it."""
        slots = list(self.host.slots.values())
        return _Advert(self._worker_info(), tuple(self._model_info(s) for s in slots))

    def _worker_info(self) -> WorkerInfo:
        slots = list(self.host.slots.values())
        pool = self.host.pool
        draining = self.draining()
        # A draining worker advertises no free blocks, so prefill workers pick other decode workers first.
        free = 0 if draining else sum(s.core.num_free_blocks for s in slots)
        info = WorkerInfo(worker_id=self.config.worker_id, role=self.config.role,
                          models=[s.instance for s in slots], zmq_addr=self.zmq_addr, free_blocks=free,
                          total_blocks=sum(s.core.num_total_blocks for s in slots),
                          running=sum(s.core.num_running for s in slots),
                          waiting=sum(s.core.num_waiting for s in slots), pid=os.getpid(),
                          host=socket.gethostname(), started=self.started, heartbeat=time.time(),
                          instances=self.host.status(), weights_budget=self.host.weights_budget,
                          weights_used=self.host.weights_used, overhead_used=self.host.overhead_used,
                          kv_pool_bytes=pool.base_bytes if pool is not None else 0,
                          kv_committed_bytes=pool.committed_bytes if pool is not None else 0,
                          kv_cap_bytes=pool.cap if pool is not None else 0,
                          kv_free_bytes=0 if pool is None or draining else pool.reclaimable_bytes(),
                          can_load=bool(self.config.model_repo) and not draining)
        return info

    def _publish_heartbeat(self, info: WorkerInfo) -> bool:
        """True when Redis is another server than at the last beat (restarted, maybe empty)."""
        with self._publishing:
            if self._unregistered:
                return False
            pipe = self.redis.pipeline(transaction=True)
            pipe.set(keys.worker_key(info.worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
            pipe.sadd(keys.WORKERS_INDEX, info.worker_id)
            pipe.execute()
        # apart from the MULTI: a Redis Cluster refuses a keyless command in a pipeline
        server = self.redis.info("server")
        run_id, self._run_id = self._run_id, server.get("run_id")
        return run_id is not None and run_id != self._run_id

    def beat_soon(self) -> None:
        """What we advertise changed (a model loaded or left): tell placement now, not in 2 s (the beat
        asks for a snapshot, which the turn making the change takes as it ends)."""
        self._beat_now.set()

    def run(self, stop: threading.Event) -> None:
        """The heartbeat thread, until ``stop``."""
        delay = keys.HEARTBEAT_INTERVAL_S
        while not stop.is_set():
            self._beat_now.wait(delay)
            self._beat_now.clear()
            if stop.is_set():
                return
            try:
                self._beat()
                delay = keys.HEARTBEAT_INTERVAL_S
            except redis.RedisError as exc:  # Redis restarting: keep serving, re-register as soon as it is back
                if not self.health.absorb(exc):
                    log.warning("heartbeat failed: %s", exc)
                # Retry quickly: after a Redis restart the gateway queues nothing for this model until
                # its workers are registered again, and a prefill worker finds no decode worker before.
                delay = REREGISTER_RETRY_S

    def _beat(self) -> None:
        advert = _stamped(self.advert.latest(FRESH_WAIT_S), self.host.lock.turn_age())
        restarted = self._publish_heartbeat(advert.info)
        if self.health.ok() or restarted:
            self._restore_due = True
        if self._restore_due:  # until it all went through: Redis may fail again half way
            self.restore(advert.models)
            self._restore_due = False
            return
        pipe = self.redis.pipeline(transaction=False)
        for model in advert.models:  # renewed while held; EXPIRE answers 0 for a record that is gone
            pipe.expire(keys.model_key(model.name), keys.MODEL_TTL_S)
        for model, found in zip(advert.models, pipe.execute(), strict=True):
            if not found:  # lost some other way (deleted by hand): gateways must see the models again
                self._publish_model(model)

    def restore(self, models: tuple[ModelInfo, ...]) -> None:
        """Publish again whatever a Redis that restarted may have lost."""
        self.register_models()
        for model in models:
            self._publish_model(model)
        for restore in self.on_restore:
            restore()
        log.info("registration published again after the redis outage or restart: %d model(s), %d registry "
                 "entries", len(models), len(self.config.register))

    def unregister(self) -> None:
        """Leave the registry, for good: later beats publish nothing."""
        with self._publishing:
            self._unregistered = True
            try:
                self.redis.delete(keys.worker_key(self.config.worker_id))
                self.redis.srem(keys.WORKERS_INDEX, self.config.worker_id)
            except redis.RedisError as exc:  # Redis gone: the TTL removes the registration anyway
                log.warning("could not unregister from Redis: %s", exc)


def _stamped(advert: _Advert | None, step_age_s: float) -> _Advert:
    """``advert`` as of now: a loop stuck in a step took its snapshot before, and its step's age is new."""
    assert advert is not None, "heartbeat() takes the first snapshot before the heartbeat thread starts"
    # rounded: a loop between fast steps reads as 0, the default, which the record then leaves off
    info = dataclasses.replace(advert.info, heartbeat=time.time(), step_age_s=round(step_age_s, 1))
    return dataclasses.replace(advert, info=info)
