"""Decode worker main loop.

Lifecycle of one request here:
  1. A prefill worker asks for room (HandoffRequest); the receiver allocates blocks or refuses.
  2. KV frames arrive, are checked and copied into those blocks; the request joins the running batch
     with its prompt already computed and the prefill's first token as output 0; the ack goes back.
  3. Every step (continuous batching with everything else running) produces one token per request;
     one TokenBatch per gateway carries them.
  4. A stop condition, an abort published by the gateway, or the job's deadline ends it and frees
     its blocks within that step.

SIGTERM drains: no new grants (prefill workers go elsewhere), KV already granted is still taken, the
running batch finishes (up to the drain timeout), and what is left ends with an error event so no
client waits on a worker that is gone (``_abandon``).
"""

import logging
import math
import time

import zmq

from decode_worker.receiver import HandoffReceiver
from shared.kv_transfer import max_message_bytes
from shared.protocol import KVHeader, TokenEvent
from shared.sampling_params import SamplingParams
from shared.worker_runtime import WorkerConfig, WorkerRuntime, token_event

log = logging.getLogger(__name__)


class DecodeWorker:
    def __init__(self, config: WorkerConfig):
        self.runtime = WorkerRuntime(config)
        self.core = self.runtime.core
        runner = self.core.runner
        # a KV frame holds at most ~4 MiB of layers, or one layer of the longest prompt; bigger is hostile
        max_frame = max_message_bytes(runner.kv_cache, math.ceil(self.core.max_model_len / runner.block_size))
        self.sock, self.addr = bind_router(self.runtime.ctx, config.host, config.port, max_frame,
                                           config.advertise_host)
        self.receiver = HandoffReceiver(self.sock, self.core, config.model_name, config.handoff_timeout_s)
        self.requests: dict[str, tuple[str, float, int]] = {}  # id -> (reply addr, deadline, tokens sent)

    def run(self) -> None:
        self.runtime.start(self.addr)
        try:
            self.runtime.serve_forever(self.step, busy=lambda: bool(self.requests) or self.receiver.busy,
                                       abandon=self._abandon)
        finally:
            self.sock.close(linger=0)

    def step(self) -> None:
        self.receiver.accepting = not self.runtime.draining
        busy = self.core.has_unfinished()
        self.receiver.poll(0 if busy else 20, self._admit)
        self._abort(self.runtime.drain_aborts(), reason=None)
        now = time.time()
        self._abort([rid for rid, (_, deadline, _) in self.requests.items() if deadline and now > deadline],
                    reason="deadline exceeded")
        if self.core.has_unfinished():
            for out in self.core.step():
                entry = self.requests.get(out.request_id)
                if entry is None:
                    continue
                addr, deadline, sent = entry
                self.runtime.events.add(addr, token_event(out, sent, self.runtime.config.worker_id))
                if out.finished:
                    del self.requests[out.request_id]
                else:
                    self.requests[out.request_id] = (addr, deadline, sent + len(out.new_token_ids))
        self.runtime.events.flush()

    def _admit(self, h: KVHeader) -> None:
        params = SamplingParams.from_dict(h.sampling)
        eos = self.runtime.eos_ids
        req = self.core.make_request(h.request_id, h.prompt_token_ids, params, eos[0] if eos else None,
                                     h.priority, h.cache_salt, tenant=h.tenant, arrival=h.arrival)
        if not params.ignore_eos:
            req.sampling_params.stop_token_ids = params.stop_token_ids + [t for t in eos[1:]]
        req.output_token_ids = [h.first_token_id]
        req.num_computed_tokens = len(h.prompt_token_ids)
        req.num_cached_tokens = h.num_cached_tokens
        self.core.scheduler.add_prefilled_request(req)
        self.requests[h.request_id] = (h.reply_addr, h.deadline, 1)

    def _abort(self, request_ids: list[str], reason: str | None, finish_reason: str = "abort") -> None:
        for rid in request_ids:
            entry = self.requests.pop(rid, None)
            if entry is None:
                continue
            self.core.abort([rid])
            if reason:  # an abort the gateway asked for needs no answer: its client is gone
                error = reason if finish_reason == "error" else None
                self.runtime.events.add(entry[0], TokenEvent(request_id=rid, finish_reason=finish_reason,
                                                             error=error, output_index=entry[2],
                                                             worker_id=self.runtime.config.worker_id))


    def _abandon(self) -> None:
        self._abort(list(self.requests), reason="decode worker shut down before the request finished",
                    finish_reason="error")
        for rid in list(self.receiver.grants):
            self.core.block_manager.free(rid)  # KV never came; its prefill worker times the handoff out
        self.receiver.grants.clear()


def bind_router(ctx: zmq.Context, host: str, port: int, max_msg_size: int,
                advertise_host: str | None = None) -> tuple[zmq.Socket, str]:
    """A ROUTER socket on host:port (0 = ephemeral) and the address peers should dial."""
    if advertise_host is None and host in ("0.0.0.0", "*", "::"):
        raise ValueError("--host is a wildcard: set --advertise-host to an address prefill workers can reach")
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
    if port:
        sock.bind(f"tcp://{host}:{port}")
    else:
        port = sock.bind_to_random_port(f"tcp://{host}")
    return sock, f"tcp://{advertise_host or host}:{port}"
