"""``kvrelay serve`` brings its children back: real processes, ``kill -9`` while clients stream. The model
is the e2e tiny one (random weights, SmolLM2's tokenizer): each restart reloads it, and SmolLM2's 10-20 s
load per restart on CI's two cores would make this the slowest file of the suite for no extra coverage. After each kill no client hangs (each gets its answer or an error, within a bound), the
gateway answers 503 + Retry-After (OpenAI error JSON) while the model has no worker, serving resumes
once the child is restarted, and serve keeps running; a child crashing --max-crashes times within
--crash-window stops serve with exit 1 and one line naming it and its exit code."""

import os
import signal
import threading
import time

import openai
import psutil
import pytest

from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.served import Served

pytestmark = pytest.mark.slow
QUESTION = [{"role": "user", "content": "Tell me a long story about a dragon."}]
BOUND_S = 240  # generous: a client or a restart past this has hung
STARTED_CHUNKS = 5  # role, first token (the prefill worker's), then tokens from decode: the stream is decoding


def _pid(served: Served, command: str) -> int | None:
    """serve's live child running ``command`` (argv: python -m kvrelay.cli --log-level L COMMAND -)."""
    try:
        for proc in psutil.Process(served.proc.pid).children():
            if command in proc.cmdline() and proc.status() != psutil.STATUS_ZOMBIE:
                return proc.pid
    except psutil.Error:  # serve or that child just went
        pass
    return None


def _wait(condition, served: Served):
    deadline = time.monotonic() + BOUND_S
    while not (found := condition()):
        assert time.monotonic() < deadline, served.log.read_text()[-3000:]
        time.sleep(0.1)
    return found


def _stream(client: openai.OpenAI, model: str, started: threading.Semaphore, outcomes: list) -> None:
    chunks = 0
    try:
        stream = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=200, stream=True,
                                                extra_body={"ignore_eos": True})
        for _chunk in stream:
            chunks += 1
            if chunks == STARTED_CHUNKS:
                started.release()
        outcomes.append("answered")
    except openai.APIError as exc:
        outcomes.append(f"error: {exc}")
    finally:
        if chunks < STARTED_CHUNKS:
            started.release()


def _kill_under_load(served: Served, client: openai.OpenAI, model: str, command: str):
    """Kill ``command``'s process with -9 while three clients stream; returns a function that waits for
    the clients (within the bound: none may hang) and gives their outcomes."""
    outcomes: list[str] = []
    started = threading.Semaphore(0)
    threads = [threading.Thread(target=_stream, args=(client, model, started, outcomes)) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in threads:
        assert started.acquire(timeout=BOUND_S)
    noticed = served.log.read_text().count("exited with code -9")
    os.kill(_wait(lambda: _pid(served, command), served), signal.SIGKILL)
    # serve has unregistered it once it logs the exit; a request sent before that may be queued for its
    # successor instead of refused, which is right but is not what the caller checks next
    _wait(lambda: served.log.read_text().count("exited with code -9") > noticed, served)

    def answers() -> list[str]:
        for t in threads:
            t.join(BOUND_S)
            assert not t.is_alive(), f"a client hung:\n{served.log.read_text()[-3000:]}"
        assert len(outcomes) == 3, outcomes
        return outcomes

    return answers


def _until_503_then_served(served: Served, client: openai.OpenAI, model: str) -> None:
    """While the model has no worker: 503 + Retry-After, promptly; then, once it is back, an answer."""
    deadline = time.monotonic() + BOUND_S
    while True:
        assert time.monotonic() < deadline, served.log.read_text()[-3000:]
        try:
            client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, timeout=30)
        except openai.APITimeoutError:
            continue  # queued before the gateway's view of the workers (cached for 0.5 s) caught up
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
            assert int(exc.response.headers["Retry-After"]) > 0
            assert exc.body["type"] == "service_unavailable_error" and exc.body["message"], exc.body
            break
        time.sleep(0.2)  # answered: the registration's removal not seen yet
    while True:
        assert time.monotonic() < deadline, served.log.read_text()[-3000:]
        try:
            resp = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4, timeout=60)
            assert resp.choices[0].message.content
            break
        except openai.APIStatusError as exc:
            assert exc.status_code == 503, exc
            time.sleep(0.5)
    assert served.proc.poll() is None


def _serve(model_dir, *flags: str) -> list[str]:
    # a job idle 3 s belongs to a dead worker (default 15 s): the restarted one resumes it sooner
    return ["--model", str(model_dir), *TINY_ENGINE, "--reclaim-idle-ms", "3000", *flags]


def test_killed_workers_come_back_and_a_crash_loop_stops_serve(tiny_model_dir, tmp_path):
    with Served(_serve(tiny_model_dir, "--max-crashes", "3", "--crash-window", "600"), tmp_path / "serve.log",
                timeout=300) as served:
        client = served.client()
        model = client.models.list().data[0].id
        # streams being decoded end with an error when their decode worker dies...
        answers = _kill_under_load(served, client, model, "decode-worker")
        _until_503_then_served(served, client, model)
        assert all(o.startswith("error") for o in answers()), answers()
        # ...and are not touched when the prefill worker that handed them over dies
        answers = _kill_under_load(served, client, model, "prefill-worker")
        _until_503_then_served(served, client, model)
        assert answers() == ["answered"] * 3, answers()
        log = served.log.read_text()
        for command in ("decode-worker", "prefill-worker"):
            assert f"{command}[{model}] exited with code -9; restarting it in 1s" in log, log[-3000:]
        # the decode worker's 2nd and 3rd crash within the window: serve gives up
        for _ in range(2):
            first = _wait(lambda: _pid(served, "decode-worker"), served)
            os.kill(first, signal.SIGKILL)
            _wait(lambda first=first: served.proc.poll() is not None or
                  _pid(served, "decode-worker") not in (None, first), served)
        assert served.proc.wait(BOUND_S) == 1
        log = served.log.read_text()
    reason = f"decode-worker[{model}] exited with code -9, 3 times within 600s (--max-crashes 3); stopping everything"
    assert reason in log, log[-3000:]


def test_the_unified_worker_and_the_gateway_come_back(tiny_model_dir, tmp_path):
    with Served(_serve(tiny_model_dir, "--mode", "unified"), tmp_path / "serve.log", timeout=300) as served:
        client = served.client()
        model = client.models.list().data[0].id
        answers = _kill_under_load(served, client, model, "unified-worker")
        _until_503_then_served(served, client, model)
        # the streams' jobs were never ACKed: the restarted worker reclaims them and the gateway takes
        # from it the tokens its clients do not have yet
        assert answers() == ["answered"] * 3, answers()
        os.kill(_wait(lambda: _pid(served, "gateway"), served), signal.SIGKILL)
        deadline = time.monotonic() + BOUND_S
        while True:  # refused while the gateway restarts, then served again
            assert time.monotonic() < deadline, served.log.read_text()[-3000:]
            try:
                assert client.chat.completions.create(model=model, messages=QUESTION, max_tokens=4).choices
                break
            except openai.APIConnectionError:
                time.sleep(0.3)
        assert served.proc.poll() is None
        assert "gateway exited with code -9; restarting it in 1s" in served.log.read_text()
