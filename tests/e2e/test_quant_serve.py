"""A quantized model served as a user serves it: ``kvrelay serve`` (disaggregated: a prefill worker hands
the KV to a decode worker) on a tiny AWQ checkpoint, quantization detected from its config.json and
int8 asked for on the command line for a full-precision one; the openai SDK's greedy completion equals
the offline engine's on the same weights."""

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.served import Served

pytestmark = pytest.mark.timeout(300)
PROMPT = "The quick brown fox"


def offline(path, **kw) -> str:
    llm = LLM(model=str(path), dtype="float32", max_model_len=256, kv_cache_memory=1 << 24, **kw)
    return llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))[0].outputs[0].text


@pytest.mark.parametrize("method", ["awq", "int8"])
def test_served_quantized_model_matches_the_offline_engine(tiny_model_dir, tmp_path, method):
    if method == "awq":  # a checkpoint quantized in AutoAWQ's layout: nothing to ask for
        path, flags = quantize_checkpoint(tiny_model_dir, tmp_path / "awq", "awq", group_size=32), []
    else:
        path, flags = tiny_model_dir, ["--quantization", "int8"]
    want = offline(path, **({"quantization": "int8"} if method == "int8" else {}))
    assert want != offline(tiny_model_dir) or method == "int8"  # the 4-bit weights change the text
    with Served(["--model", str(path), *TINY_ENGINE, *flags], tmp_path / "serve.log") as served:
        out = served.client().completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0.0,
                                                 extra_body={"ignore_eos": True})
    assert out.choices[0].text == want
