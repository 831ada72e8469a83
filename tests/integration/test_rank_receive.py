"""A sharded DECODE worker whose ranks each take their own share of handed-off KV (real rank processes over gloo,
real CURVE ZMQ sockets, a real HandoffManager and HandoffReceiver polled from the test's thread): the grant
names every decode rank's socket, layers and heads; each sharded prefill rank splits its part among them; each
decode rank's socket takes exactly its share (rank 0's socket only rank 0's, no staging copy of the whole KV,
no scatter), and the decode engine continues with the greedy tokens of one process. A prefill worker of one
process (TP 1) sends each decode rank its share the same way, from its own process. A decode rank killed with
-9 while its share is due fails the transfer at once (no hang); the request handed off again to a restarted
decode worker completes."""

import os
import signal
import time

import pytest

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.engine.ranks.group import TensorParallelError
from kvrelay.shared.handoff import incoming as incoming_module
from tests.conftest import random_prompts
from tests.integration import rank_handoff_harness as harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _no_staging(monkeypatch) -> None:
    """Rank 0 never builds a full staging copy nor scatters one: the test fails if it does."""
    def refuse(*_a, **_k):
        raise AssertionError("a full staging copy on the decode worker's rank 0")
    monkeypatch.setattr(incoming_module, "ImportingReceiver", refuse)


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(2, lo=5, hi=40, seed=5)


@pytest.fixture(scope="module")
def one_process(tiny_model_dirs, prompts):
    return harness.one_process_tokens(tiny_model_dirs["llama"], prompts)


# (prefill tp, pp) -> (decode tp, pp) on the tiny llama: 2 layers, 2 KV heads. A prefill worker of one process
# splits its whole KV among the decode ranks itself, as a sharded one's ranks split their parts
LAYOUTS = [((2, 1), (2, 1)), ((1, 2), (1, 2)), ((2, 1), (1, 2)), ((1, 1), (2, 1)), ((1, 1), (1, 2))]


@pytest.mark.parametrize(("sender", "receiver"), LAYOUTS,
                         ids=["tp2-to-tp2", "pp2-to-pp2", "tp2-to-pp2", "tp1-to-tp2", "tp1-to-pp2"])
def test_each_decode_rank_takes_its_own_share_and_decode_continues_like_one_process(
        tiny_model_dirs, prompts, one_process, sender, receiver, monkeypatch):
    _no_staging(monkeypatch)
    model = tiny_model_dirs["llama"]
    prefill = harness.prefill_engine(model, *sender)
    decode = harness.decode_engine(model, *receiver, rank_inlets=True)
    link = harness.linked(decode, prefill)
    firsts = {}
    with harness.closing(link, prefill, decode):
        harness.wait_for_rank_inlets(decode)
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            first = harness.first_token(prefill, rid, prompt)
            before = dict(link.receiver.kv_bytes_by_sender)
            ranks_before = decode.kv.rank_bytes_received
            sent_before = 0 if prefill.runner.parts is None else prefill.runner.parts.bytes_sent
            t = link.hand_off(rid, len(prompt), first)
            assert t.state is State.DONE, t.reason
            assert t.transport == "rank_layers" and rid in link.admitted
            # the decode worker's rank 0 socket took its half of the KV only; rank 1 took the other half itself
            to_rank0 = sum(n - before.get(peer, 0) for peer, n in link.receiver.kv_bytes_by_sender.items())
            to_rank1 = decode.kv.rank_bytes_received.get(1, 0) - ranks_before.get(1, 0)
            assert (to_rank0, to_rank1) == (t.nbytes // 2, t.nbytes // 2)
            if sender == (1, 1):  # both shares left the prefill worker's own process, nothing through a rank
                assert prefill.runner.ranks is None and prefill.runner.parts.bytes_sent - sent_before == t.nbytes
            firsts[rid] = (prompt, first)
        got = harness.decoded(decode, firsts)
    assert [got[f"r{i}"] for i in range(len(prompts))] == one_process


def test_a_decode_rank_killed_while_its_share_is_due_fails_the_transfer_and_a_rerun_completes(
        tiny_model_dirs, prompts, one_process):
    model = tiny_model_dirs["llama"]
    prefill = harness.prefill_engine(model, 2, 1)
    decode = harness.decode_engine(model, 2, 1, rank_inlets=True)
    link = harness.linked(decode, prefill)
    prompt, rid = prompts[0], "r0"
    (pid,) = decode.runner.ranks.pids
    with harness.closing(link, decode):
        harness.wait_for_rank_inlets(decode)
        first = harness.first_token(prefill, rid, prompt)
        os.kill(pid, signal.SIGSTOP)  # decode rank 1 takes nothing: its share stays due
        link.start(rid, len(prompt), first)
        deadline = time.monotonic() + 60
        while not (rid in link.receiver.incoming and link.receiver.incoming[rid].header is not None):
            assert time.monotonic() < deadline, "rank 0's share and the header never reached the decode side"
            link.receiver.poll(5, lambda h: None)
            assert not link.manager.poll(5)
        assert not link.receiver.incoming[rid].receiver.complete  # rank 1's share is missing
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        ended = None
        while ended is None:  # the decode side fails the transfer for the dead rank; the sender hears the nack
            assert time.monotonic() - started < 60, "a dead decode rank's transfer never failed"
            link.receiver.poll(5, lambda h: None)
            ended = next((t for t in link.manager.poll(5) if t.job.request_id == rid), None)
        assert ended.state is not State.DONE and rid not in link.receiver.incoming
        # a worker going down, not bad KV: the prefill worker runs the job again (prefill_worker/worker.py)
        assert ended.target_lost, ended.reason
        with pytest.raises(TensorParallelError, match="was killed by signal 9"):
            decode.runner.check()  # the group is down: the worker goes down as after any rank's death
    # the decode worker restarted (as its supervisor does); the request is handed off again and completes
    decode = harness.decode_engine(model, 2, 1, rank_inlets=True)
    link = harness.linked(decode, prefill)
    with harness.closing(link, prefill, decode):
        harness.wait_for_rank_inlets(decode)
        got = harness.handed_off_by_rank_layers(link, prefill, decode, "r0b", prompt)
    assert got == one_process[0]


@pytest.mark.timeout(240)  # without the wake the poll below outwaits this: the test fails here
def test_rank_0s_waiting_loop_wakes_for_the_last_ranks_report_and_lands_the_transfer(tiny_model_dirs, prompts):
    model = tiny_model_dirs["llama"]
    prefill = harness.prefill_engine(model, 1, 1)
    decode = harness.decode_engine(model, 2, 1, rank_inlets=True)
    link = harness.linked(decode, prefill)
    prompt, rid = prompts[0], "r0"
    (pid,) = decode.runner.ranks.pids

    def admit(header) -> None:
        link.admitted.setdefault(header.request_id, header)

    def rank_0s_share_and_header_in() -> bool:
        inc = link.receiver.incoming.get(rid)
        return inc is not None and inc.header is not None and inc.receiver.inner.complete

    with harness.closing(link, prefill, decode):
        try:
            harness.wait_for_rank_inlets(decode)
            first = harness.first_token(prefill, rid, prompt)
            os.kill(pid, signal.SIGSTOP)  # decode rank 1 takes its share only once rank 0 waits for nothing else
            link.start(rid, len(prompt), first)
            deadline = time.monotonic() + 60
            while not rank_0s_share_and_header_in():
                assert time.monotonic() < deadline, "rank 0's share and the header never reached the decode side"
                link.receiver.poll(5, admit)
                assert not link.manager.poll(5)
            link.receiver.poll(0, admit)  # takes any wake-up its own writes left
            assert rid not in link.admitted and not link.receiver.incoming[rid].receiver.complete
            os.kill(pid, signal.SIGCONT)
            link.receiver.poll(3_600_000, admit)  # returns for rank 1's report: nothing else is due
            assert rid in link.admitted and rid not in link.receiver.incoming
            t = link.until_ended(rid)
            assert t.state is State.DONE and t.transport == "rank_layers", t.reason
        finally:
            os.kill(pid, signal.SIGCONT)
