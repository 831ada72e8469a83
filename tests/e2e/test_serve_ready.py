"""``/ready`` is honest: a client that waits for it, as a readiness probe or a script written for vLLM
does, gets its first request served, for a ``kvrelay serve --model`` and for a two-model ``--config``
(the gateway knows the models before any worker registers); ``/v1/models`` then lists exactly them,
and serve's "kvrelay ready" line comes once the gateway is ready, not before; a state folder that served
another model before is ready for the new one."""

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import openai
import pytest

from kvrelay.shared.config.handover import module_argv
from kvrelay.shared.wire import redis_keys as keys
from tests.e2e.cluster import free_port

pytestmark = pytest.mark.slow
TINY = ["--max-model-len", "256", "--kv-cache-memory", str(16 << 20)]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:  # not listening yet
        return 0


def _first_ready(base: str, proc: subprocess.Popen, log) -> list[int]:
    """Polls /ready until its first 200; returns every status seen before it."""
    seen = []
    deadline = time.monotonic() + 180
    while (status := _status(f"{base}/ready")) != 200:
        seen.append(status)
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.01)
    return seen


@pytest.mark.parametrize("models", [["tiny"], ["first", "second"]], ids=["one-model", "two-model-config"])
def test_a_request_sent_when_ready_first_says_200_is_served(tmp_path, models):
    if len(models) == 1:
        how = ["--model", "dummy:tiny-llama", "--served-model-name", models[0]]
    else:
        config = tmp_path / "serve.yaml"
        config.write_text(json.dumps({"models": [{"name": m, "path": "dummy:tiny-llama"} for m in models]}))
        how = ["--config", str(config)]
    port, log = free_port(), tmp_path / "serve.log"
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, "-m", "kvrelay.cli", "serve", "--port", str(port), *how, *TINY,
                             "--state-dir", str(tmp_path / "state")],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        before = _first_ready(base, proc, log)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        for model in models:  # at once: no sleep, no retry
            resp = client.completions.create(model=model, prompt="The capital of France is", max_tokens=4,
                                             temperature=0)
            assert resp.usage.completion_tokens == 4
        assert sorted(m.id for m in client.models.list().data) == sorted(models)
        # before its first 200 the gateway was either not listening or said 503 (workers not up yet): never
        # another error; which of the two a loaded machine shows depends on which process starts first
        assert set(before) <= {0, 503}, before
        deadline = time.monotonic() + 10
        while b"kvrelay ready" not in log.read_bytes():
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _serve(tmp_path, name: str, state) -> tuple[subprocess.Popen, str, object]:
    port, log = free_port(), tmp_path / f"{name}.log"
    proc = subprocess.Popen([*module_argv("kvrelay.cli"), "serve", "--port", str(port), "--model",
                             "dummy:tiny-llama", "--served-model-name", name, *TINY, "--state-dir", str(state)],
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1"))
    return proc, f"http://127.0.0.1:{port}", log


def test_a_state_folder_that_served_another_model_is_ready_for_the_new_one(tmp_path):
    # The embedded Redis keeps its data in the state folder, so the first run's model record is still
    # there when the second starts; it must neither hold /ready back nor stay listed.
    state = tmp_path / "state"
    proc, base, log = _serve(tmp_path, "old", state)
    try:
        _first_ready(base, proc, log)
    finally:
        proc.kill()  # -9: nothing is cleaned up; the children follow (parent-death signal)
        proc.wait(60)
    proc, base, log = _serve(tmp_path, "new", state)
    try:
        _first_ready(base, proc, log)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=60)
        # the old workers' registrations (persisted with the rest) look alive until their heartbeat TTL lapses
        deadline = time.monotonic() + keys.HEARTBEAT_TTL_S + 20
        while (listed := [m.id for m in client.models.list().data]) != ["new"]:
            assert time.monotonic() < deadline, listed
            time.sleep(0.2)
        # ignore_eos: the dummy weights sample at temperature 1 and may draw EOS first
        got = client.completions.create(model="new", prompt="Hi", max_tokens=2, extra_body={"ignore_eos": True})
        assert got.usage.completion_tokens == 2
        with pytest.raises(openai.APIStatusError) as err:  # known until its record expires: 503, not served
            client.completions.create(model="old", prompt="Hi", max_tokens=2)
        assert err.value.status_code == 503
        ttl = _model_record_ttl(state, "new")
        assert 0 < ttl <= keys.MODEL_TTL_S
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def _model_record_ttl(state, name: str) -> int:
    from kvrelay.shared.wire.redis_conn import PASSWORDS_NAME, SOCKET_NAME, sync_client

    password = json.loads((state / PASSWORDS_NAME).read_text())["default"]
    r = sync_client(f"unix://default:{password}@{state}/{SOCKET_NAME}")
    try:
        return r.ttl(keys.model_key(name))
    finally:
        r.close()
