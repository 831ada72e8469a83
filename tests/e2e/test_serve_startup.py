"""``kvrelay serve`` that cannot start says why in one line and exits 2, within a bound, with nothing
restarted: a port another server holds (one that answers /ready 200, so a ready line read from it would
show), an external Redis nobody listens on, a --max-model-len longer than the model serves, a KV cache
too small for one sequence, a state folder others may enter, an append-only file Redis cannot read. Real processes, as a user starts them; the restart of a child that was ready is
tests/e2e/test_serve_restart.py."""

import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV
from tests.e2e.cluster import free_port
from tests.e2e.conftest import TINY_ENGINE

pytestmark = pytest.mark.slow
BOUND_S = 120  # generous for CI's two loaded cores: past it, serve hangs or loops


def _serve(*argv: str, state_dir: Path | None = None) -> tuple[int, list[str], float]:
    """serve's exit code, its output's lines (stdout and stderr together) and how long it ran.
    ``state_dir``: the test's own, where serve would start its embedded Redis."""
    started = time.monotonic()
    argv = (*argv, "--state-dir", str(state_dir)) if state_dir else argv
    done = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", *argv], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"), timeout=BOUND_S)
    return done.returncode, done.stdout.decode(errors="replace").splitlines(), time.monotonic() - started


def _one_line_failure(code: int, lines: list[str], pattern: str) -> None:
    text = "\n".join(lines)
    assert code == 2, text[-3000:]
    assert re.fullmatch(pattern, lines[-1]), text[-3000:]
    assert sum(line.startswith("kvrelay serve: error:") for line in lines) == 1, text[-3000:]
    assert "Traceback" not in text and "kvrelay ready" not in text, text[-3000:]
    assert "started again" not in text and "restarting it" not in text, text[-3000:]


class _AlwaysReady(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 (the stdlib's name)
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *_args):
        pass


def test_a_port_another_server_holds_is_one_line_and_never_ready(tiny_model_dir, tmp_path):
    other = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _AlwaysReady)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    port = other.server_address[1]
    try:
        code, lines, _ = _serve("--model", str(tiny_model_dir), *TINY_ENGINE, "--port", str(port),
                                state_dir=tmp_path / "state")
    finally:
        other.shutdown()
        other.server_close()
    _one_line_failure(code, lines, rf"kvrelay serve: error: --port {port}: cannot bind 127\.0\.0\.1:{port} "
                      r"\(Address already in use\); is another server running there\?")


def test_an_unreachable_redis_is_one_line_naming_it_without_its_password(tiny_model_dir):
    closed = free_port()
    url = f"redis://default:hunter2-not-shown@127.0.0.1:{closed}/0"
    code, lines, _ = _serve("--model", str(tiny_model_dir), *TINY_ENGINE, "--port", str(free_port()),
                            "--redis-url", url)
    _one_line_failure(code, lines, rf"kvrelay serve: error: --redis-url redis://default:\*\*\*@127\.0\.0\.1:"
                      rf"{closed}/0: Redis unreachable \(.*Connection refused.*\)")
    assert "hunter2" not in "\n".join(lines)


@pytest.mark.parametrize("flag, value, cause", [
    ("--max-model-len", "999999", r"max_model_len 999999 exceeds what .* serves exactly \(512 tokens.*\)"),
    ("--num-gpu-blocks-override", "2", r"KV cache too small: 2 blocks of 8 tokens .* max_model_len=256 .*"),
])
def test_a_setting_the_worker_refuses_stops_serve_with_the_workers_cause(tiny_model_dir, flag, value, cause,
                                                                         tmp_path):
    engine = [*TINY_ENGINE]
    engine[engine.index(flag) + 1] = value  # the tiny model's positions end at 512; 256 tokens need 32 blocks
    code, lines, _ = _serve("--model", str(tiny_model_dir), *engine, "--port", str(free_port()),
                            state_dir=tmp_path / "state")
    _one_line_failure(code, lines, rf"kvrelay serve: error: (prefill|decode)-worker\[tiny\]: {cause}")


def test_a_state_dir_others_may_enter_is_one_line_and_left_as_it_is(tmp_path):
    """It holds Redis's passwords and every tenant's data: serve neither uses nor "fixes" a shared one."""
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    os.chmod(state, 0o755)
    code, lines, _ = _serve("--model", "dummy:tiny-llama", "--port", str(free_port()), state_dir=state)
    _one_line_failure(code, lines, rf"kvrelay serve: error: --state-dir {re.escape(str(state))}: mode 0755 lets "
                      rf"other users in, .*; chmod 700 {re.escape(str(state))}")
    assert os.listdir(state) == [] and (state.stat().st_mode & 0o777) == 0o755


def test_an_append_only_file_redis_cannot_read_is_one_line_naming_the_folder(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "appendonly.aof").write_bytes(b"*3\r\n$3\r\nSET\r\n$1\r\na\r\nnot a length\r\n*1\r\n$4\r\nPING\r\n")
    code, lines, _ = _serve("--model", "dummy:tiny-llama", "--port", str(free_port()), state_dir=state)
    _one_line_failure(code, lines, r"kvrelay serve: error: redis: Bad file format reading the append only file.* "
                      rf"\(its files: {re.escape(str(state))}\)")


def test_a_role_run_alone_that_cannot_bind_says_so_in_one_line():
    """Outside serve there is no status pipe: the role prints the cause itself, for systemd's journal."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "kvrelay.cli", "gateway", "--port", str(port), "--insecure-zmq",
                               "--redis-url", f"redis://127.0.0.1:{free_port()}"], stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, timeout=BOUND_S,
                              env={k: v for k, v in os.environ.items() if k != ZMQ_SECRET_ENV})
    text = done.stdout.decode(errors="replace")
    assert done.returncode == 2, text
    assert re.fullmatch(rf"kvrelay gateway: error: .*Address already in use.*'127\.0\.0\.1', {port}.*",
                        text.splitlines()[-1]), text
    assert "Traceback" not in text, text
