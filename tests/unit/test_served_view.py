"""The gateway's served view (gateway/control/served.py), over real worker records judged by real Stalls: a
model /ready counts as served (``Served.ready``) is one /v1/models lists (``Served.listed``) in the same reading,
in every state its workers can be in (none, stepping, stalled, per phase) and whether it is registered (pinned,
or loaded on demand) or published directly by the workers kvrelay serve started."""

import itertools
import time

import pytest

from kvrelay.gateway.control.served import Served
from kvrelay.gateway.control.stalled_workers import Stalls
from kvrelay.shared.wire.protocol import ModelInfo, ModelSpec, WorkerInfo

TIMEOUT_S = 60.0
NAME = "m"


def _worker(role: str, state: str, instance: str) -> list[WorkerInfo]:
    if state == "none":
        return []
    now = time.time()
    return [WorkerInfo(worker_id=f"{role}-{state}", role=role, models=[instance], zmq_addr="tcp://127.0.0.1:1",
                       free_blocks=8, total_blocks=8, running=0, waiting=0, pid=1, host="h", started=now,
                       heartbeat=now, step_age_s=2 * TIMEOUT_S if state == "stalled" else 0.0)]


def _view(how: str, prefill: str, decode: str, startup: bool) -> Served:
    spec = {"direct": None, "pinned": ModelSpec(name=NAME, version=1, pinned=True),
            "on demand": ModelSpec(name=NAME, version=1)}[how]
    instance = spec.instance if spec else NAME
    model = ModelInfo(name=instance, path="/m", max_model_len=64, vocab_size=100, eos_token_ids=[0], block_size=16,
                      dtype="float32", served_name=NAME, version=spec.version if spec else 0)
    workers = _worker("prefill", prefill, instance) + _worker("decode", decode, instance)
    stalls = Stalls(TIMEOUT_S)
    stalls.update(workers)
    specs = {NAME: spec} if spec else {}
    return Served(specs, {instance: model}, {} if spec else {NAME: model}, workers, stalls.routable(workers),
                  {NAME} if startup else set())


STATES = ("none", "stepping", "stalled")


@pytest.mark.parametrize("how", ["direct", "pinned", "on demand"])
def test_a_model_ready_counts_as_served_is_listed_from_the_same_reading(how):
    for prefill, decode, startup in itertools.product(STATES, STATES, (True, False)):
        view = _view(how, prefill, decode, startup)
        for name in view.required():
            assert not view.ready(name) or name in view.listed(), (how, prefill, decode, startup)
        # and ready means served now: routable workers of both phases
        assert view.ready(NAME) == (prefill == decode == "stepping"), (how, prefill, decode, startup)


def test_a_phase_only_stalled_workers_hold_is_neither_ready_nor_listed():
    for how in ("direct", "pinned", "on demand"):
        view = _view(how, "stepping", "stalled", startup=True)
        assert not view.ready(NAME) and view.listed() == [], how
        assert NAME in view.required()
