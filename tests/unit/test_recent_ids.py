"""shared/worker/recent_ids.py: aborted ids are remembered for a while and up to a count, oldest forgotten first."""

from kvrelay.shared.worker import recent_ids
from kvrelay.shared.worker.recent_ids import RecentIds


def test_an_id_is_seen_until_it_expires(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(recent_ids.time, "monotonic", lambda: now[0])
    ids = RecentIds(remember_s=10)
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
    ids = RecentIds(max_ids=3)
    ids.add(["a", "b", "c"])
    ids.add(["a"])  # aborted again: now the newest
    ids.add(["d"])
    assert [ids.seen(x) for x in "abcd"] == [True, False, True, True]
    assert len(ids) == 3
