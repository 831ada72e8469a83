"""Every config in examples/ works as its comments say: ``kvrelay serve --config examples/X.yaml`` for real
(embedded Redis, gateway, one prefill and one decode worker), with tiny test models in the repository the
examples point at (``../model_repo``), requests through the openai SDK. Each model's answer equals its
own offline answer, so a request served by the wrong model or version fails."""

import shutil
import time
from pathlib import Path

import openai
import pytest

from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from tests.e2e.model_variants import PROMPT, offline_text, variant
from tests.e2e.served import Served

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--kv-cache-memory", str(48 << 20)]


@pytest.fixture()
def site(tmp_path, tiny_model_dir) -> Path:
    """A copy of examples/ beside a model repository holding chat v1 and summarizer v1."""
    shutil.copytree(EXAMPLES, tmp_path / "site" / "examples")
    repo = ModelRepository(tmp_path / "site" / "model_repo")
    import_model(repo, str(tiny_model_dir), "chat", progress=False)
    import_model(repo, str(variant(tiny_model_dir, tmp_path / "summarizer", seed=1)), "summarizer", progress=False)
    return tmp_path / "site"


def serve(site: Path, example: str, tmp_path: Path) -> Served:
    return Served(["--config", str(site / "examples" / example), *ENGINE], tmp_path / "serve.log")


def complete(client: openai.OpenAI, model: str) -> str:
    got = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0.0,
                                    extra_body={"ignore_eos": True})
    assert got.model == model and got.usage.completion_tokens == 8
    return got.choices[0].text


def holders(served: Served, name: str) -> dict[str, list[str]]:
    """Instance -> the roles of the workers holding it, from ``GET /admin/models``."""
    entry = served.models().get(name, {"instances": []})
    return {i["instance"]: sorted(w["role"] for w in i["workers"]) for i in entry["instances"] if i["workers"]}


def wait_until(check, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, what
        time.sleep(0.3)


def test_two_models_on_one_pool(site, tmp_path, tiny_model_dir):
    want = {"chat": offline_text(tiny_model_dir), "summarizer": offline_text(tmp_path / "summarizer")}
    assert want["chat"] != want["summarizer"]
    with serve(site, "two-models.yaml", tmp_path) as served:
        client = served.client()
        wait_until(lambda: {m.id for m in client.models.list().data} == set(want), "/v1/models lists both")
        for name, text in want.items():
            assert complete(client, name) == text, name
        models = served.models()
        assert set(models) == {"chat", "summarizer"}
        held = {name: {w["worker_id"] for i in m["instances"] for w in i["workers"]} for name, m in models.items()}
        assert len(held["chat"]) == 2 and held["chat"] == held["summarizer"]  # the same two workers host both
        assert all(holders(served, name) == {f"{name}@1": ["decode", "prefill"]} for name in want)


def test_a_pinned_model_and_a_lazily_loaded_one(site, tmp_path, tiny_model_dir):
    want = {"chat": offline_text(tiny_model_dir), "summarizer": offline_text(tmp_path / "summarizer")}
    with serve(site, "pinned-and-lazy.yaml", tmp_path) as served:
        client = served.client()
        models = served.models()
        assert (models["chat"]["pinned"], models["summarizer"]["pinned"]) == (True, False)
        assert models["summarizer"]["keep_alive_s"] == 600 and models["summarizer"]["registered"]
        assert holders(served, "chat") == {"chat@1": ["decode", "prefill"]}
        assert holders(served, "summarizer") == {}  # registered, not loaded
        assert complete(client, "summarizer") == want["summarizer"]  # waits for the load
        assert holders(served, "summarizer") == {"summarizer@1": ["decode", "prefill"]}
        assert complete(client, "chat") == want["chat"]
        assert served.admin("POST", "/admin/models/chat/unload")[0] == 409  # pinned
        assert served.admin("POST", "/admin/models/summarizer/unload")[0] == 202
        wait_until(lambda: holders(served, "summarizer") == {}, "summarizer unloaded")
        assert holders(served, "chat") == {"chat@1": ["decode", "prefill"]}
        assert complete(client, "summarizer") == want["summarizer"]  # loaded again by its next request


def test_a_version_swap(site, tmp_path, tiny_model_dir):
    v1, v2 = offline_text(tiny_model_dir), offline_text(variant(tiny_model_dir, tmp_path / "chat-v2", seed=2))
    assert v1 != v2
    with serve(site, "version-swap.yaml", tmp_path) as served:
        client = served.client()
        import_model(ModelRepository(site / "model_repo"), str(tmp_path / "chat-v2"), "chat", progress=False)
        assert complete(client, "chat") == v1
        status, body = served.admin("POST", "/admin/models/chat/swap", {"version": 2})
        assert status == 200 and body["swapped"] and body["version"] == 2, body
        assert complete(client, "chat") == v2
        wait_until(lambda: holders(served, "chat") == {"chat@2": ["decode", "prefill"]}, "version 1 unloaded")
        assert complete(client, "chat") == v2
