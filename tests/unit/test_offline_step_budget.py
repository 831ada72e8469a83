"""The offline engine's default step budget follows vLLM's LLM-class defaults on a GPU (by its memory and name)
and stays the workers' on the CPU; a budget given, or chunked prefill off, is left alone."""

from types import SimpleNamespace

import pytest
import torch

from kvrelay import LLM
from kvrelay.shared.config.engine import DEFAULT_STEP_TOKENS
from kvrelay.shared.config.offline_step import offline_batched_tokens
from kvrelay.shared.engine import token_budget

GIB = 1 << 30


@pytest.mark.parametrize(("name", "memory", "budget"), [
    ("NVIDIA H100 80GB HBM3", 80 * GIB, 16384),
    ("NVIDIA H200", 141 * GIB, 16384),
    ("NVIDIA A100-SXM4-80GB", 80 * GIB, 8192),  # vLLM keeps A100s at the smaller step
    ("NVIDIA L4", 24 * GIB, 8192),
    ("NVIDIA H100 PCIe", 70 * GIB - 1, 8192),  # just under the bound
])
def test_a_gpu_gets_vllms_offline_default_by_its_memory_and_name(monkeypatch, name, memory, budget):
    asked = []

    def props(device):
        asked.append(device)
        return SimpleNamespace(name=name, total_memory=memory)

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    assert offline_batched_tokens("cuda:1") == budget
    assert asked == [torch.device("cuda:1")]  # the device the engine runs on, not device 0


def test_the_cpu_keeps_the_workers_default():
    assert offline_batched_tokens("cpu") is None
    assert token_budget.max_batched_tokens(token_budget.SchedulerConfig(), 4096) == DEFAULT_STEP_TOKENS


def test_an_llm_on_the_cpu_steps_as_a_worker_does_and_a_given_budget_stands(tiny_model_dirs):
    model = str(tiny_model_dirs["llama"])
    assert LLM(model=model, max_model_len=128).engine.core.max_num_batched_tokens == DEFAULT_STEP_TOKENS
    assert LLM(model=model, max_model_len=128, max_num_batched_tokens=96).engine.core \
        .max_num_batched_tokens == 96


def test_an_llm_on_a_large_gpu_asks_for_the_larger_step(monkeypatch, tiny_model_dirs):
    # the budget is resolved before the engine is built; the engine itself runs on the CPU here
    seen = []
    monkeypatch.setattr("kvrelay.llm.offline_batched_tokens", lambda device: seen.append(device) or 16384)
    llm = LLM(model=str(tiny_model_dirs["llama"]), max_model_len=128, device="cpu")
    assert seen == ["cpu"] and llm.engine.core.max_num_batched_tokens == 16384
    unchunked = LLM(model=str(tiny_model_dirs["llama"]), max_model_len=128, device="cpu", enable_chunked_prefill=False)
    assert seen == ["cpu"] and unchunked.engine.core.max_num_batched_tokens == 128
