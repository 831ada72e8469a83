"""Slow and idle clients against a real `kvrelay gateway` process over real sockets: partial headers are
cut after --timeout-header-read, idle connections past --limit-idle-connections are closed (longest idle
first), and neither touches a normal request nor a slow but steady stream (gateway/connection_guard.py); a
body that does not arrive within --timeout-body-read gets 408 and its connection closed (gateway/bodies.py).

Every bound below is a "does not hang" bound, never a timing assertion."""

import http.client
import json
import select
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import requests

from tests.integration.gateway_harness import MODEL, FakeWorker, build_tokenizer, free_port

pytestmark = pytest.mark.timeout(180)

PARTIAL = b"GET /health HTTP/1.1\r\nHost: gateway\r\nX-Slow: "  # and then nothing
HEADER_TIMEOUT_S = 1.0
PATIENT_HEADER_TIMEOUT_S = 300.0
IDLE_LIMIT = 10
BODY_TIMEOUT_S = 2.0
SLACK_S = 15.0  # a loaded CI machine: generous, it only proves the socket is not held forever


def start_gateway(redis_url: str, *flags: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "gateway", "--redis-url", redis_url, "--port",
                             str(port), "--registry-cache-s", "0", *flags])
    deadline = time.monotonic() + 60
    while True:
        assert proc.poll() is None, "the gateway exited"
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except requests.ConnectionError:
            pass
        assert time.monotonic() < deadline, "the gateway never answered /health"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def gateway(redis_url) -> Iterator[int]:
    proc, port = start_gateway(redis_url, "--timeout-header-read", str(HEADER_TIMEOUT_S),
                               "--timeout-body-read", str(BODY_TIMEOUT_S))
    yield port
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def patient_gateway(redis_url) -> Iterator[int]:
    """A header timeout that the clients here stay far inside however loaded the box (a trickle of a fraction
    of a second, idle connections opened one by one), and at most IDLE_LIMIT idle connections."""
    proc, port = start_gateway(redis_url, "--timeout-header-read", str(PATIENT_HEADER_TIMEOUT_S),
                               "--limit-idle-connections", str(IDLE_LIMIT))
    yield port
    proc.terminate()
    proc.wait(30)


def connect(port: int) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=SLACK_S)


def closed_by_server(sock: socket.socket) -> bool:
    """Blocks until the server closes the connection (True) or SLACK_S passes with it open (False)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def closed_count(port: int, reason: str) -> float:
    text = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    line = next((ln for ln in text.splitlines()
                 if ln.startswith(f'kvrelay_connections_closed_total{{reason="{reason}"}}')), None)
    return float(line.split()[-1]) if line else 0.0


def test_partial_headers_are_cut_and_a_normal_request_meanwhile_succeeds(gateway):
    before = closed_count(gateway, "header_timeout")
    slow = [connect(gateway) for _ in range(50)]
    for sock in slow:
        sock.sendall(PARTIAL)
    r = requests.get(f"http://127.0.0.1:{gateway}/v1/models", timeout=10)
    assert r.status_code == 200
    assert all(closed_by_server(sock) for sock in slow)
    assert closed_count(gateway, "header_timeout") - before >= 50
    for sock in slow:
        sock.close()


def test_idle_connections_past_the_limit_are_closed_longest_idle_first(patient_gateway):
    socks = []
    for _ in range(3 * IDLE_LIMIT):  # one by one, so "longest idle" is the order they were opened in
        socks.append(connect(patient_gateway))
        socks[-1].sendall(PARTIAL[:10])
    assert all(closed_by_server(sock) for sock in socks[:-IDLE_LIMIT])
    for sock in socks[-IDLE_LIMIT:]:  # the newest are still open and still serve their request
        sock.sendall(PARTIAL[10:].removesuffix(b"X-Slow: ") + b"\r\n")
        reply = sock.recv(65536)
        assert reply.startswith(b"HTTP/1.1 200"), reply[:100]
    assert closed_count(patient_gateway, "idle_limit") >= 2 * IDLE_LIMIT
    for sock in socks:
        sock.close()


def test_headers_trickled_in_are_read(patient_gateway):
    """A client sending its headers a few bytes at a time, within the header timeout, is served."""
    sock = connect(patient_gateway)
    head = b"GET /v1/models HTTP/1.1\r\nHost: gateway\r\nAccept: application/json\r\nX-Slow: steady\r\n\r\n"
    for i in range(0, len(head), 8):
        sock.sendall(head[i:i + 8])
        time.sleep(0.01)
    assert sock.recv(65536).startswith(b"HTTP/1.1 200")
    sock.close()


def header_timeout_passes(port: int) -> None:
    """Returns once a header timeout has passed since the call: a connection opened now with partial
    headers has been cut. Any connection whose header timer started earlier would have been cut before it."""
    canary = connect(port)
    canary.sendall(PARTIAL)
    assert closed_by_server(canary), "a connection with partial headers was not cut"
    canary.close()


def test_a_request_under_way_and_its_kept_alive_connection_outlast_header_timeouts(gateway, redis_url, tmp_path):
    """Once a request's headers are in, its connection is off the header clock: neither its streamed
    response nor the idle keep-alive after it is cut while header timeouts pass, and a second request on
    that connection is served."""
    worker = FakeWorker(redis_url, build_tokenizer(tmp_path / "tok")).start()
    try:
        sock = connect(gateway)
        body = json.dumps({"model": MODEL, "prompt": "[slow] hi", "max_tokens": 64, "stream": True}).encode()
        sock.sendall(body_head(len(body)) + body)
        received = b""
        while b"data: " not in received:  # the response has begun: the request is under way
            received += receive(sock, received)
        header_timeout_passes(gateway)
        # [slow]: a token every 10 fake steps; read to the chunked body's last chunk
        while not (b"data: [DONE]" in received and received.endswith(b"0\r\n\r\n")):
            received += receive(sock, received)
        assert received.startswith(b"HTTP/1.1 200") and b"finish_reason" in received
        for _ in range(2):  # the first may start before the gateway has marked the response sent; the second not
            header_timeout_passes(gateway)
        conn = http.client.HTTPConnection("127.0.0.1", gateway, timeout=SLACK_S)
        conn.sock = sock  # the same connection, kept alive: its header timer restarts with the request
        conn.request("GET", "/v1/models")
        assert conn.getresponse().status == 200
        sock.close()
    finally:
        worker.stop()


def receive(sock: socket.socket, so_far: bytes) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, f"the gateway cut a request under way: {so_far[:600]!r}"
    return chunk


def body_head(length: int) -> bytes:
    return (f"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
            f"Content-Length: {length}\r\n\r\n").encode()


def read_until_closed(sock: socket.socket) -> bytes:
    received = b""
    while chunk := sock.recv(65536):  # SLACK_S without a byte: TimeoutError, the connection was held
        received += chunk
    return received


def assert_408_then_closed(reply: bytes) -> None:
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), reply[:300]
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == "body_read_timeout" and error["type"] == "timeout_error", error


def test_a_trickled_body_gets_408_and_its_connection_closed(gateway):
    """One byte every half second: a body of 200 bytes would take 100 s; it is cut at the body timeout."""
    sock = connect(gateway)
    sock.sendall(body_head(200))
    deadline = time.monotonic() + SLACK_S + BODY_TIMEOUT_S
    while not select.select([sock], [], [], 0.5)[0]:  # until the gateway answers
        assert time.monotonic() < deadline, "the gateway still reads a body trickled far past its timeout"
        sock.sendall(b" ")
    assert_408_then_closed(read_until_closed(sock))
    sock.close()
    r = requests.post(f"http://127.0.0.1:{gateway}/v1/completions", timeout=10, json={"prompt": 5})
    assert r.status_code == 400  # the gateway reads bodies as before: this one is read and refused


def test_a_declared_body_never_sent_gets_408_and_its_connection_closed(gateway):
    socks = [connect(gateway) for _ in range(20)]
    for sock in socks:
        sock.sendall(body_head(100) + b'{"model": ')
    for sock in socks:
        assert_408_then_closed(read_until_closed(sock))
        sock.close()
