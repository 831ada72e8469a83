"""The GIL switch interval is short while a model loads on its side thread, and restored after."""

import sys
import threading

import pytest

from kvrelay.shared.worker import gil_switch, model_loads
from kvrelay.shared.worker.gil_switch import LOAD_SWITCH_INTERVAL_S, short_switches
from tests.unit.test_model_host import load, make_host, repo, run  # noqa: F401  (repo: the shared fixture)

SHORT = pytest.approx(LOAD_SWITCH_INTERVAL_S, abs=2e-6)  # CPython keeps the interval in whole microseconds


def test_nested_and_concurrent_holders_restore_the_interval_once_the_last_leaves():
    before = sys.getswitchinterval()
    inside, release = threading.Event(), threading.Event()

    def other():
        with short_switches():
            inside.set()
            release.wait(10)

    with short_switches():
        assert sys.getswitchinterval() == SHORT
        t = threading.Thread(target=other)
        t.start()
        inside.wait(10)
    assert sys.getswitchinterval() == SHORT  # the other thread's load still runs
    release.set()
    t.join()
    assert sys.getswitchinterval() == before


def test_never_lengthens_an_interval_already_shorter():
    before = sys.getswitchinterval()
    sys.setswitchinterval(LOAD_SWITCH_INTERVAL_S / 2)
    try:
        with short_switches():
            assert sys.getswitchinterval() == pytest.approx(LOAD_SWITCH_INTERVAL_S / 2, abs=2e-6)
    finally:
        sys.setswitchinterval(before)


def test_a_load_builds_under_the_short_interval_and_gives_it_back(repo, monkeypatch):  # noqa: F811
    seen = []
    build = model_loads.ModelLoads._build

    def recording_build(self, plan):
        seen.append(sys.getswitchinterval())
        return build(self, plan)

    monkeypatch.setattr(model_loads.ModelLoads, "_build", recording_build)
    before = sys.getswitchinterval()
    host, results = make_host(repo)
    run(host, load("a"))
    assert results[-1].ok and seen == [SHORT]
    assert sys.getswitchinterval() == before and gil_switch._active == 0
