"""``kvrelay serve`` prints its ready line only once every gateway process sharing the port (--api-server-count)
has answered /ready with 200 itself: each gateway loads its own tokenizers when its /ready is asked, so one
never asked would make the first requests it takes wait for the load. A real HTTP server stands in for the
gateways, answering as the process ids it is given in turn; the supervisor is a stand-in holding their pids."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from kvrelay import serve


class Gateways:
    """/ready answered 200 by each pid of ``answers`` in turn (the last one from then on; None: a body without
    one), counting the polls."""

    def __init__(self, answers: list[int]):
        self.answers, self.polls = answers, 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):  # noqa: N802  # http.server's name
                pid = owner.answers[min(owner.polls, len(owner.answers) - 1)]
                owner.polls += 1
                body = json.dumps({"status": "ready"} | ({} if pid is None else {"gateway_pid": pid})).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"


def supervisor(pids: dict[str, int]):
    return SimpleNamespace(check=lambda: None, ready=lambda name: True,
                           procs={name: SimpleNamespace(pid=pid) for name, pid in pids.items()})


@pytest.mark.parametrize("answers, announced_at", [([11, 11, 12, 11, 13], 5), ([11, 12, 13], 3), ([11, 11, 12], None)])
def test_the_ready_line_waits_for_every_gateway(answers, announced_at, capsys, monkeypatch):
    monkeypatch.setattr(serve, "READY_POLL_S", 0.005)
    gateways = Gateways(answers)
    printed_at = []

    def stopping():
        if "kvrelay ready" in capsys.readouterr().out:
            printed_at.append(gateways.polls)
        return gateways.polls >= 8 or bool(printed_at)

    try:
        names = {"gateway-0": 11, "gateway-1": 12, "gateway-2": 13}
        assert serve._supervise(supervisor(names), stopping, gateways.url, ["m"], list(names)) == 0
    finally:
        gateways.server.shutdown()
    assert printed_at == ([] if announced_at is None else [announced_at])


def test_ready_names_the_gateway_that_answered_and_nothing_for_another_server():
    gateways = Gateways([11, None])
    try:
        assert serve._ready(gateways.url) == 11
        assert serve._ready(gateways.url) is None  # a 200 without our body: another server on the port
    finally:
        gateways.server.shutdown()
    assert serve._ready("http://127.0.0.1:9") is None  # nothing listens there
