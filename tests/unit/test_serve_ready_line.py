"""``kvrelay serve`` prints its ready line only once every gateway process sharing the port (--api-server-count)
has answered /ready with 200 itself: each gateway loads its own tokenizers when its /ready is asked, so one
never asked would make the first requests it takes wait for the load. A real HTTP server stands in for the
gateways, answering as the process ids it is given in turn; the supervisor is a stand-in holding their pids."""

from types import SimpleNamespace

import pytest

from kvrelay import serve
from tests.scripted_http import ScriptedJSON


def gateways(answers: list[int | None]) -> ScriptedJSON:
    """/ready answered 200 by each pid of ``answers`` in turn (the last one from then on; None: a body without
    one), counting the polls."""
    return ScriptedJSON([{"status": "ready"} | ({} if pid is None else {"gateway_pid": pid}) for pid in answers])


def supervisor(pids: dict[str, int]):
    return SimpleNamespace(check=lambda: None, ready=lambda name: True,
                           procs={name: SimpleNamespace(pid=pid) for name, pid in pids.items()})


@pytest.mark.parametrize("answers, announced_at", [([11, 11, 12, 11, 13], 5), ([11, 12, 13], 3), ([11, 11, 12], None)])
def test_the_ready_line_waits_for_every_gateway(answers, announced_at, capsys, monkeypatch):
    monkeypatch.setattr(serve, "READY_POLL_S", 0.005)
    polled = gateways(answers)
    printed_at = []

    def stopping():
        if "kvrelay ready" in capsys.readouterr().out:
            printed_at.append(polled.polls)
        return polled.polls >= 8 or bool(printed_at)

    try:
        names = {"gateway-0": 11, "gateway-1": 12, "gateway-2": 13}
        assert serve._supervise(supervisor(names), stopping, polled.url, ["m"], list(names)) == 0
    finally:
        polled.close()
    assert printed_at == ([] if announced_at is None else [announced_at])


def test_ready_names_the_gateway_that_answered_and_nothing_for_another_server():
    polled = gateways([11, None])
    try:
        assert serve._ready(polled.url) == 11
        assert serve._ready(polled.url) is None  # a 200 without our body: another server on the port
    finally:
        polled.close()
    assert serve._ready("http://127.0.0.1:9") is None  # nothing listens there
