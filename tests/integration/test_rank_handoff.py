"""The handoff with a sharded prefill worker whose ranks send their own parts (real rank processes over gloo,
real CURVE ZMQ sockets, a real HandoffManager and HandoffReceiver polled from the test's thread): each rank's
layers and KV heads reach the decode worker from that rank's own socket, none through rank 0, and the decode
engine, of any layout, continues with the greedy tokens of one process. A rank killed with -9 while its part
is still to come fails the transfer cleanly (the decode side frees the blocks, the group's error goes up, as
after any rank's death), and the request handed off again by a restarted worker completes."""

import os
import signal
import threading
import time

import pytest

from kvrelay.prefill_worker.handoff import State
from kvrelay.shared.engine.ranks.group import TensorParallelError
from tests.conftest import random_prompts
from tests.integration import rank_handoff_harness as harness

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def prompts():
    return random_prompts(3, lo=5, hi=40, seed=4)


@pytest.fixture(scope="module")
def one_process(tiny_model_dirs, prompts):
    return harness.one_process_tokens(tiny_model_dirs["llama"], prompts)


# (prefill tp, pp) -> (decode tp, pp) on the tiny llama: 2 layers, 2 KV heads
LAYOUTS = [((2, 1), (1, 1)), ((1, 2), (1, 1)), ((2, 1), (2, 1)), ((1, 2), (2, 1))]


@pytest.mark.parametrize(("sender", "receiver"), LAYOUTS, ids=["tp2-to-tp1", "pp2-to-tp1", "tp2-to-tp2", "pp2-to-tp2"])
def test_each_prefill_rank_sends_its_own_part_and_decode_continues_like_one_process(
        tiny_model_dirs, prompts, one_process, sender, receiver):
    model = tiny_model_dirs["llama"]
    prefill = harness.prefill_engine(model, *sender)
    decode = harness.decode_engine(model, *receiver)
    link = harness.linked(decode, prefill)
    firsts = {}
    with harness.closing(link, prefill, decode):
        for i, prompt in enumerate(prompts):
            rid = f"r{i}"
            first = harness.first_token(prefill, rid, prompt)
            before = dict(link.receiver.kv_bytes_by_sender)
            rank0_before = prefill.runner.parts.bytes_sent
            t = link.hand_off(rid, len(prompt), first)
            assert t.state is State.DONE, t.reason
            assert t.transport == "rank_layers" and rid in link.admitted
            # every rank's part came from its own socket, each exactly its share of the KV (both layouts split
            # it in two: 2 heads over 2 ranks, or 2 layers over 2 stages); none of it from rank 0's control socket
            sent = {peer: n - before.get(peer, 0) for peer, n in link.receiver.kv_bytes_by_sender.items()
                    if n != before.get(peer, 0)}
            assert sorted(sent.values()) == [t.nbytes // 2] * 2, sent
            assert prefill.runner.parts.bytes_sent - rank0_before == t.nbytes // 2
            assert prefill.kv.num_free_blocks == prefill.num_total_blocks  # released once the ranks copied
            firsts[rid] = (prompt, first)
        got = harness.decoded(decode, firsts)
    assert [got[f"r{i}"] for i in range(len(prompts))] == one_process


def test_a_rank_killed_while_its_part_is_due_fails_the_transfer_and_a_rerun_completes(tiny_model_dirs, prompts,
                                                                                       one_process):
    model = tiny_model_dirs["llama"]
    decode = harness.decode_engine(model, 1, 1)
    free_before = decode.kv.num_free_blocks
    prefill = harness.prefill_engine(model, 2, 1)
    link = harness.linked(decode, prefill)
    prompt, rid = prompts[0], "r0"
    (pid,) = prefill.runner.ranks.pids
    with harness.closing(link, prefill):
        first = harness.first_token(prefill, rid, prompt)
        os.kill(pid, signal.SIGSTOP)  # rank 1 takes no message: its part is not sent
        # should rank 0 ever block on rank 1 (a gather), this ends the wait and the test fails below
        backstop = threading.Timer(60, os.kill, (pid, signal.SIGKILL))
        backstop.start()
        link.start(rid, len(prompt), first)
        deadline = time.monotonic() + 60
        while not (rid in link.receiver.incoming and link.receiver.incoming[rid].header is not None
                   and link.receiver.incoming[rid].receiver.parts == 1):
            assert time.monotonic() < deadline, "rank 0's part and the header never reached the decode side"
            link.receiver.poll(5, lambda h: None)
            assert not link.manager.poll(5)
        assert not link.receiver.incoming[rid].receiver.complete  # rank 1's heads are missing
        assert backstop.is_alive()  # rank 0 got here with rank 1 stopped: it never waited for it
        backstop.cancel()
        os.kill(pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(TensorParallelError, match=f"rank 1 of 2 \\(pid {pid}\\) was killed by signal 9"):
            while True:
                link.receiver.poll(5, lambda h: None)
                link.manager.poll(5)
                assert time.monotonic() - started < 60, "the group's death never failed the transfer"
        for _ in range(200):  # the sender's cancel frees the decode side's blocks at once, not at its TTL
            link.receiver.poll(5, lambda h: None)
            if rid not in link.receiver.incoming:
                break
        assert rid not in link.receiver.incoming and decode.kv.num_free_blocks == free_before
    # the worker restarted (as its supervisor does): the job is run again and handed off
    prefill = harness.prefill_engine(model, 2, 1)
    link = harness.linked(decode, prefill)
    with harness.closing(link, prefill, decode):
        got = harness.handed_off_by_rank_layers(link, prefill, decode, rid, prompt)
    assert got == one_process[0]
