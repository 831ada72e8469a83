"""The worker's request lifecycle against a real engine and real Redis: requests of a gateway whose
liveness key lapsed leave the engine with their KV freed, those of a gateway that beats stay, and a
gateway never seen beating gets GATEWAY_TTL_S from each request's arrival before its requests go."""

from types import SimpleNamespace

import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.sampling_params import SamplingParams
from kvrelay.shared.worker import gateway_watch, lifecycle
from kvrelay.shared.worker.lifecycle import InFlight, Lifecycle, engine_request
from kvrelay.shared.worker.runtime import WorkerRuntime

BEATING, SILENT = "tcp://127.0.0.1:11", "tcp://127.0.0.1:12"


@pytest.fixture()
def runtime(redis_url):
    from kvrelay.cli import build_parser
    from kvrelay.workers import worker_config

    args = build_parser().parse_args(["decode-worker", "--model", "dummy:tiny-llama", "--device", "cpu",
                                      "--redis-url", redis_url, "--num-gpu-blocks-override", "64"])
    config = worker_config("decode", args)
    config.freeze_gc = False  # a test process is not a worker's own
    rt = WorkerRuntime(config)
    yield rt
    rt.shutdown()


def admit(rt: WorkerRuntime, life: Lifecycle, rid: str, reply_addr: str, arrival: float) -> None:
    (slot,) = rt.slots.values()
    job = Job(request_id=rid, model=slot.instance, prompt_token_ids=[3, 4, 5, 6, 7, 8, 9, 10, 11],
              sampling=SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True), tenant="t",
              priority=0, reply_addr=reply_addr, deadline=0.0, arrival=arrival)
    slot.core.add_request(engine_request(slot, job))
    life.track(InFlight(request_id=rid, instance=slot.instance, reply_addr=reply_addr, deadline=0.0,
                        arrival=arrival, job=job))


@pytest.fixture()
def clock(monkeypatch) -> list[float]:
    """The lifecycle's and the gateway watch's clock, as the test moves it: however slow a loaded box runs a
    step, only the time the test adds passes for a request's grace and a key's confirmation."""
    now = [1_000_000.0]
    monkeypatch.setattr(lifecycle, "time", SimpleNamespace(time=lambda: now[0]))
    monkeypatch.setattr(gateway_watch, "time", SimpleNamespace(monotonic=lambda: now[0]))
    return now


def watch_round(rt: WorkerRuntime, clock: list[float]) -> None:
    """What the runtime's gateway-watch thread does each second, run here: a key missing now and CONFIRM_S
    later."""
    rt.gateways.check()
    clock[0] += gateway_watch.CONFIRM_S
    rt.gateways.check()


def test_a_dead_gateways_requests_leave_and_free_their_kv_after_their_grace(runtime, clock):
    rt = runtime
    core = rt.core
    r = rt.redis
    r.delete(keys.gateway_key(SILENT))
    r.set(keys.gateway_key(BEATING), "gw", ex=60)
    released: list[str] = []
    life = Lifecycle(rt, release=lambda rec: released.append(rec.request_id))
    free_before = core.num_free_blocks
    long_ago = clock[0] - 60
    admit(rt, life, "beating", BEATING, long_ago)
    admit(rt, life, "silent-old", SILENT, long_ago)
    admit(rt, life, "silent-new", SILENT, clock[0])
    core.step()  # prefilled: every request holds KV blocks
    assert core.num_running == 3

    watch_round(rt, clock)
    life.sweep()
    assert released == ["silent-old"]  # its gateway never beat and its grace is long over
    assert set(life.requests) == {"beating", "silent-new"}
    assert core.num_running == 2

    clock[0] = life.requests["silent-new"].arrival + keys.GATEWAY_TTL_S
    watch_round(rt, clock)
    life.sweep()
    assert released == ["silent-old", "silent-new"]
    assert set(life.requests) == {"beating"}
    life.abort("beating")
    assert core.num_free_blocks == free_before  # every aborted request's KV is back
    r.delete(keys.gateway_key(BEATING))
