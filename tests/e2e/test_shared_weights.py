"""Shared weights across worker processes on one device (issue #26), with real worker processes, Redis,
the gateway and the openai SDK: the second worker maps the first one's weights instead of loading a copy;
the device counts the model once; answers equal the offline engine's (an unshared load); the model
survives an unload and reload, an eviction by the weights budget while shared, and the exporter's
``kill -9`` (whose unshared model is freed by liveness); the last user frees it."""

import time
import uuid

import openai
import pytest

from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode, encode
from kvrelay.shared.wire.protocol import ControlCommand, ControlResult
from kvrelay.shared.worker.weight_registry import WeightRegistry
from tests.e2e.cluster import Cluster
from tests.e2e.model_variants import PROMPT, offline_text, variant

pytestmark = pytest.mark.slow

ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--kv-cache-memory", str(16 << 20),
          "--served-model-name", "tiny", "--skip-warmup"]


def until(predicate, what: str, bound_s: float = 60.0):
    """A bound on waiting for something asynchronous, not a timing assertion."""
    end = time.monotonic() + bound_s
    while not (got := predicate()):
        assert time.monotonic() < end, f"never happened: {what}"
        time.sleep(0.1)
    return got


def command(cluster: Cluster, worker_id: str, **fields) -> ControlResult:
    """A ControlCommand through the worker's real control channel, and its answer."""
    cmd = ControlCommand(command_id=uuid.uuid4().hex, **{"name": "tiny", **fields})
    cluster.redis.lpush(keys.control_key(worker_id), encode(cmd))
    raw = until(lambda: cluster.redis.get(keys.control_result_key(cmd.command_id)), f"{worker_id} answers {cmd.op}")
    return decode(raw, ControlResult)


def complete(client: openai.OpenAI) -> str:
    got = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert got.usage.completion_tokens == 8
    return got.choices[0].text


def segments(cluster: Cluster) -> list[str]:
    return sorted(p.name for p in cluster.share_dir.glob("seg-*"))


def mapped_by(pid: int, segment: str) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return any(line.rstrip().endswith(segment) for line in f)


@pytest.fixture()
def cluster(redis_url, tmp_path, tiny_model_dir):
    # a repository makes the workers obey load/unload commands; it holds another model of the same size
    repo = ModelRepository(tmp_path / "repo")
    import_model(repo, str(variant(tiny_model_dir, tmp_path / "other", 5)), "other", progress=False)
    budget = int((tiny_model_dir / "model.safetensors").stat().st_size * 1.5)  # one model, not two
    c = Cluster(redis_url, str(tiny_model_dir), [*ENGINE, "--model-repo", str(repo.root), "--weights-memory",
                                                 str(budget)], tmp_path)
    c.redis.flushall()
    yield c
    c.stop()


def test_two_workers_share_one_copy_through_unload_reload_and_the_exporters_kill(cluster, tiny_model_dir):
    want = offline_text(tiny_model_dir)  # the offline engine's own, unshared load
    cluster.start_gateway()
    cluster.start_worker("unified", "u1")
    cluster.wait_worker("u1")  # u1 exports: it was first
    cluster.start_worker("unified", "u2")
    cluster.wait_ready()
    u1, u2 = cluster.procs["u1"].pid, cluster.procs["u2"].pid
    assert "weights loaded and exported" in cluster.log("u1") and "weights mapped" in cluster.log("u2")

    # one copy on the device: one segment, mapped by both processes, counted once in each one's accounting
    (entry,) = WeightRegistry(cluster.share_dir).snapshot().values()
    assert entry.ready and entry.exporter.pid == u1 and sorted(u.pid for u in entry.users) == sorted([u1, u2])
    (segment,) = segments(cluster)
    assert mapped_by(u1, segment) and mapped_by(u2, segment)
    until(lambda: cluster.worker("u1").weights_used == cluster.worker("u2").weights_used == entry.nbytes,
          "each worker counts the shared model once")

    client = openai.OpenAI(base_url=cluster.base_url, api_key="unused", max_retries=0, timeout=120)
    assert [complete(client) for _ in range(4)] == [want] * 4

    # the exporter unloads while u2 keeps the model: the copy stays, u2 serves from it
    assert command(cluster, "u1", op="unload", drain=False).ok
    until(lambda: [u.pid for u in WeightRegistry(cluster.share_dir).snapshot()[entry.key].users] == [u2],
          "u1 unloaded tiny")
    assert segments(cluster) == [segment]
    assert complete(client) == want
    # ... and loads it again: mapped, not loaded, still one copy
    assert command(cluster, "u1", op="load", path=str(tiny_model_dir), dtype="float32", max_model_len=256).ok
    assert cluster.log("u1").count("weights mapped") == 1
    assert segments(cluster) == [segment] and mapped_by(u1, segment)
    until(lambda: "tiny" in cluster.worker("u1").models, "u1 serves tiny again")

    # u1 needs room for another model: its budget evicts the shared one, which u2 keeps serving
    time.sleep(1.5)  # idle past the grace period
    result = command(cluster, "u1", op="load", name="other", version=1, dtype="float32", max_model_len=256)
    assert result.ok and result.evicted == ["tiny"], result
    assert [u.pid for u in WeightRegistry(cluster.share_dir).snapshot()[entry.key].users] == [u2]
    assert len(segments(cluster)) == 2 and segment in segments(cluster)
    assert complete(client) == want

    # the process that created both segments dies: u2 keeps serving tiny from its segment; nobody maps the
    # other model any more, so the next registry access frees it
    cluster.kill("u1")
    (entry,) = WeightRegistry(cluster.share_dir).snapshot().values()
    assert entry.model == "tiny" and [u.pid for u in entry.users] == [u2] and segments(cluster) == [segment]
    assert [complete(client) for _ in range(3)] == [want] * 3

    # the last user unloads: the copy is freed
    assert command(cluster, "u2", op="unload", drain=False).ok
    until(lambda: not segments(cluster), "the last user's unload frees the segment")
    assert WeightRegistry(cluster.share_dir).snapshot() == {}
    assert not mapped_by(u2, segment)
