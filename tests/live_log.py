"""A test run's results written as they happen, for a run that may be cut off: a GPU device call ends at its
time limit and takes pytest's summary (the slowest tests, the failures' messages) with it.

With ``KVRELAY_TEST_LIVE_LOG=FILE`` each test's phases append one line (outcome, seconds, node id) and each
failure its message, on the process that reports them (the xdist controller, or pytest alone), so what ran before
the cut is on disk. Off when the variable is unset. Whether this process is an xdist worker is read from its
config, not from $PYTEST_XDIST_WORKER, which a pytest started by a test of an xdist run inherits."""

import os

_worker = False


def pytest_configure(config) -> None:
    global _worker
    _worker = hasattr(config, "workerinput")


def pytest_runtest_logreport(report) -> None:
    path = os.environ.get("KVRELAY_TEST_LIVE_LOG")
    if not path or _worker:  # the controller writes what its workers report
        return
    if report.when != "call" and report.passed and report.duration < 1.0:  # a slow fixture is worth its line
        return
    lines = f"{report.outcome:8} {report.duration:8.2f} s  {report.when:8} {report.nodeid}\n"
    if report.failed:
        lines += "".join(f"    {line}\n" for line in report.longreprtext.splitlines()[-60:])
    with open(path, "a", encoding="utf-8") as out:
        out.write(lines)
