"""``kvrelay serve --mode disaggregated --tensor-parallel-size 2``: both workers run the model on two ranks, and
each prefill rank sends its own KV heads to the decode worker (the handoff's "rank_layers" transport, counted
by the prefill worker's kvrelay_handoffs_total), whose rank 1 takes its heads on a socket of its own, not
through rank 0 (the decode worker's kvrelay_handoff_rank_received_bytes); the openai SDK gets the offline
engine's greedy text in one process."""

import pytest

from kvrelay import SamplingParams
from tests.conftest import random_prompts
from tests.e2e.cluster import free_port
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.handoff_metrics import handoffs_settled, rank_received_bytes
from tests.e2e.served import Served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]


def test_each_rank_sends_and_takes_its_own_heads_and_the_text_is_one_process(tiny_model_dir, tiny_offline, tmp_path):
    prompts = random_prompts(3, lo=5, hi=60, seed=8)
    llm = tiny_offline
    want = [llm.get_tokenizer().decode(o.outputs[0].token_ids, skip_special_tokens=True) for o in llm.generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0.0, max_tokens=12))]
    metrics = free_port()  # the prefill worker's; the decode worker's is the next one
    argv = ["--mode", "disaggregated", "--model", str(tiny_model_dir), *TINY_ENGINE, "--tensor-parallel-size", "2",
            "--worker-monitoring-port", str(metrics)]
    with Served(argv, tmp_path / "serve.log", timeout=300) as served:
        client = served.client(timeout=120)
        got = [client.completions.create(model="tiny", prompt=p, max_tokens=12, temperature=0.0).choices[0].text
               for p in prompts]
        counted = handoffs_settled(metrics, "transport", len(prompts))
        received = rank_received_bytes(metrics + 1)
    assert got == want
    assert counted == {"rank_layers": len(prompts)}, counted
    assert list(received) == ["1"] and received["1"] > 0, received
