"""What the engine loop snapshots for threads that must not wait for its steps: a snapshot is taken only when
asked, at the end of the turn in progress; while no turn ends, the asker gets the last one taken."""

import threading

from kvrelay.shared.worker.turn_snapshot import TurnSnapshot


def test_the_asker_gets_the_turn_s_snapshot_or_else_the_last_one():
    state = {"count": 0}
    taken = []

    def take() -> int:
        taken.append(state["count"])
        return state["count"]

    snap = TurnSnapshot(take)
    snap.turn_ended()
    assert taken == []  # not asked: a turn pays nothing
    assert snap.latest(0.01) is None  # no turn ended, none taken yet
    assert snap.take_now() == 0
    state["count"] = 5  # a step changes it, and has not ended
    assert snap.latest(0.01) == 0  # the last one taken
    asked = threading.Event()
    got = []

    def ask() -> None:
        asked.set()
        got.append(snap.latest(60))

    asker = threading.Thread(target=ask)
    asker.start()
    asked.wait(60)
    while asker.is_alive():  # the loop's turns end until the asker has its snapshot
        snap.turn_ended()
        asker.join(0.01)
    assert got == [5]
    snap.turn_ended()
    assert taken[-1] == 5 and len(taken) <= 4  # taken when asked, not at every turn
