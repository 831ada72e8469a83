"""decode_worker/step_pace.py: when the decode loop may start its next step, on a clock the test moves."""

from kvrelay.decode_worker.step_pace import StepPace


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_paced_only_while_kv_is_on_its_way():
    clock = Clock()
    pace = StepPace(0.012, clock)
    assert pace.start_at(kv_arriving=True) is None  # no step yet to count from
    pace.started()
    clock.now += 0.004
    assert pace.start_at(kv_arriving=True) == 100.012
    assert pace.start_at(kv_arriving=False) is None  # nothing prefilled for us: a lone request steps at once
    clock.now += 0.008
    assert pace.start_at(kv_arriving=True) is None  # the interval is up
    pace.started()
    clock.now += 0.001
    assert pace.start_at(kv_arriving=True) == 100.024


def test_a_step_longer_than_the_interval_is_not_followed_by_a_wait():
    clock = Clock()
    pace = StepPace(0.010, clock)
    pace.started()
    clock.now += 0.025
    assert pace.start_at(kv_arriving=True) is None


def test_zero_interval_never_waits():
    clock = Clock()
    pace = StepPace(0.0, clock)
    pace.started()
    assert pace.start_at(kv_arriving=True) is None
