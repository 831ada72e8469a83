"""The decode-graph machinery without a GPU: buckets, the packed input layout and its padding rows,
the block-table cache, and the whole static-buffer decode path (shared/engine/cuda_graphs.py with
``record=False``) against HF greedy tokens. tests/gpu/ covers capture and replay on CUDA."""

import numpy as np
import pytest
import torch

from kvrelay import LLM
from kvrelay.shared.engine.cuda_graphs import DecodeGraphs, bucket_for, capture_sizes
from kvrelay.shared.engine.step_inputs import BlockTableCache, Layout, StepBatch, host_buffer, to_device, views, write
from tests.conftest import random_prompts
from tests.parity import engine_greedy, hf_greedy

MAX_NEW = 12


def test_capture_sizes_and_buckets():
    assert capture_sizes(1) == [1]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256 and 128 in sizes
    assert all(b - a <= 16 for a, b in zip(sizes[3:], sizes[4:], strict=False))
    assert capture_sizes(300)[-2:] == [288, 300]
    assert [bucket_for(sizes, n) for n in (1, 3, 5, 9, 65, 128, 129, 256)] == [1, 4, 8, 16, 80, 128, 144, 256]
    assert bucket_for(sizes, 257) is None
    with pytest.raises(ValueError):
        capture_sizes(0)


def _decode_batch(n: int, width_blocks: int = 3) -> StepBatch:
    tables = [np.arange(i * 10, i * 10 + width_blocks, dtype=np.int32) for i in range(n)]
    return StepBatch(input_ids=[100 + i for i in range(n)], positions=[20 + i for i in range(n)],
                     slot_mapping=[500 + i for i in range(n)], query_start_loc=list(range(n + 1)),
                     seq_lens=[21 + i for i in range(n)], block_tables=tables, sample_rows=list(range(n)))


def test_padded_decode_rows_write_nowhere_and_stay_finite():
    layout = Layout(tokens=8, seqs=8, width=5)
    buf = torch.full((layout.size,), 7777, dtype=torch.int32)
    write(buf.numpy(), layout, _decode_batch(3), padded_seqs=8)
    t = views(buf, layout, 8, 8, 3)
    assert t.input_ids.tolist() == [100, 101, 102, 0, 0, 0, 0, 0]
    assert t.positions.tolist() == [20, 21, 22, 0, 0, 0, 0, 0]
    assert t.slot_mapping.tolist() == [500, 501, 502, -1, -1, -1, -1, -1]  # write_kv skips -1
    assert t.query_start_loc.tolist() == list(range(9))
    assert t.seq_lens.tolist() == [21, 22, 23, 1, 1, 1, 1, 1]
    assert t.sample_rows.tolist() == [0, 1, 2]
    assert t.block_tables.tolist() == [[0, 1, 2, 0, 0], [10, 11, 12, 0, 0], [20, 21, 22, 0, 0]] + [[0] * 5] * 5
    with pytest.raises(ValueError):
        write(buf.numpy(), layout, _decode_batch(9), padded_seqs=9)


def test_eager_packing_round_trips_a_mixed_batch():
    batch = StepBatch(input_ids=[5, 6, 7, 8], positions=[0, 1, 2, 9], slot_mapping=[16, 17, 18, 41],
                      query_start_loc=[0, 3, 4], seq_lens=[3, 10], sample_rows=[2, 3],
                      block_tables=[np.array([1], dtype=np.int32), np.array([4, 2], dtype=np.int32)])
    t = to_device(batch, torch.device("cpu"))
    assert t.input_ids.tolist() == [5, 6, 7, 8] and t.positions.tolist() == [0, 1, 2, 9]
    assert t.slot_mapping.tolist() == [16, 17, 18, 41] and t.query_start_loc.tolist() == [0, 3, 4]
    assert t.seq_lens.tolist() == [3, 10] and t.sample_rows.tolist() == [2, 3]
    assert t.block_tables.tolist() == [[1] + [0] * 15, [4, 2] + [0] * 14]  # 16 columns: see below
    assert host_buffer(4, torch.device("cpu")).dtype == torch.int32


@pytest.mark.parametrize("tokens,seqs", [(1, 1), (7, 1), (6, 3), (18, 2), (33, 5), (64, 16)])
def test_every_region_starts_16_byte_aligned_whatever_the_counts(tokens, seqs):
    # Triton specialises kernels on each pointer's 16-byte alignment and on each int's divisibility
    # by 16: aligned regions and a 16-column table keep a step's counts from picking new variants
    per_seq = [tokens // seqs] * (seqs - 1)
    lens = per_seq + [tokens - sum(per_seq)]
    starts = [0]
    for n in lens:
        starts.append(starts[-1] + n)
    batch = StepBatch(input_ids=[1] * tokens, positions=list(range(tokens)), slot_mapping=list(range(tokens)),
                      query_start_loc=starts, seq_lens=lens, sample_rows=[s - 1 for s in starts[1:]],
                      block_tables=[np.arange(i, i + 3, dtype=np.int32) for i in range(seqs)])
    t = to_device(batch, torch.device("cpu"))
    for name, view in vars(t).items():
        assert view.data_ptr() % 16 == 0, name
    assert t.block_tables.stride(0) % 16 == 0
    graph_layout = Layout(tokens=tokens, seqs=seqs, width=8)
    buf = torch.zeros(graph_layout.size, dtype=torch.int32)
    for name, view in vars(views(buf, graph_layout, tokens, seqs, seqs)).items():
        assert view.data_ptr() % 16 == 0, name


def test_block_table_cache_extends_and_notices_new_blocks():
    cache = BlockTableCache()
    first = cache.get("r", [3, 4])
    assert cache.get("r", [3, 4]) is first  # unchanged: no conversion at all
    assert cache.get("r", [3, 4, 9]).tolist() == [3, 4, 9]  # grown by a block
    assert cache.get("r", [7, 8, 9]).tolist() == [7, 8, 9]  # preempted and re-admitted elsewhere
    assert cache.get("r", [7]).tolist() == [7]
    cache.drop("r")
    assert len(cache) == 0


def _static_path_llm(model_dir, **kwargs) -> LLM:
    """A CPU engine whose decode steps go through DecodeGraphs' static buffers (no recording), with
    a 40-token short-context class so that both length classes serve steps."""
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, device="cpu", **kwargs)
    runner = llm.engine.core.runner
    runner.graphs = DecodeGraphs(runner.model, runner.kv_cache, llm.engine.config.scheduler.max_num_seqs,
                                 runner.max_model_len, runner.block_size, record=False, short_context=40)
    assert runner.graphs.capture()
    runner.enforce_eager = False
    return llm


MODES = {
    "plain": dict(enable_prefix_caching=False),
    "chunked": dict(enable_chunked_prefill=True, max_num_batched_tokens=32, enable_prefix_caching=False),
    "prefix_cache": dict(enable_prefix_caching=True, block_size=8),
}


@pytest.mark.parametrize("num_prompts", [1, 3, 5, 13])
@pytest.mark.parametrize("mode", list(MODES))
def test_static_buffer_decode_equals_hf(tiny_model_dirs, mode, num_prompts):
    # 13 prompts under max_num_seqs=16 pad into the 16 bucket, and finishing requests (EOS) shrink the
    # batch through padded buckets (7 -> 8, 3 -> 4)
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(num_prompts, lo=3, hi=60, seed=num_prompts)
    if mode == "prefix_cache":
        shared = random_prompts(1, lo=30, hi=30, seed=99)[0]  # 3 full blocks of 8, then each prompt's own
        prompts = [shared + p for p in prompts]
    llm = _static_path_llm(model_dir, max_num_seqs=16, **MODES[mode])
    expected = hf_greedy(str(model_dir), tuple(map(tuple, prompts)), MAX_NEW)
    assert engine_greedy(llm, prompts, MAX_NEW) == expected
    if mode == "prefix_cache":  # again, now that the shared prefix is cached
        assert engine_greedy(llm, prompts, MAX_NEW, min_cached_tokens=24 * num_prompts) == expected
    assert llm.engine.core.runner.graphs.num_replays > 0


def test_both_length_classes_serve_steps(tiny_model_dirs):
    # 30-token prompts decoding 16 tokens: contexts 31..46 cross the 40-token class boundary
    model_dir = tiny_model_dirs["llama"]
    prompts = random_prompts(4, lo=30, hi=30, seed=12)
    llm = _static_path_llm(model_dir, max_num_seqs=8)
    expected = hf_greedy(str(model_dir), tuple(map(tuple, prompts)), 16)
    assert min(map(len, expected)) > 12  # no early EOS, or the boundary would not be crossed
    assert engine_greedy(llm, prompts, 16) == expected
    graphs = llm.engine.core.runner.graphs
    assert graphs.len_classes == [40, 128]
    assert graphs.replays_by_len[40] > 0 and graphs.replays_by_len[128] > 0


@pytest.mark.parametrize("arch", ["gpt2", "bloom", "qwen2"])
def test_static_buffer_decode_other_architectures(tiny_model_dirs, arch):
    prompts = random_prompts(6, lo=3, hi=40, seed=4)
    llm = _static_path_llm(tiny_model_dirs[arch], max_num_seqs=8)
    expected = hf_greedy(str(tiny_model_dirs[arch]), tuple(map(tuple, prompts)), MAX_NEW)
    assert engine_greedy(llm, prompts, MAX_NEW) == expected


def test_cpu_engine_captures_nothing(tiny_model_dirs):
    runner = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128).engine.core.runner
    assert runner.graphs is None and not runner.enforce_eager
