"""The prefill side's choice of decode worker (prefill_worker/handoff.py): a prompt sharing a prefix with one
handed off before goes where that one went (its blocks are reused there), while that worker has room and is not
much busier; otherwise, and for a new prompt, the one with the most free KV. What it remembers is
shared/wire/prefix_affinity.py's, tested in test_prefix_affinity.py."""

import dataclasses

import torch
import zmq

from kvrelay.prefill_worker.handoff import SLACK, HandoffManager, Transfer
from kvrelay.shared.handoff.standalone import decode_info, endpoint, synthetic_job
from kvrelay.shared.wire.prefix_affinity import MAX_PREFIX_BLOCKS
from tests.zmq_secret import CURVE

MODEL = "m"
SHAPE = (2, 2, 64, 4, 2, 8)  # layers, K/V, blocks, block size, KV heads, head dim


def prompt(base: int, n: int = 22) -> list[int]:
    return [base + i for i in range(n)]


def transfer(rid: str, tokens: list[int]) -> Transfer:
    return Transfer(job=dataclasses.replace(synthetic_job(rid, len(tokens), MODEL), prompt_token_ids=tokens),
                    entry_id=rid.encode())


def decode(worker_id: str, free: int, running: int = 0):
    w = decode_info(f"tcp://127.0.0.1:{1 + len(worker_id)}", MODEL, worker_id)
    w.free_blocks, w.total_blocks, w.running = free, 64, running
    return w


def test_a_shared_prefix_goes_where_it_went_while_that_worker_has_room_and_is_not_much_busier():
    ctx = zmq.Context()
    workers = [decode("d1", free=40), decode("d2", free=30)]
    rt = endpoint(torch.zeros(SHAPE), "p1", MODEL)
    manager = HandoffManager(ctx, rt, 5.0, workers=lambda: workers, curve=CURVE)
    try:
        chat = prompt(100)
        assert manager._pick_decode_worker(transfer("turn-1", chat)).worker_id == "d1"  # most free KV
        workers[:] = [decode("d1", free=20), decode("d2", free=30)]
        # the next turn (the first one's prompt and more) and a sibling of the first go back to d1, which holds
        # the prompt, though d2 has more free KV; a prompt of its own goes by free KV
        assert manager._pick_decode_worker(transfer("turn-2", chat + prompt(900, 9))).worker_id == "d1"
        assert manager._pick_decode_worker(transfer("sibling", chat)).worker_id == "d1"
        assert manager._pick_decode_worker(transfer("other", prompt(5000))).worker_id == "d2"
        # no room there for the prompt (6 blocks of 4), or a batch more than SLACK requests busier: free KV decides
        workers[:] = [decode("d1", free=5), decode("d2", free=30)]
        assert manager._pick_decode_worker(transfer("turn-3", chat)).worker_id == "d2"
        workers[:] = [decode("d1", free=40, running=SLACK + 1), decode("d2", free=30)]
        assert manager._pick_decode_worker(transfer("turn-4", prompt(7000))).worker_id == "d1"  # new: most free KV
        workers[:] = [decode("d1", free=20, running=SLACK + 1), decode("d2", free=30)]
        assert manager._pick_decode_worker(transfer("turn-4b", prompt(7000))).worker_id == "d2"
        # one it tried already is not asked again, remembered or not
        t = transfer("turn-5", prompt(5000))
        t.tried.add("d2")
        assert manager._pick_decode_worker(t).worker_id == "d1"
    finally:
        manager.close()
        ctx.destroy(linger=0)


def test_a_long_prompt_is_remembered_by_its_first_blocks_only():
    ctx = zmq.Context()
    rt = endpoint(torch.zeros(SHAPE), "p1", MODEL)
    manager = HandoffManager(ctx, rt, 5.0, workers=lambda: [decode("d1", free=40)], curve=CURVE)
    try:
        long = transfer("long", prompt(100, n=4 * (MAX_PREFIX_BLOCKS + 50)))  # 4 tokens a block
        assert manager._pick_decode_worker(long).worker_id == "d1"
        assert len(long.block_hashes) == MAX_PREFIX_BLOCKS + 50
        assert len(manager.affinity) == MAX_PREFIX_BLOCKS
    finally:
        manager.close()
        ctx.destroy(linger=0)
