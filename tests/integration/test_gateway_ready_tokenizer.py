"""``/ready`` says 200 only once the tokenizers of every model with live workers are loaded, so the first
request after it does not pay the load (seconds for a large vocabulary: on the H200 the first requests
after ready took ~1.9 s against a 37 ms median before this). A tokenizer that fails to load does not hold
readiness back, nor make it flap: its requests get the load's error. A gateway whose /ready nobody asks (one of
several sharing a port) loads them all the same. Real Redis, real gateway, fake worker."""

import threading
import time

import openai
import pytest
import requests

from kvrelay.gateway.api.tokenizer_pool import TOKENIZERS, TokenizerPool
from tests.integration.gateway_harness import MODEL, running_stack

pytestmark = pytest.mark.timeout(120)


def _ready(url: str) -> requests.Response:
    return requests.get(f"{url}/ready", timeout=10)


def _wait_ready(url: str, timeout: float = 20.0) -> requests.Response:
    deadline = time.monotonic() + timeout
    while (r := _ready(url)).status_code != 200:
        assert time.monotonic() < deadline, r.json()
        time.sleep(0.05)
    return r


def test_ready_waits_for_the_tokenizer_and_the_first_request_uses_it(tmp_path, monkeypatch):
    release, loads = threading.Event(), []
    real_load = TokenizerPool._load

    def held_load(self, path):
        loads.append(path)
        assert release.wait(30)
        return real_load(self, path)

    monkeypatch.setattr(TokenizerPool, "_load", held_load)
    with running_stack(tmp_path) as stack:
        deadline = time.monotonic() + 20
        while not loads:  # the first /ready with a live worker starts the load
            r = _ready(stack.url)
            assert r.status_code == 503 and time.monotonic() < deadline, r.json()
            time.sleep(0.05)
        r = _ready(stack.url)
        assert r.status_code == 503 and r.json()["tokenizers_loading"] == [MODEL]
        release.set()
        _wait_ready(stack.url)
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
        assert client.completions.create(model=MODEL, prompt="hello there", max_tokens=4).choices
        assert len(loads) == 1, "the request loaded the tokenizer again"
        assert len(stack.server.app[TOKENIZERS]._loaded) == 1


def test_a_tokenizer_that_cannot_load_neither_blocks_nor_flaps_readiness(tmp_path, monkeypatch):
    loads = []

    def broken_load(self, path):
        loads.append(path)
        raise OSError("no tokenizer.json here")

    monkeypatch.setattr(TokenizerPool, "_load", broken_load)
    with running_stack(tmp_path) as stack:
        _wait_ready(stack.url)
        assert all(_ready(stack.url).status_code == 200 for _ in range(5))
        assert len(loads) == 1, "readiness retried a failed load"
        client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=MODEL, prompt="hello", max_tokens=4)
        assert "cannot load the tokenizer" in err.value.message


def test_a_gateway_nobody_asks_loads_the_tokenizers_of_live_models_itself(tmp_path):
    with running_stack(tmp_path) as stack:
        pool = stack.server.app[TOKENIZERS]
        deadline = time.monotonic() + 20
        while not pool._loaded:  # no /ready, no request: only the gateway's own warm-up loads it
            assert time.monotonic() < deadline, "the tokenizer never loaded"
            time.sleep(0.05)
        assert [name for name, _ in pool._loaded] == [MODEL]
