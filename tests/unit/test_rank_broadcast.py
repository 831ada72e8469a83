"""Rank 0's step broadcast (shared/engine/ranks/broadcast.py): a message reaches a rank that reads, and a send
to a rank that takes nothing (dead, its socket never connected) ends as soon as the group is known down."""

import pytest
import zmq

from kvrelay.shared.engine.ranks.broadcast import StepReceiver, StepSender
from kvrelay.shared.wire.rank_step import RankStop


def test_a_message_reaches_a_rank_that_reads(tmp_path):
    sender, receiver = StepSender(tmp_path, world_size=2), StepReceiver(tmp_path, rank=1)
    try:
        sender.send(RankStop())
        got = receiver.recv(timeout_ms=60_000)
    finally:
        receiver.close()
        sender.close()
    assert got is not None and isinstance(got[0], RankStop) and got[1] is None


def test_a_send_no_rank_takes_ends_once_the_group_is_down(tmp_path):
    sender = StepSender(tmp_path, world_size=2)  # rank 1 never connects: its socket takes no message
    asked: list[int] = []

    def gone() -> bool:  # what the group's watchdog says: down from the third question on
        asked.append(1)
        return len(asked) >= 3

    try:
        with pytest.raises(zmq.Again):
            sender.send(RankStop(), gone=gone)
    finally:
        sender.close()
    assert len(asked) == 3
