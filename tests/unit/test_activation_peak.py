"""The activation-peak forward runs a step of the whole token budget: past the model's longest sequence it holds
several prompts (each within the position table, their blocks apart), as the scheduler's largest step would; and
the piecewise graphs' pool is sized by their largest step, not by the budget."""

import types

import pytest
import torch

from kvrelay.shared.config.engine import ModelConfig
from kvrelay.shared.engine import activation_peak
from kvrelay.shared.engine.activation_peak import peak_forward
from kvrelay.shared.engine.loader import load_model


@pytest.fixture(scope="module")
def llama(tiny_model_dirs):
    model, _ = load_model(ModelConfig(model=str(tiny_model_dirs["llama"]), dtype="float32"), "cpu", progress=False)
    return model


def _seen(model, monkeypatch):
    calls = []
    forward = model.forward

    def spy(ids, positions, kv, meta, carried=None):
        calls.append((ids, positions, kv, meta))
        return forward(ids, positions, kv, meta, carried)

    monkeypatch.setattr(model, "forward", spy)
    return calls


def test_a_budget_past_the_longest_sequence_runs_as_several_prompts(llama, monkeypatch):
    calls = _seen(llama, monkeypatch)
    peak_forward(llama, 3 * 200 + 37, 4, 8, torch.float32, torch.device("cpu"), max_len=200)
    ((ids, positions, kv, meta),) = calls
    assert len(ids) == 637 and meta.seq_lens_cpu == [200, 200, 200, 37]
    assert meta.query_start_loc_cpu == [0, 200, 400, 600, 637] and meta.max_query_len == 200
    assert int(positions.max()) == 199 and positions[200:203].tolist() == [0, 1, 2]
    # each prompt's tokens in its own blocks: slots never shared, each inside its row of the block table
    assert len(set(meta.slot_mapping.tolist())) == 637 and kv.shape[2] == 25 + 25 + 25 + 5
    for i, start in enumerate(meta.query_start_loc_cpu[:-1]):
        slots = meta.slot_mapping[start:start + meta.seq_lens_cpu[i]]
        assert set((slots // 8).tolist()) <= set(meta.block_tables[i].tolist())


def test_without_a_longest_sequence_it_is_one_prompt(llama, monkeypatch):
    calls = _seen(llama, monkeypatch)
    peak_forward(llama, 100, 2, 8, torch.float32, torch.device("cpu"))
    ((_, positions, _, meta),) = calls
    assert meta.seq_lens_cpu == [100] and positions.tolist() == list(range(100))


def test_one_prompt_past_the_position_table_is_what_the_split_avoids(llama):
    with pytest.raises((IndexError, RuntimeError)):  # the tiny llama's table holds 512 positions
        peak_forward(llama, 600, 2, 8, torch.float32, torch.device("cpu"))
    peak_forward(llama, 600, 2, 8, torch.float32, torch.device("cpu"), max_len=512)


class FakeCuda:
    """torch.cuda's memory counters for a device whose forward allocates BYTES_PER_TOKEN per step token above
    BASE: what free_kv_blocks reads, without a GPU."""

    BASE, BYTES_PER_TOKEN, TOTAL = 10_000_000, 1_000, 100_000_000

    def __init__(self, monkeypatch):
        self.steps, self.high = [], self.BASE
        monkeypatch.setattr(activation_peak, "peak_forward", self.forward)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: self.BASE)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: setattr(self, "high", self.BASE))
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device: self.high)
        monkeypatch.setattr(torch.cuda, "get_device_properties",
                            lambda device: types.SimpleNamespace(total_memory=self.TOTAL))

    def forward(self, model, num_tokens, num_rows, *args):
        self.steps.append((num_tokens, num_rows))
        self.high = max(self.high, self.BASE + num_tokens * self.BYTES_PER_TOKEN)

    def blocks(self, tokens: int, graph_tokens: int, reserve: int | None) -> int:
        return activation_peak.free_kv_blocks(None, tokens, 256, 16, torch.bfloat16, torch.device("cuda"), 0.9, 1_000,
                                              reserve, 4096, graph_tokens)


def test_the_graph_pool_is_the_peak_of_the_largest_graph_step_not_of_the_budget(monkeypatch):
    cuda = FakeCuda(monkeypatch)
    # the offline budget (16,384) past the largest piecewise bucket (2,048): that bucket's peak sizes the pool
    free = cuda.blocks(16_384, 2_048, 5_000)
    assert cuda.steps == [(16_384, 256), (2_048, 256)]
    step, pool = 16_384 * cuda.BYTES_PER_TOKEN, 2_048 * cuda.BYTES_PER_TOKEN
    assert free == (cuda.TOTAL * 0.9 - (cuda.BASE + step + pool + 5_000)) // 1_000
    # a budget within the largest bucket: the one forward is both peaks
    cuda.steps.clear()
    assert cuda.blocks(2_048, 2_048, 5_000) == (cuda.TOTAL * 0.9 - (cuda.BASE + 2 * pool + 5_000)) // 1_000
    assert cuda.steps == [(2_048, 256)]
    # no piecewise graphs: no pool at all
    cuda.steps.clear()
    assert cuda.blocks(16_384, 0, None) == (cuda.TOTAL * 0.9 - (cuda.BASE + step)) // 1_000
    assert cuda.steps == [(16_384, 256)]
