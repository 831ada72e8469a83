"""Siblings asking together: two handoffs of one prompt whose asks reach the decode worker before the first one's KV
landed. The second ask is held until the first lands, then granted past the blocks it brought (cached_blocks) and
sent only the rest; the decode engine continues both with the tokens of a run without reuse. When the first
transfer fails instead (its asker cancels it, or dies), the held ask is granted in full and completes.

Real tiny-llama engines on both sides (the prefill one holding finished prompts' KV for the handoff; the decode one
admitting handed-off requests, which caches their prompt blocks), a real HandoffReceiver and real HandoffManagers
over real CURVE ZMQ sockets, all polled from the test's thread (shared/handoff/held_asks.py is what is tested), the
decode side's held asks counted into a real decode WorkerMetrics as the decode worker wires them."""

from types import SimpleNamespace

import pytest
import zmq
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvrelay.decode_worker.receiver import HandoffReceiver
from kvrelay.prefill_worker.handoff import FirstToken, HandoffManager, State, Transfer
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.handoff.frames import Frames
from kvrelay.shared.handoff.held_asks import HoldState
from kvrelay.shared.handoff.standalone import decode_info, serves
from kvrelay.shared.wire import zmq_auth
from kvrelay.shared.wire.block_hash import DEFAULT_TENANT
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker.metrics import WorkerMetrics
from tests.zmq_secret import CURVE

pytestmark = [pytest.mark.timeout(300)]

MODEL = "tiny"
BLOCK = 8
MAX_NEW = 8
PROMPT = list(range(3, 3 + 5 * BLOCK + 3))  # five full blocks (reusable) and three tokens of a sixth (always sent)
POLLS = 6000  # a hang bound: each poll waits at most 5 ms for a message


def _engine(model_dir, prefill: bool, prefix_caching: bool = True) -> EngineCore:
    config = EngineConfig(ModelConfig(str(model_dir), dtype="float32", max_model_len=128),
                          cache=CacheConfig(block_size=BLOCK, num_gpu_blocks=64, enable_prefix_caching=prefix_caching),
                          device="cpu")
    return EngineCore(config, hold_finished_kv=prefill)


def _job(rid: str) -> Job:
    return Job(request_id=rid, model=MODEL, prompt_token_ids=PROMPT, tenant=DEFAULT_TENANT, priority=0,
               sampling=SamplingParams(temperature=0.0, max_tokens=MAX_NEW), reply_addr="", deadline=0.0, arrival=0.0)


class Pair:
    """A prefill engine and a decode engine, and the handoff between them: a decode worker's HandoffReceiver
    (``reuse``: its engine caches prompts, so grants may reuse them) and prefill managers made by ``manager``."""

    def __init__(self, model_dir, reuse: bool = True, grant_ttl_s: float = 10.0):
        self.prefill = _engine(model_dir, prefill=True)
        self.decode = _engine(model_dir, prefill=False, prefix_caching=reuse)
        self.ctx = zmq.Context()
        sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        zmq_auth.serve(sock, CURVE)
        self.addr = f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.receiver = HandoffReceiver(sock, serves(MODEL, self.decode), grant_ttl_s, transports=[Frames()])
        # as decode_worker/worker.py wires them: each model's held asks into that model's series
        metrics = {MODEL: WorkerMetrics(self.decode, MODEL, "decode", "d1", process_collectors=False)}
        self.receiver.held.on_end = lambda model, outcome, held_s: metrics[model].held_asks.ended(outcome, held_s)
        self.registry = metrics[MODEL].registry
        self.managers: list[HandoffManager] = []
        self.ended: dict[str, Transfer] = {}
        self.firsts: dict[str, int] = {}

    def manager(self) -> HandoffManager:
        runtime = SimpleNamespace(core=self.prefill, config=SimpleNamespace(worker_id="p1"), redis=None)
        self.managers.append(HandoffManager(self.ctx, runtime, 10.0, workers=lambda: [decode_info(self.addr, MODEL)],
                                            transports=[Frames()], curve=CURVE))
        return self.managers[-1]

    def prefill_all(self, *rids: str) -> None:
        """Prefill one prompt as each of ``rids`` (together: the engine's prompt sharing computes it once), their KV
        held for the handoff; their first tokens in ``firsts``."""
        for rid in rids:
            self.prefill.add_request(self.prefill.make_request(rid, PROMPT, SamplingParams(temperature=0.0, max_tokens=1)))
        while self.prefill.has_unfinished():
            for out in self.prefill.step():
                self.firsts[out.request_id] = out.new_token_ids[0]

    def start(self, manager: HandoffManager, rid: str, early: bool = False) -> None:
        manager.start(_job(rid), rid.encode(), None if early else FirstToken(self.firsts[rid]))

    def _admit(self, header) -> None:
        """What the decode worker does with KV that landed: the request joins the decode engine's batch."""
        req = self.decode.make_request(header.request_id, header.job.prompt_token_ids, header.job.sampling)
        self.decode.add_remote_prefilled(req, header.first_token_id, header.num_cached_tokens)

    def poll_until(self, cond, what: str) -> None:
        for _ in range(POLLS):
            if cond():
                return
            self.receiver.poll(5, self._admit)
            for m in self.managers:
                for t in m.poll(5):
                    self.ended[t.job.request_id] = t
        raise AssertionError(f"gave up waiting for {what}")

    def decoded(self) -> dict[str, list[int]]:
        """Run the decode engine until every admitted request ends; rid -> its tokens (the prefill's first, then
        the decode engine's)."""
        tokens = {rid: [t.header.first_token_id] for rid, t in self.ended.items() if t.state is State.DONE}
        while self.decode.has_unfinished():
            for out in self.decode.step():
                tokens[out.request_id] += out.new_token_ids
        return tokens

    def held_series(self) -> dict[str, float]:
        """The decode side's held-ask series as scraped: each outcome's kvrelay_handoff_held_asks_total, and the
        held-time histogram's count as "seconds_count"."""
        found = {}
        for family in text_string_to_metric_families(generate_latest(self.registry).decode()):
            for s in family.samples:
                if s.name == "kvrelay_handoff_held_asks_total":
                    found[s.labels["outcome"]] = s.value
                elif s.name == "kvrelay_handoff_held_ask_seconds_count":
                    found["seconds_count"] = s.value
        return found

    def close(self) -> None:
        for m in self.managers:
            m.close()
        self.ctx.destroy(linger=0)
        self.prefill.shutdown()
        self.decode.shutdown()


def _siblings_in_one_round(model_dir, reuse: bool) -> tuple[Pair, dict[str, list[int]]]:
    """"a" and "b", one prompt, prefilled together and handed off together: one message carries both asks."""
    pair = Pair(model_dir, reuse=reuse)
    try:
        pair.prefill_all("a", "b")
        manager = pair.manager()
        pair.start(manager, "a")
        pair.start(manager, "b")
        pair.poll_until(lambda: {"a", "b"} <= pair.ended.keys(), "both handoffs")
        assert [pair.ended[r].state for r in "ab"] == [State.DONE] * 2, [pair.ended[r].reason for r in "ab"]
        return pair, pair.decoded()
    except BaseException:
        pair.close()
        raise


@pytest.fixture(scope="module")
def without_reuse(tiny_model_dirs):
    """The same handoffs to a decode engine without prefix caching: every block sent, nothing held."""
    pair, tokens = _siblings_in_one_round(tiny_model_dirs["llama"], reuse=False)
    pair.close()
    assert not pair.receiver.held.outcomes
    assert pair.held_series() == {"ready": 0, "unblocked": 0, "dropped": 0, "seconds_count": 0}
    return {r: (pair.ended[r].grant.cached_blocks, pair.ended[r].nbytes) for r in "ab"}, tokens


def test_a_sibling_asking_with_the_first_is_held_then_sent_only_what_the_first_did_not_bring(
        tiny_model_dirs, without_reuse):
    (full, full_tokens) = without_reuse
    assert full["a"] == full["b"] == (0, full["a"][1]) and full["a"][1] > 0
    pair, tokens = _siblings_in_one_round(tiny_model_dirs["llama"], reuse=True)
    try:
        a, b = pair.ended["a"], pair.ended["b"]
        assert a.grant.cached_blocks == 0 and b.grant.cached_blocks == 5 and len(b.grant.block_ids) == 1
        assert pair.receiver.held.outcomes == {HoldState.HELD: 1, HoldState.READY: 1}
        assert pair.held_series() == {"ready": 1, "unblocked": 0, "dropped": 0, "seconds_count": 1}
        assert a.nbytes == full["a"][1] and b.nbytes * 6 == a.nbytes  # one block's KV, of six
        assert pair.receiver.bytes_received == a.nbytes + b.nbytes
        assert tokens == full_tokens and len(tokens["b"]) == MAX_NEW
    finally:
        pair.close()


@pytest.mark.parametrize("how", ["aborted", "killed"])
def test_a_sibling_held_for_a_transfer_that_fails_is_granted_in_full_and_completes(tiny_model_dirs, without_reuse,
                                                                                    how):
    """"a" is granted early (its prompt not computed yet) and never sends. Its asker cancels it: the held ask goes
    at once (its wait bound, a quarter of a 600 s grant TTL, is past the polls' hang bound). Or its asker dies: the
    decode side hears nothing, and the held ask's wait bound (a quarter of a 2 s grant TTL) lets it go."""
    _, full_tokens = without_reuse
    pair = Pair(tiny_model_dirs["llama"], grant_ttl_s=2.0 if how == "killed" else 600.0)
    try:
        pair.prefill_all("b")
        first, second = pair.manager(), pair.manager()
        pair.start(first, "a", early=True)
        pair.poll_until(lambda: first.transfers["a"].state is State.GRANTED, "a's early grant")
        pair.start(second, "b")
        pair.poll_until(lambda: pair.receiver.held.outcomes[HoldState.HELD] == 1 or "b" in pair.ended
                        or second.transfers["b"].state is not State.GRANT_WAIT, "b's ask held or answered")
        assert "b" in pair.receiver.held.asks and second.transfers["b"].state is State.GRANT_WAIT
        if how == "aborted":
            first.cancel("a")
        else:
            first.close()
            pair.managers.remove(first)
        pair.poll_until(lambda: "b" in pair.ended, "b's handoff")
        b = pair.ended["b"]
        assert b.state is State.DONE and b.grant.cached_blocks == 0, b.reason
        assert pair.receiver.held.outcomes[HoldState.UNBLOCKED] == 1 and not pair.receiver.held
        assert pair.held_series() == {"ready": 0, "unblocked": 1, "dropped": 0, "seconds_count": 1}
        assert pair.decoded() == {"b": full_tokens["b"]}
    finally:
        pair.close()
