"""Two gateway processes sharing one deployment (``--api-server-count``: the kernel hands each connection to
either), each caching its own reading of Redis for --registry-cache-s: once one says /ready 200, the other lists
the model kvrelay serve started in /v1/models, though its cached reading predates the worker. Real Redis, the
real gateway app twice on real ports, real HTTP; the worker is gateway_harness.py's fake one."""

import pytest
import requests

from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.integration.gateway_harness import (
    MODEL,
    FakeWorker,
    GatewayServer,
    build_tokenizer,
    gateway_config,
    ready_after_tokenizers,
)

pytestmark = pytest.mark.timeout(120)


def _listed(url: str) -> list[str]:
    r = requests.get(f"{url}/v1/models", timeout=30)
    assert r.status_code == 200, r.text
    return [m["id"] for m in r.json()["data"]]


def test_a_model_one_gateway_says_ready_for_is_listed_by_another_whose_cached_reading_is_older(tmp_path):
    tokenizer_dir = build_tokenizer(tmp_path / "tokenizer")
    with EmbeddedRedis() as url:
        # a cache far longer than the test: which reading each gateway answers from is the test's to say
        config = {"registry_cache_s": 600.0, "startup_models": [MODEL]}
        first = GatewayServer(gateway_config(url, **config)).start()
        worker = None
        second = None
        try:
            assert _listed(first.url) == []  # read and cached before any worker registered
            worker = FakeWorker(url, tokenizer_dir).start()
            second = GatewayServer(gateway_config(url, **config)).start()
            assert ready_after_tokenizers(second.url).status_code == 200
            assert _listed(first.url) == [MODEL]
        finally:
            for server in (second, first):
                if server is not None:
                    server.stop()
            if worker is not None:
                worker.stop()
