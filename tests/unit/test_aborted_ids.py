"""shared/worker/aborted.py: aborted ids are remembered for a while and up to a count, oldest forgotten first."""

from kvrelay.shared.worker import aborted
from kvrelay.shared.worker.aborted import AbortedIds


def test_an_id_is_seen_until_it_expires(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(aborted.time, "monotonic", lambda: now[0])
    ids = AbortedIds(remember_s=10)
    ids.add(["a"])
    now[0] = 105.0
    ids.add(["b"])
    assert ids.seen("a") and ids.seen("b") and not ids.seen("c")
    now[0] = 111.0
    assert not ids.seen("a") and ids.seen("b")
    now[0] = 116.0
    ids.expire()
    assert len(ids) == 0


def test_the_oldest_ids_go_first_past_the_bound():
    ids = AbortedIds(max_ids=3)
    ids.add(["a", "b", "c"])
    ids.add(["a"])  # aborted again: now the newest
    ids.add(["d"])
    assert [ids.seen(x) for x in "abcd"] == [True, False, True, True]
    assert len(ids) == 3
