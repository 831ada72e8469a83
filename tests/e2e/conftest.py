"""Fixtures the production-readiness e2e tests share: one tiny model directory per session (random
Llama weights with SmolLM2's real tokenizer, so gateways can detokenize), and the engine flags that
keep every worker small on CI's two cores."""

import shutil

import pytest

from tests.conftest import make_tiny_model

# 4096 blocks (16 MiB of KV here) rather than the 1 GiB CPU default: a worker starts in a fraction of the time
TINY_ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--served-model-name", "tiny",
               "--num-gpu-blocks-override", "4096"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    path = make_tiny_model("llama", tmp_path_factory.mktemp("e2e-tiny") / "tiny", seed=3)
    for f in smollm2_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path
