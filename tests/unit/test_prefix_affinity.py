"""Where a prompt prefix went (shared/wire/prefix_affinity.py), as the gateway's routing and the prefill side's
choice of decode worker both remember it: the longest recorded prefix that went to a live worker wins, per model,
and the least recently recorded entries go first once it is full."""

from kvrelay.shared.wire.prefix_affinity import PrefixAffinity


def test_the_longest_recorded_prefix_wins_per_model():
    index = PrefixAffinity(capacity=10)
    index.record("m", [1, 2], "w1")
    index.record("m", [1, 2, 3], "w2")  # a longer prompt sharing the first's blocks went elsewhere
    assert index.lookup("m", [1, 2, 3, 4], {"w1", "w2"}) == "w2"  # block 3
    assert index.lookup("m", [1, 2, 9], {"w1", "w2"}) == "w2"  # block 2, re-recorded by the second
    assert index.lookup("m", [7, 8], {"w1", "w2"}) is None
    assert index.lookup("other", [1, 2, 3], {"w1", "w2"}) is None
    assert len(index) == 3


def test_a_departed_worker_is_skipped_for_a_shorter_prefix_that_went_to_a_live_one():
    index = PrefixAffinity(capacity=10)
    index.record("m", [1], "w1")
    index.record("m", [5, 6, 7], "w2")
    index.record("m", [1, 2, 3], "w3")
    index.record("m", [1], "w1")  # block 1 back on w1; 2 and 3 still name w3
    assert index.lookup("m", [1, 2, 3], {"w1", "w3"}) == "w3"
    assert index.lookup("m", [1, 2, 3], {"w1"}) == "w1"  # w3 is gone: block 1's worker, not nothing
    assert index.lookup("m", [1, 2, 3], {"w2"}) is None
    assert len(index) == 6  # skipped, not forgotten


def test_the_least_recently_recorded_go_first_and_looking_up_does_not_keep_an_entry():
    index = PrefixAffinity(capacity=4)
    index.record("m", [1], "w1")
    index.record("m", [2], "w1")
    index.record("m", [3], "w1")
    index.record("m", [1], "w2")  # recorded again: now the newest
    assert index.lookup("m", [2], {"w1"}) == "w1"  # a lookup is no use of it
    index.record("m", [4, 5], "w1")  # five entries: block 2, the oldest recorded, goes
    assert len(index) == 4
    assert index.lookup("m", [2], {"w1"}) is None
    assert index.lookup("m", [3], {"w1"}) == "w1"
    assert index.lookup("m", [1], {"w2"}) == "w2"
    index.record("m", [6, 7, 8, 9, 10], "w1")  # one record longer than the capacity keeps its last blocks
    assert len(index) == 4
    assert [index.lookup("m", [h], {"w1"}) for h in (6, 7, 8, 9, 10)] == [None, "w1", "w1", "w1", "w1"]
