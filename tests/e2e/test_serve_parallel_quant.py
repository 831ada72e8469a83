"""Quantized models under tensor and pipeline parallelism through ``kvrelay serve`` with real processes: one
disaggregated serve hosts the tiny llama quantized on the fly (fp8 weights and an fp8 KV cache) and a
pre-quantized AWQ checkpoint of it (detected from its config.json), the prefill worker on TP 2 ranks and the
decode worker on two pipeline stages of TP 1 (``--decode-tensor-parallel-size 1
--decode-pipeline-parallel-size 2``): each prompt's KV, fp8 bytes or not, is gathered from the two prefill
ranks, handed off, and split over the decode stages. Greedy completions and chats through the openai SDK (the
chats streamed) give the text of the offline engine with the same quantization in one process."""

import json
import urllib.request

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint
from tests.e2e.served import Served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 10
ENGINE = ["--dtype", "float32", "--max-model-len", "256", "--block-size", "8", "--kv-cache-memory", str(16 << 20)]
# name -> what the offline engine is given for it (the AWQ checkpoint says its own quantization)
OFFLINE = {"fp8": {"quantization": "fp8", "kv_cache_dtype": "fp8"}, "awq": {}}


@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("parallel-quant")
    paths = {"fp8": tiny_model_dir, "awq": quantize_checkpoint(tiny_model_dir, root / "awq", "awq", group_size=32)}
    cfg = root / "serve.yaml"
    cfg.write_text("models:\n"
                   f"  - {{name: fp8, path: '{paths['fp8']}', quantization: fp8, kv_cache_dtype: fp8}}\n"
                   f"  - {{name: awq, path: '{paths['awq']}'}}\n")
    argv = ["--mode", "disaggregated", "--config", str(cfg), "--device", "cpu", *ENGINE, "--tensor-parallel-size",
            "2", "--decode-tensor-parallel-size", "1", "--decode-pipeline-parallel-size", "2"]
    with Served(argv, root / "serve.log", timeout=400) as s:
        yield s, s.client(), paths


def _tokenize_chat(s: Served, api_key: str, model: str) -> list[int]:
    req = urllib.request.Request(f"http://127.0.0.1:{s.port}/tokenize", method="POST",
                                 data=json.dumps({"model": model, "messages": CHAT}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
    with urllib.request.urlopen(req, timeout=60) as resp:
        return json.loads(resp.read())["tokens"]


def _offline(path, chat_ids: list[int], **quant) -> tuple[str, str]:
    """(the completion's text, the chat's text) of one process with the same quantization."""
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(model=str(path), dtype="float32", max_model_len=256, block_size=8, kv_cache_memory=16 << 20,
             **quant) as llm:
        completion, chat = llm.generate([PROMPT, {"prompt_token_ids": chat_ids}], greedy)
    return completion.outputs[0].text, chat.outputs[0].text


@pytest.mark.parametrize("name", ["fp8", "awq"])
def test_quantized_model_on_tp2_prefill_and_pp2_decode_answers_like_one_process(served, name):
    s, client, paths = served
    extra = {"ignore_eos": True}
    completion = client.completions.create(model=name, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0.0,
                                           extra_body=extra)
    stream = client.chat.completions.create(model=name, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0.0,
                                            stream=True, extra_body=extra)
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    chat_ids = _tokenize_chat(s, client.api_key, name)
    want_completion, want_chat = _offline(paths[name], chat_ids, **OFFLINE[name])
    assert completion.choices[0].text == want_completion
    assert completion.usage.completion_tokens == MAX_TOKENS
    assert "".join(chunks) == want_chat
    models = s.models()
    sizes = {(w["role"], w["tensor_parallel_size"], w["pipeline_parallel_size"])
             for w in models[name]["instances"][0]["workers"]}
    assert sizes == {("prefill", 2, 1), ("decode", 1, 2)}
