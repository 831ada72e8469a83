"""What every worker process shares: its engine core, its Redis registration and heartbeat, the abort
subscription, the ZMQ sockets that carry token events back to gateways, and a clean shutdown.

Threads: the heartbeat and the abort listener only talk to Redis and hand ids to the main loop through
a queue; the engine, its tensors and every ZMQ socket belong to the main loop alone.

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
import uuid
from dataclasses import dataclass, field

import redis
import zmq

from shared import redis_keys as keys
from shared.config import EngineConfig
from shared.engine_core import EngineCore
from shared.metrics import WorkerMetrics
from shared.outputs import EngineCoreOutput
from shared.protocol import Abort, ModelInfo, TokenBatch, TokenEvent, WorkerInfo, decode, encode
from shared.redis_conn import sync_client

log = logging.getLogger(__name__)

SEND_TIMEOUT_MS = 2000
REREGISTER_RETRY_S = 0.2


@dataclass
class WorkerConfig:
    role: str  # prefill | decode | unified
    engine: EngineConfig
    redis_url: str
    model_name: str  # the name clients use (served_model_name)
    host: str = "127.0.0.1"  # ZMQ bind address: loopback unless configured
    port: int = 0  # 0: an ephemeral port
    advertise_host: str | None = None  # what peers dial, when ``host`` is a wildcard (pod IP, service name)
    worker_id: str = field(default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}")
    model_path: str = ""  # directory with the tokenizer, published for gateways
    handoff_timeout_s: float = 10.0
    max_deliveries: int = keys.MAX_DELIVERIES
    reclaim_idle_ms: int = 15_000  # a pending job idle this long belongs to a dead prefill worker
    monitoring_port: int | None = None  # Prometheus /metrics on host:port; None: not served (0: ephemeral)
    drain_timeout_s: float = 30.0  # after SIGTERM, how long running requests get to finish


class EventSink:
    """Batches TokenEvents per gateway address and sends one TokenBatch per gateway per step."""

    def __init__(self, ctx: zmq.Context):
        self.ctx = ctx
        self.sockets: dict[str, zmq.Socket] = {}
        self.pending: dict[str, list[TokenEvent]] = {}

    def add(self, reply_addr: str, event: TokenEvent) -> None:
        self.pending.setdefault(reply_addr, []).append(event)

    def flush(self) -> None:
        for addr, events in self.pending.items():
            sock = self.sockets.get(addr)
            if sock is None:
                sock = self.sockets[addr] = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 1000)
                sock.setsockopt(zmq.SNDTIMEO, SEND_TIMEOUT_MS)
                sock.connect(addr)
            try:
                sock.send(encode(TokenBatch(events=events)))
            except zmq.Again:  # a gateway that stopped reading loses its events, nobody else's
                log.warning("gateway %s is not reading; dropped %d events", addr, len(events))
        self.pending.clear()

    def close(self) -> None:
        for sock in self.sockets.values():
            sock.close()


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, hold_finished_kv: bool = False):
        self.config = config
        self.core = EngineCore(config.engine, hold_finished_kv=hold_finished_kv)
        self.eos_ids = _eos_ids(self.core, config)
        self.metrics = WorkerMetrics(self.core, config.model_name, config.role, config.worker_id,
                                     config.engine.device)
        self.core.observer = self.metrics
        self.redis = sync_client(config.redis_url)
        self.ctx = zmq.Context()
        self.events = EventSink(self.ctx)
        self.aborts: queue.Queue[str] = queue.Queue()
        self.stop = threading.Event()
        self.started = time.time()
        self.draining = False  # set by the first SIGTERM; roles stop taking new work
        self.drain_deadline = 0.0
        self.zmq_addr = ""  # set by the role once it binds its socket
        self._threads: list[threading.Thread] = []

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, zmq_addr: str) -> None:
        self.zmq_addr = zmq_addr
        if self.config.monitoring_port is not None:
            self.metrics.serve(self.config.host, self.config.monitoring_port)
        self.publish_model()
        self.heartbeat()
        for target in (self._heartbeat_loop, self._abort_loop):
            t = threading.Thread(target=target, daemon=True, name=target.__name__)
            t.start()
            self._threads.append(t)
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._on_signal)
        log.info("%s worker %s serving %r at %s", self.config.role, self.config.worker_id,
                 self.config.model_name, zmq_addr)

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
        except Exception:  # Redis gone: the TTL removes the registration anyway
            log.warning("could not unregister from Redis", exc_info=True)
        self.events.close()
        self.ctx.destroy(linger=500)
        self.metrics.close()

    def publish_model(self) -> None:
        runner = self.core.runner
        info = ModelInfo(name=self.config.model_name, path=self.config.model_path,
                         max_model_len=self.core.max_model_len, vocab_size=self.core.vocab_size,
                         eos_token_ids=self.eos_ids, block_size=runner.block_size,
                         dtype=str(runner.dtype).removeprefix("torch."))
        self.redis.set(keys.model_key(info.name), encode(info))
        self.redis.sadd(keys.MODELS_INDEX, info.name)

    def heartbeat(self) -> None:
        sched = self.core.scheduler
        # A draining worker advertises no free blocks, so prefill workers pick other decode workers first.
        free = 0 if self.draining else self.core.num_free_blocks
        info = WorkerInfo(worker_id=self.config.worker_id, role=self.config.role, models=[self.config.model_name],
                          zmq_addr=self.zmq_addr, free_blocks=free,
                          total_blocks=self.core.num_total_blocks, running=sched.num_running,
                          waiting=sched.num_waiting, pid=os.getpid(), host=socket.gethostname(),
                          started=self.started, heartbeat=time.time())
        pipe = self.redis.pipeline()
        pipe.set(keys.worker_key(info.worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
        pipe.sadd(keys.WORKERS_INDEX, info.worker_id)
        pipe.execute()

    def _heartbeat_loop(self) -> None:
        delay = keys.HEARTBEAT_INTERVAL_S
        while not self.stop.wait(delay):
            try:
                self.heartbeat()
                if not self.redis.exists(keys.model_key(self.config.model_name)):
                    self.publish_model()  # Redis restarted empty: gateways must see the model again
                delay = keys.HEARTBEAT_INTERVAL_S
            except Exception:  # Redis restarting: keep serving, re-register as soon as it is back
                log.warning("heartbeat failed", exc_info=True)
                # Retry quickly: after a Redis restart the gateway queues nothing for this model until
                # its workers are registered again, and a prefill worker finds no decode worker before.
                delay = REREGISTER_RETRY_S

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
            except Exception:
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


def _eos_ids(core: EngineCore, config: WorkerConfig) -> list[int]:
    from shared.tokenizer import eos_token_ids

    return eos_token_ids(None, core.runner.hf_config, config.model_path or None)
