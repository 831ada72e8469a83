"""Talks to workers the way a gateway does, without one: XADDs ``Job``s (any tenant, salt and arrival)
to a model's stream and collects the ``TokenBatch``es that come back on its own ZMQ PULL socket, stamping
each request's first token and its end. For tests that need tenants and exact timings the HTTP front
door would hide. It beats as a gateway does (``gateway_key`` of its address), or workers would abort its
requests as a dead gateway's."""

import threading
import time
from dataclasses import dataclass, field

import zmq

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import Job, TokenBatch
from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.zmq_secret import CURVE


@dataclass
class Seen:
    arrival: float
    first: float | None = None  # unix time the first token event came in
    end: float | None = None
    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    num_cached_tokens: int = 0

    @property
    def ttft(self) -> float:
        assert self.first is not None
        return self.first - self.arrival


class JobClient:
    def __init__(self, redis, model: str):
        self.redis = redis
        self.model = model
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PULL)
        self.sock.setsockopt(zmq.LINGER, 0)
        zmq_auth.serve(self.sock, CURVE)  # workers dial with the test deployment's keys, as a gateway's
        self.addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.seen: dict[str, Seen] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._beat()
        self._last_beat = time.monotonic()
        # Receiving on its own thread stamps a token when it arrives, not when the test gets round to it.
        self._thread = threading.Thread(target=self._receive, daemon=True)
        self._thread.start()

    def submit(self, rid: str, prompt: list[int], tenant: str = "default", max_tokens: int = 4,
               cache_salt: str | None = None, priority: int = 0, params: SamplingParams | None = None) -> None:
        params = params or SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        now = time.time()
        job = Job(request_id=rid, model=self.model, prompt_token_ids=prompt, sampling=params,
                  tenant=tenant, priority=priority, reply_addr=self.addr, deadline=now + 120, arrival=now,
                  cache_salt=cache_salt)
        with self._lock:
            self.seen[rid] = Seen(arrival=now)
        self.redis.xadd(keys.prefill_stream(self.model), {keys.JOB_FIELD: encode(job)})

    def submit_many(self, jobs: list[tuple[str, list[int], str]], max_tokens: int = 4) -> None:
        """(request id, prompt, tenant) each, in one pipeline: a flood arrives at once."""
        pipe = self.redis.pipeline(transaction=False)
        now = time.time()
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        with self._lock:
            for rid, prompt, tenant in jobs:
                self.seen[rid] = Seen(arrival=now)
                job = Job(request_id=rid, model=self.model, prompt_token_ids=prompt, sampling=params, tenant=tenant,
                          priority=0, reply_addr=self.addr, deadline=now + 120, arrival=now)
                pipe.xadd(keys.prefill_stream(self.model), {keys.JOB_FIELD: encode(job)})
        pipe.execute()

    def wait(self, rids: list[str], timeout: float = 60.0) -> list[Seen]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if all(self.seen[r].end is not None for r in rids):
                    return [self.seen[r] for r in rids]
            time.sleep(0.01)
        with self._lock:
            missing = [r for r in rids if self.seen[r].end is None]
        raise TimeoutError(f"{len(missing)} of {len(rids)} requests unfinished, e.g. {missing[:5]}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.redis.delete(keys.gateway_key(self.addr))
        self.sock.close()
        self.ctx.term()

    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self._stop.is_set():
            if time.monotonic() - self._last_beat >= keys.GATEWAY_HEARTBEAT_S:
                self._beat()
                self._last_beat = time.monotonic()
            if not poller.poll(50):
                continue
            now = time.time()
            batch = decode(self.sock.recv(), TokenBatch)
            with self._lock:
                for ev in batch.events:
                    s = self.seen.get(ev.request_id)
                    if s is None:
                        continue
                    if ev.token_ids and s.first is None:
                        s.first = now
                        s.num_cached_tokens = ev.num_cached_tokens
                    s.tokens += ev.token_ids
                    if ev.finish_reason is not None:
                        s.end, s.finish_reason = now, ev.finish_reason

    def _beat(self) -> None:
        self.redis.set(keys.gateway_key(self.addr), "jobs-client", ex=keys.GATEWAY_TTL_S)
