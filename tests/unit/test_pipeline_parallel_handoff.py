"""The KV handoff's engine seam with pipeline stages, in real rank processes over gloo: a prefill engine's KV
leaves with every layer (each stage's gathered to rank 0) and lands in a decode engine of another layout
(each stage given its own layers, each TP rank its heads of them), and the decode engine continues with the
greedy tokens one rank gives on its own. A three-layer llama, so two stages hold two layers and one."""

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.engine_core import EngineCore
from tests.conftest import make_tiny_model, random_prompts
from tests.unit.parallel_ranks import children
from tests.unit.test_tensor_parallel_handoff import MAX_NEW, handed_off

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def _config(model_dir, tp: int, pp: int) -> EngineConfig:
    return EngineConfig(ModelConfig(str(model_dir), dtype="float32", max_model_len=128),
                        cache=CacheConfig(block_size=8, num_gpu_blocks=64), device="cpu", tensor_parallel_size=tp,
                        pipeline_parallel_size=pp)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    return make_tiny_model("llama", tmp_path_factory.mktemp("llama3layers"), num_layers=3)


@pytest.mark.parametrize(("prefill", "decode"), [((1, 2), (1, 1)), ((1, 1), (1, 2)), ((2, 2), (2, 1))],
                         ids=["pp2-to-pp1", "pp1-to-pp2", "tp2xpp2-to-tp2"])
def test_kv_of_every_stage_hands_off_and_continues_like_one_rank(prefill, decode, three_layers):
    model = three_layers
    prompts = random_prompts(3, lo=5, hi=40, seed=4)
    with LLM(model=str(model), dtype="float32", max_model_len=128, block_size=8) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts],
                                                             SamplingParams(temperature=0.0, max_tokens=MAX_NEW))]
    before = children()
    sender = EngineCore(_config(model, *prefill), hold_finished_kv=True)
    receiver = EngineCore(_config(model, *decode))
    try:
        assert sender.kv.num_layers == receiver.kv.num_layers == 3
        assert sender.kv.sharded == (prefill != (1, 1)) and receiver.kv.sharded == (decode != (1, 1))
        got = handed_off(sender, receiver, prompts)
    finally:
        sender.shutdown()
        receiver.shutdown()
    assert got == want
    assert children() == before
