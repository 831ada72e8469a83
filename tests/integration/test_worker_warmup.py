"""A worker warms its model up before it registers anything (real Redis, the worker runtime as the CLI
builds it): at the moment warm-up reports done, Redis holds neither the model's record nor the worker's,
which is what the gateway's /ready reads. ``--skip-warmup`` skips it."""

import logging
import uuid

import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.worker.runtime import WorkerRuntime


def _runtime(redis_url: str, name: str, *extra: str) -> WorkerRuntime:
    from kvrelay.cli import build_parser
    from kvrelay.workers import worker_config

    args = build_parser().parse_args(["unified-worker", "--model", "dummy:tiny-llama", "--device", "cpu",
                                      "--served-model-name", name, "--worker-id", name, "--redis-url", redis_url,
                                      "--num-gpu-blocks-override", "64", *extra])
    config = worker_config("unified", args)
    config.freeze_gc = False  # a test process is not a worker's own
    return WorkerRuntime(config)


class _SeenAtWarmupDone(logging.Handler):
    """When warm-up logs that it is done, looks at Redis right then."""

    def __init__(self, redis, name: str):
        super().__init__(logging.INFO)
        self.redis, self.name = redis, name
        self.seen: list[tuple[bool, bool]] = []  # (model record exists, worker record exists)

    def emit(self, record: logging.LogRecord) -> None:
        if record.getMessage().startswith("warm-up done"):
            self.seen.append((bool(self.redis.exists(keys.model_key(self.name))),
                              bool(self.redis.exists(keys.worker_key(self.name)))))


@pytest.fixture()
def watch(redis_url):
    from kvrelay.shared.wire.redis_conn import sync_client

    name = f"warm-{uuid.uuid4().hex[:8]}"
    handler = _SeenAtWarmupDone(sync_client(redis_url), name)
    logger = logging.getLogger("kvrelay.shared.engine.warmup")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    yield name, handler
    logger.removeHandler(handler)
    logger.setLevel(level)


def test_warmup_runs_before_the_worker_registers_and_leaves_no_kv(redis_url, watch):
    name, handler = watch
    rt = _runtime(redis_url, name)
    try:
        assert handler.seen == [(False, False)]
        bm = rt.core.block_manager
        assert bm.num_used == 0 and not bm.cached and bm.prefix_queries == 0
    finally:
        rt.shutdown()


def test_skip_warmup_skips_it(redis_url, watch):
    name, handler = watch
    rt = _runtime(redis_url, name, "--skip-warmup")
    rt.shutdown()
    assert handler.seen == []


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_the_model_record_names_the_scheduling_policy(redis_url, policy):
    """What the gateway reads to refuse a request's ``priority`` where the workers would ignore it."""
    from kvrelay.shared.wire.codec import decode
    from kvrelay.shared.wire.protocol import ModelInfo
    from kvrelay.shared.wire.redis_conn import sync_client

    name = f"policy-{uuid.uuid4().hex[:8]}"
    rt = _runtime(redis_url, name, "--skip-warmup", "--scheduling-policy", policy)
    r = sync_client(redis_url)
    try:
        (slot,) = rt.slots.values()
        rt.registration.publish_model(slot)
        assert decode(r.get(keys.model_key(slot.instance)), ModelInfo).scheduling_policy == policy
    finally:
        rt.shutdown()
        r.close()
