"""What the gateway tests run against: an embedded redis-server, a tiny trained byte-level BPE tokenizer
with a chat template, a fake worker and the real gateway on a real port.

The fake worker is only a fast test layer for the gateway's contract (real workers are tested
elsewhere): it reads jobs from the model's stream through the consumer group, replies over a real ZMQ
PUSH socket with one TokenBatch per step, honours aborts from the pub/sub channel and heartbeats like a
worker. Its output is deterministic: the tokens of REPLY, then EOS. Prompts steer it:
``[silent]`` never answers, ``[error]`` fails (a job with an output constraint as the engine fails one
that does not compile), ``[slow]`` emits a token every 50 ms, ``[hold]`` its first token and then nothing until
aborted (a stream held open mid-generation), ``[reverse]`` sends
each pair of events in swapped order (as a prefill and a decode worker may), ``[dup]`` sends every event
twice, ``[tool]`` answers TOOL_REPLY (text and two tool calls, the hermes way), ``[calls]`` CALLS_REPLY (two
calls as a required tool_choice's output), ``[args]`` ARGS_REPLY (a named tool_choice's output). Its first token
carries no stamps (``first_token_times``, as a worker older than them) unless ``[stamped]``; ``[requeue]``'s
first delivery announces a holder that is gone (ORPHAN_HOLDER) before any token and says no more, its next one
answers stamped (a job the gateway queued again).
"""

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import requests
import zmq
from aiohttp import web

from kvrelay.gateway.app import create_app
from kvrelay.shared.config.gateway import GatewayConfig
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.loopback_ports import free_port
from kvrelay.shared.wire.priority_bands import band_streams
from kvrelay.shared.wire.protocol import FIRST_TOKEN_STAMPS, Abort, Job, ModelInfo, TokenBatch, TokenEvent, WorkerInfo
from kvrelay.shared.wire.redis_conn import EmbeddedRedis, sync_client
from tests.zmq_secret import CURVE, SECRET

MODEL = "tiny"
MAX_MODEL_LEN = 96
REPLY = "Hello world! The quick brown fox jumps over the lazy dog."
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOL_REPLY = ('Let me check.\n<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>\n'
              '<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}</tool_call>')
CALLS_REPLY = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
ARGS_REPLY = '{"city": "Paris"}'
_CORPUS = [REPLY, "hello there, how are you today?", "The lazy dog sleeps. The quick fox runs.",
           "user assistant system tell me a story about a fox", "0123456789 !?.,:;"] * 20


def build_tokenizer(out: Path, chat_template: str = CHAT_TEMPLATE, extra_special: tuple[str, ...] = ()) -> Path:
    """Train a tiny byte-level BPE and save it the way a model directory holds a tokenizer; ``extra_special``:
    more special tokens (fill-in-the-middle markers, say)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>",
                                                                  *extra_special],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = chat_template
    fast.save_pretrained(out)
    return out


@dataclass
class _Seq:
    job: Job
    plan: list[int]  # token ids still to send
    mode: str
    stamped: bool = False  # its first token carries first_token_times
    sent: int = 0
    steps: int = 0


THREAD_BOUND_S = 60.0  # a hang bound: each loop of a fake worker checks its stop flag every 50 ms or so


@dataclass
class FakeWorker:
    redis_url: str
    tokenizer_dir: Path
    model: str = MODEL
    worker_id: str = "fake-unified-0"
    max_model_len: int = MAX_MODEL_LEN
    scheduling_policy: str = "fcfs"  # what it publishes as its --scheduling-policy
    jobs: list[Job] = field(default_factory=list)
    aborts: list[Abort] = field(default_factory=list)

    def __post_init__(self) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        self.eos = self.tokenizer.eos_token_id
        self._stop = threading.Event()
        self._aborted: set[str] = set()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []

    @property
    def holder_id(self) -> str:
        """The registered worker its events name: the gateway watches that one's heartbeat."""
        return self.worker_id

    @property
    def aborted(self) -> set[str]:
        with self._lock:
            return set(self._aborted)

    @property
    def streams(self) -> list[str]:
        """What it reads, in turn: the shared stream, or under the priority policy every band's, best first."""
        if self.scheduling_policy == "priority":
            return band_streams(self.model)
        return [keys.prefill_stream(self.model)]

    def model_info(self) -> ModelInfo:
        return ModelInfo(name=self.model, path=str(self.tokenizer_dir), max_model_len=self.max_model_len,
                         vocab_size=len(self.tokenizer), eos_token_ids=[self.eos], block_size=16, dtype="float32",
                         scheduling_policy=self.scheduling_policy)

    def start(self) -> "FakeWorker":
        r = sync_client(self.redis_url)
        r.set(keys.model_key(self.model), encode(self.model_info()))
        r.sadd(keys.MODELS_INDEX, self.model)
        for stream in self.streams:
            try:
                r.xgroup_create(stream, keys.PREFILL_GROUP, id="0", mkstream=True)
            except Exception as exc:  # BUSYGROUP: a previous worker made it
                assert "BUSYGROUP" in str(exc)
        self._heartbeat(r)
        r.close()
        pubsub_ready = threading.Event()
        for target, args in ((self._run_jobs, ()), (self._run_aborts, (pubsub_ready,)), (self._run_heartbeat, ())):
            thread = threading.Thread(target=target, args=args, daemon=True)
            thread.start()
            self._threads.append(thread)
        assert pubsub_ready.wait(60)  # a hang bound: the abort thread has subscribed
        return self

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            # a thread still reading after stop would take the next test's jobs from the shared stream
            thread.join(THREAD_BOUND_S)
            assert not thread.is_alive(), f"{self.worker_id}: {thread.name} did not stop"
        r = sync_client(self.redis_url)
        r.delete(keys.worker_key(self.worker_id))
        r.srem(keys.WORKERS_INDEX, self.worker_id)
        r.close()

    def _heartbeat(self, r) -> None:
        info = WorkerInfo(worker_id=self.worker_id, role="unified", models=[self.model], zmq_addr="tcp://127.0.0.1:1",
                          free_blocks=100, total_blocks=100, running=0, waiting=0, pid=0, host="test",
                          started=time.time(), heartbeat=time.time())
        r.set(keys.worker_key(self.worker_id), encode(info), ex=keys.HEARTBEAT_TTL_S)
        r.sadd(keys.WORKERS_INDEX, self.worker_id)

    def _run_heartbeat(self) -> None:
        r = sync_client(self.redis_url)
        while not self._stop.wait(1.0):
            self._heartbeat(r)
        r.close()

    def _run_aborts(self, ready: threading.Event) -> None:
        r = sync_client(self.redis_url)
        pubsub = r.pubsub()
        pubsub.subscribe(keys.ABORT_CHANNEL)
        ready.set()
        while not self._stop.is_set():
            msg = pubsub.get_message(ignore_subscribe_messages=True, timeout=0.05)
            if msg:
                abort = decode(msg["data"], Abort)
                with self._lock:
                    self.aborts.append(abort)
                    self._aborted.update(abort.request_ids)
        pubsub.close()
        r.close()

    def _plan(self, job: Job, again: bool) -> _Seq:
        """``again``: the job was delivered before."""
        prompt = self.tokenizer.decode(job.prompt_token_ids)
        mode = next((m for m in ("silent", "error", "slow", "hold", "reverse", "dup", "orphan", "tool", "calls",
                                 "args", "requeue") if f"[{m}]" in prompt), "normal")
        stamped = "[stamped]" in prompt or mode == "requeue"
        if mode == "requeue" and again:
            mode = "normal"
        text = {"tool": TOOL_REPLY, "calls": CALLS_REPLY, "args": ARGS_REPLY}.get(mode, REPLY)
        reply = self.tokenizer.encode(text, add_special_tokens=False)
        plan = reply * 20 if mode == "slow" else reply + [self.eos]
        return _Seq(job=job, plan=plan, mode=mode, stamped=stamped)

    def _event(self, seq: _Seq) -> TokenEvent | None:
        """The next step of ``seq``, or None if it has nothing to say this step."""
        params = seq.job.sampling
        seq.steps += 1
        if seq.mode == "silent" or (seq.mode == "slow" and seq.steps % 10) or (seq.mode == "hold" and seq.sent):
            return None
        if seq.mode == "requeue":  # its first delivery: a holder announced, then nothing
            return TokenEvent(request_id=seq.job.request_id, worker_id=ORPHAN_HOLDER) if seq.steps == 1 else None
        first = seq.sent == 0
        num_prompt = len(seq.job.prompt_token_ids)
        common = dict(request_id=seq.job.request_id, output_index=seq.sent, worker_id=self.holder_id,
                      num_prompt_tokens=num_prompt if first else 0, num_cached_tokens=num_prompt // 2 if first else 0)
        if seq.mode == "error":
            constraint = params.structured_outputs  # what the engine answers a constraint it cannot compile
            error = f"structured_outputs.{constraint.kind} does not compile: fake" if constraint else "fake worker exploded"
            return TokenEvent(**common, finish_reason="error", error=error)
        if seq.mode == "orphan":  # handed off to a decode worker that announced itself and then died
            if seq.sent == 1:
                return None if seq.steps > 2 else TokenEvent(request_id=seq.job.request_id, output_index=1,
                                                              worker_id=ORPHAN_HOLDER)
            common["worker_id"] = ""  # the first token comes from the prefill side, which names no holder
        token = seq.plan[seq.sent]
        seq.sent += 1
        finish = stop_reason = None
        if token == self.eos and not params.ignore_eos:
            finish = "stop"
        elif token in params.stop_token_ids:
            finish, stop_reason = "stop", token
        elif seq.sent >= params.max_tokens or seq.sent >= len(seq.plan):
            finish = "length"
        logprobs = top = prompt_lp = None
        if params.logprobs is not None:
            logprobs = [-0.5]
            known = [(token, -0.5), ((token + 1) % len(self.tokenizer), -1.5), (0, float("-inf"))]
            top = [known if params.logprobs == -1 else known[: params.logprobs]]  # -1: all it knows
        if first and params.prompt_logprobs is not None:
            prompt_lp = [None] + [[(t, -1.0)] for t in seq.job.prompt_token_ids[1:]]
        now = time.time()
        stamps = dict.fromkeys(FIRST_TOKEN_STAMPS, now) if first and seq.stamped else None
        return TokenEvent(**common, token_ids=[token], logprobs=logprobs, top_logprobs=top, prompt_logprobs=prompt_lp,
                          finish_reason=finish, stop_reason=stop_reason, first_token_times=stamps,
                          fetch_asked=now if stamps else None)

    def _run_jobs(self) -> None:
        r = sync_client(self.redis_url)
        ctx = zmq.Context()
        sockets: dict[str, zmq.Socket] = {}
        active: dict[str, _Seq] = {}
        held: dict[str, TokenEvent] = {}  # [reverse]: an event waiting to go out after its successor
        streams = dict.fromkeys(self.streams, ">")
        try:
            while not self._stop.is_set():
                got = r.xreadgroup(keys.PREFILL_GROUP, self.worker_id, streams, count=64,
                                   block=None if active else 50)
                for stream, entries in got or []:
                    for entry_id, fields in entries:
                        job = decode(fields[keys.JOB_FIELD.encode()], Job)
                        r.xack(stream, keys.PREFILL_GROUP, entry_id)
                        with self._lock:
                            again = any(j.request_id == job.request_id for j in self.jobs)
                            self.jobs.append(job)
                        active[job.request_id] = self._plan(job, again)
                for rid in self.aborted & active.keys():
                    del active[rid]
                batches: dict[str, list[TokenEvent]] = {}
                for rid, seq in list(active.items()):
                    event = self._event(seq)
                    if event is None:
                        continue
                    if event.finished:
                        del active[rid]
                    out = batches.setdefault(seq.job.reply_addr, [])
                    if seq.mode == "reverse" and rid not in held and not event.finished:
                        held[rid] = event
                        continue
                    out.append(event)
                    if rid in held:
                        out.append(held.pop(rid))
                    if seq.mode == "dup":
                        out.append(event)
                for addr, events in batches.items():
                    if addr not in sockets:
                        sockets[addr] = ctx.socket(zmq.PUSH)
                        sockets[addr].setsockopt(zmq.LINGER, 0)
                        zmq_auth.dial(sockets[addr], CURVE)
                        sockets[addr].connect(addr)
                    if events:  # one message per step per gateway
                        sockets[addr].send(encode(TokenBatch(events=events)))
                time.sleep(0.005)
        finally:
            for sock in sockets.values():
                sock.close(linger=0)
            ctx.term()
            r.close()


ORPHAN_HOLDER = "decode-that-died"  # never registered: its heartbeat is as gone as a killed worker's




class GatewayServer:
    """The real app on a real loopback port, in its own thread and event loop, so sync clients work."""

    def __init__(self, config: GatewayConfig):
        self.config = config
        self.loop = asyncio.new_event_loop()
        self._runner: web.AppRunner | None = None
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.app: web.Application | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.config.port}"

    def start(self) -> "GatewayServer":
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self.loop).result(30)
        return self

    async def _start(self) -> None:
        self.app = create_app(self.config)
        self._runner = web.AppRunner(self.app, handler_cancellation=True)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.config.port).start()

    def stop(self) -> None:
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self.loop).result(30)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


def gateway_config(redis_url: str, **over) -> GatewayConfig:
    return GatewayConfig(**{"port": free_port(), "redis_url": redis_url, "registry_cache_s": 0.0, "zmq_secret": SECRET,
                            "request_timeout": 30.0, "disconnect_poll_s": 0.1, **over})


@dataclass
class Stack:
    redis_url: str
    worker: FakeWorker
    server: GatewayServer

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def tokenizer(self):
        return self.worker.tokenizer

    def jobs_for(self, prefix: str) -> list[Job]:
        return [j for j in self.worker.jobs if j.request_id.startswith(prefix)]


def api_path(body: dict) -> str:
    """The OpenAI route a request body is for: completions with a prompt, chat completions with messages."""
    return "/v1/completions" if "prompt" in body else "/v1/chat/completions"


def post(stack: Stack, body: dict) -> httpx.Response:
    return httpx.post(f"{stack.url}{api_path(body)}", json=body, timeout=60)


@contextlib.contextmanager
def running_stack(tmp_dir: Path, chat_template: str = CHAT_TEMPLATE, max_model_len: int = MAX_MODEL_LEN,
                  extra_special: tuple[str, ...] = (), scheduling_policy: str = "fcfs", **config) -> Iterator[Stack]:
    tokenizer_dir = build_tokenizer(tmp_dir / "tokenizer", chat_template, extra_special)
    with EmbeddedRedis() as url:
        worker = FakeWorker(url, tokenizer_dir, max_model_len=max_model_len, scheduling_policy=scheduling_policy).start()
        server = GatewayServer(gateway_config(url, **config)).start()
        try:
            yield Stack(url, worker, server)
        finally:
            server.stop()
            worker.stop()


def ready_after_tokenizers(url: str, bound_s: float = 60.0) -> requests.Response:
    """``/ready``'s answer once the gateway's tokenizers loaded: the stack does not wait for them, and until they
    have, /ready says 503 with ``tokenizers_loading`` (and must say nothing else meanwhile)."""
    bound = time.monotonic() + bound_s
    while (r := requests.get(f"{url}/ready")).status_code == 503 and r.json().get("tokenizers_loading"):
        assert time.monotonic() < bound, r.text
        time.sleep(0.1)
    return r
