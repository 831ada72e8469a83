"""The goodput sweep's search (bench/rate_search.py) against a fake SLO oracle, a pure function of the rate,
and the verdict a trial's metrics get (bench/serve_sweep.py): where the search stops, what it reports,
and that it never runs more trials than allowed. No server: the sweep against real ones is
tests/e2e/test_bench_serve_sweep.py."""

import pytest

from kvrelay.rate_search import SearchSpace, Slo, Trial, bounds, next_rate, outcome, verdict


def search(oracle, space: SearchSpace) -> tuple[list[Trial], dict]:
    trials: list[Trial] = []
    while (rate := next_rate(trials, space)) is not None:
        trials.append(Trial(rate, oracle(rate)))
    return trials, outcome(trials, space)


def test_doubles_until_a_fail_then_bisects_to_the_resolution():
    trials, found = search(lambda rate: rate <= 23.0, SearchSpace(start=4, resolution=1, max_trials=20))
    assert [t.rate for t in trials] == [4, 8, 16, 32, 24, 20, 22, 23]
    assert found == {"found_rate": 23, "lowest_failing_rate": 24, "trials_run": 8, "stopped": "resolved"}


@pytest.mark.parametrize("start", [0.5, 1, 3, 4, 10, 64])
@pytest.mark.parametrize("capacity", [0.7, 1.0, 5.5, 17, 22.9, 40])
def test_finds_the_capacity_within_the_resolution_from_any_start(start, capacity):
    space = SearchSpace(start=start, resolution=0.5, max_trials=40)
    trials, found = search(lambda rate: rate <= capacity, space)
    assert found["stopped"] == "resolved"
    assert found["found_rate"] is not None and found["found_rate"] <= capacity < found["lowest_failing_rate"]
    assert found["lowest_failing_rate"] - found["found_rate"] <= 0.5
    assert len({t.rate for t in trials}) == len(trials)  # no rate is tried twice


def test_a_start_that_already_fails_bisects_towards_zero_and_reports_no_rate():
    trials, found = search(lambda rate: rate <= 0.3, SearchSpace(start=4, resolution=1, max_trials=20))
    assert [t.rate for t in trials] == [4, 2, 1]
    assert found == {"found_rate": None, "lowest_failing_rate": 1, "trials_run": 3, "stopped": "resolved"}


def test_a_server_that_never_fails_stops_at_the_trial_cap_with_a_lower_bound():
    trials, found = search(lambda rate: True, SearchSpace(start=1, resolution=1, max_trials=5))
    assert [t.rate for t in trials] == [1, 2, 4, 8, 16]
    assert found == {"found_rate": 16, "lowest_failing_rate": None, "trials_run": 5, "stopped": "trial cap"}


def test_the_cap_also_ends_a_bisection_with_the_best_pass_so_far():
    trials, found = search(lambda rate: rate <= 23.0, SearchSpace(start=4, resolution=0.01, max_trials=6))
    assert [t.rate for t in trials] == [4, 8, 16, 32, 24, 20]
    assert found == {"found_rate": 20, "lowest_failing_rate": 24, "trials_run": 6, "stopped": "trial cap"}


def test_a_pass_above_a_fail_is_noise_and_the_search_stays_below_the_fail():
    trials = [Trial(4, True), Trial(8, False), Trial(16, True)]
    assert bounds(trials) == (4, 8)
    assert next_rate(trials, SearchSpace(start=4, resolution=1, max_trials=10)) == 6


@pytest.mark.parametrize(("space", "flag"), [(SearchSpace(0, 1, 5), "--sweep-start"),
                                             (SearchSpace(1, -1, 5), "--sweep-resolution"),
                                             (SearchSpace(1, 1, 0), "--sweep-max-trials"),
                                             (SearchSpace(1, 1, 5, min_rate=2), "--sweep-min-rate")])
def test_a_bad_search_space_names_its_flag(space, flag):
    with pytest.raises(ValueError, match=flag):
        space.check()


def metrics(completed=10, failed=0, ttft=100.0, itl=10.0) -> dict:
    return {"completed": completed, "failed": failed, "p99_ttft_ms": ttft, "p99_itl_ms": itl}


def test_a_trial_passes_only_with_both_p99s_within_their_slo_and_no_failed_request():
    slo = Slo(ttft_ms=300, itl_ms=25)
    assert verdict(metrics(), slo) == []
    assert verdict(metrics(ttft=300.0, itl=25.0), slo) == []  # "<=": the SLO itself holds
    assert verdict(metrics(ttft=301.0), slo) == ["TTFT"]
    assert verdict(metrics(itl=25.1), slo) == ["ITL"]
    assert verdict(metrics(ttft=400.0, itl=30.0), slo) == ["TTFT", "ITL"]
    assert verdict(metrics(failed=1), slo) == ["1 failed"]  # a dropped request fails a trial, whatever the latencies
    assert verdict(metrics(completed=0, failed=5, ttft=0.0, itl=0.0), slo) == ["5 failed"]


def test_a_rate_floor_ends_the_halving_of_a_start_that_fails():
    # a trial lasts requests / rate: without the floor this search would go on to 2 and 1 req/s
    trials, found = search(lambda rate: False, SearchSpace(start=8, resolution=1, max_trials=20, min_rate=4))
    assert [t.rate for t in trials] == [8, 4]
    assert found == {"found_rate": None, "lowest_failing_rate": 4, "trials_run": 2, "stopped": "resolved"}
    # the floor is tried even where halving would step past it, and a pass there bisects as usual
    trials, found = search(lambda rate: rate <= 5.5, SearchSpace(start=16, resolution=1, max_trials=20, min_rate=5))
    assert [t.rate for t in trials] == [16, 8, 5, 6.5, 5.75]
    assert (found["found_rate"], found["lowest_failing_rate"]) == (5, 5.75)
