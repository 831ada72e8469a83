"""A handoff between sharded engines driven from the test's thread, for the tensor/pipeline-parallel handoff
tests: engines of a layout on the tiny llama (real rank processes over gloo), a ``Link`` of real CURVE ZMQ
sockets between a real HandoffReceiver and a real HandoffManager, a request prefilled, handed off and
decoded, and the greedy tokens of one process to compare with."""

import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace

import zmq

from kvrelay import LLM, SamplingParams
from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.prefill_worker.handoff import FirstToken, HandoffManager, State, Transfer
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.kv_connector import KVLinks
from kvrelay.shared.handoff.fake import in_process
from kvrelay.shared.handoff.frames import Frames
from kvrelay.shared.handoff.standalone import decode_info, serves, synthetic_job
from kvrelay.shared.wire import zmq_auth
from tests.zmq_secret import CURVE

MODEL = "tiny"
BLOCK = 8
MAX_NEW = 8


class Link:
    """A decode side's ROUTER and a prefill side's manager, both polled from the test's thread (a sharded
    engine's collectives must all run on one thread, as they do on a worker's loop)."""

    def __init__(self, decode_core, prefill_runtime):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        zmq_auth.serve(self.sock, CURVE)
        addr = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.receiver = HandoffReceiver(self.sock, serves(MODEL, decode_core), 10.0,
                                        transports=[in_process(), Frames()])
        self.manager = HandoffManager(self.ctx, prefill_runtime, 10.0, workers=lambda: [decode_info(addr, MODEL)],
                                      transports=[in_process(), Frames()], curve=CURVE)
        self.admitted: dict = {}

    def start(self, rid: str, num_tokens: int, first: int = 2) -> None:
        self.manager.start(synthetic_job(rid, num_tokens, MODEL), rid.encode(), FirstToken(first))

    def until_ended(self, rid: str) -> Transfer:
        """Poll both sides until the handoff of ``rid`` ends."""
        for _ in range(3000):
            self.receiver.poll(5, lambda h: self.admitted.setdefault(h.request_id, h))
            for t in self.manager.poll(5):
                if t.job.request_id == rid:
                    return t
        raise AssertionError(f"handoff of {rid} did not end")

    def hand_off(self, rid: str, num_tokens: int, first: int = 2) -> Transfer:
        self.start(rid, num_tokens, first)
        return self.until_ended(rid)

    def close(self) -> None:
        self.manager.close()
        self.ctx.destroy(linger=0)


def prefill_runtime(core: EngineCore) -> SimpleNamespace:
    """What a HandoffManager reads of a prefill worker: its engine, its id, no Redis."""
    return SimpleNamespace(core=core, config=SimpleNamespace(worker_id="p1"), redis=None)


def linked(decode: EngineCore, prefill: EngineCore) -> Link:
    return Link(decode, prefill_runtime(prefill))


@contextmanager
def closing(link: Link, *cores: EngineCore) -> Iterator[None]:
    """Close ``link`` and shut ``cores`` down however the block ends (their rank processes with them)."""
    try:
        yield
    finally:
        link.close()
        for core in cores:
            core.shutdown()


def _engine(model_dir, tp: int, pp: int, prefill: bool, kv_links: KVLinks | None) -> EngineCore:
    config = EngineConfig(ModelConfig(str(model_dir), dtype="float32", max_model_len=128),
                          cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=64), device="cpu",
                          tensor_parallel_size=tp, pipeline_parallel_size=pp)
    return EngineCore(config, hold_finished_kv=prefill, kv_links=kv_links)


def prefill_engine(model_dir, tp: int, pp: int) -> EngineCore:
    """A prefill engine whose ranks send their own parts of a finished request's KV."""
    return _engine(model_dir, tp, pp, prefill=True, kv_links=KVLinks.of(CURVE))


def decode_engine(model_dir, tp: int, pp: int, rank_inlets: bool = False) -> EngineCore:
    """A decode engine; with ``rank_inlets`` each of its ranks takes its own share of the KV on its own socket
    (wait for them with ``wait_for_rank_inlets``), otherwise rank 0 takes all of it."""
    return _engine(model_dir, tp, pp, prefill=False, kv_links=KVLinks.of(CURVE, "127.0.0.1") if rank_inlets else None)


def wait_for_rank_inlets(decode: EngineCore) -> None:
    """Until the decode engine's rank 1 has said where it listens (once its process is up)."""
    deadline = time.monotonic() + 60
    while len(decode.runner.inlets.addresses) < 1:
        assert time.monotonic() < deadline, "decode rank 1 never reported its inlet"
        decode.runner.inlets.poll()
        time.sleep(0.05)


def first_token(core: EngineCore, rid: str, prompt: list[int]) -> int:
    """Prefill ``prompt`` as ``rid``, its KV held for the handoff; the first token."""
    core.add_request(core.make_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1)))
    outs = []
    while core.has_unfinished():
        outs += [o for o in core.step() if o.request_id == rid]
    (out,) = outs
    return out.new_token_ids[0]


def decoded(core: EngineCore, firsts: dict[str, tuple[list[int], int]]) -> dict[str, list[int]]:
    """Continue each handed-off request (rid -> prompt, first token) greedily; rid -> its tokens."""
    tokens = {}
    for rid, (prompt, first) in firsts.items():
        core.add_remote_prefilled(core.make_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=MAX_NEW)),
                                  first, 0)
        tokens[rid] = [first]
    while core.has_unfinished():
        for o in core.step():
            tokens[o.request_id] += o.new_token_ids
    return tokens


def handed_off_by_rank_layers(link: Link, prefill_core: EngineCore, decode_core: EngineCore, rid: str,
                              prompt: list[int]) -> list[int]:
    """``prompt`` prefilled, handed off by the ranks' own sockets and decoded: its tokens."""
    first = first_token(prefill_core, rid, prompt)
    t = link.hand_off(rid, len(prompt), first)
    assert t.state is State.DONE and t.transport == "rank_layers", t.reason
    return decoded(decode_core, {rid: (prompt, first)})[rid]


def one_process_tokens(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    """The greedy tokens one process gives for ``prompts``: what every layout must reproduce."""
    with LLM(model=str(model_dir), dtype="float32", max_model_len=128, block_size=BLOCK) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    return [o.outputs[0].token_ids for o in outs]
