"""The forward pass that measures a model's activation peak on CUDA before the KV cache is sized: the
largest step the scheduler may run, against a throwaway cache. Rank 0 and, under tensor parallelism,
every other rank run it together (its all-reduces pair up), each on its own device. A pipeline stage runs
its own layers alone, on zeros where the previous stage's output would be, and forms logits only if it is
the last."""

import itertools
import math

import torch

from kvrelay.kernels import AttentionMetadata


def peak_forward(model, num_tokens: int, num_rows: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, max_len: int = 0) -> None:
    """One step of ``num_tokens`` prompt tokens, in prompts of at most ``max_len`` tokens (0: one prompt), as a
    step of more tokens than the longest sequence holds several prompts: positions stay within the model's
    table, and the step's peak is that of the whole budget, not of one sequence's share of it."""
    per = min(num_tokens, max_len) if max_len else num_tokens
    lens = [per] * (num_tokens // per) + ([num_tokens % per] if num_tokens % per else [])
    counts = [math.ceil(n / block_size) for n in lens]
    firsts = [0, *itertools.accumulate(counts)][:-1]  # each prompt's first block
    kv = torch.zeros((model.kv_layers, 2, sum(counts), block_size, model.num_kv_heads, model.head_dim),
                     dtype=dtype, device=device)
    tables = torch.zeros((len(lens), max(counts)), dtype=torch.int32)
    for i, (first, count) in enumerate(zip(firsts, counts, strict=True)):
        tables[i, :count] = torch.arange(first, first + count, dtype=torch.int32)
    starts = [0, *itertools.accumulate(lens)]
    meta = AttentionMetadata(
        slot_mapping=torch.cat([torch.arange(f * block_size, f * block_size + n)
                                for f, n in zip(firsts, lens, strict=True)]).to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_start_loc_cpu=starts, seq_lens_cpu=list(lens),
        max_query_len=max(lens), max_seq_len=max(lens),
    )
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    stage = model.stage
    carried = None if stage.first else tuple(
        torch.zeros(num_tokens, model.hidden_size, dtype=next(model.parameters()).dtype, device=device)
        for _ in range(model.carried_tensors))
    with torch.inference_mode():
        hidden = model(ids, positions, kv, meta, carried)
        if stage.last:
            model.compute_logits(hidden[-num_rows:])


def free_kv_blocks(model, num_tokens: int, num_rows: int, block_size: int, dtype: torch.dtype,
                   device: torch.device, utilization: float, block_bytes: int, graph_reserve: int | None = None,
                   max_len: int = 0, graph_tokens: int = 0) -> int:
    """KV blocks that fit in ``utilization`` of the device after the weights and the activation peak.
    ``graph_reserve``: bytes of static buffers that piecewise CUDA graphs (piecewise_graphs.py) will hold for
    steps of up to ``graph_tokens`` tokens; their private graph pool is counted as the activation peak of a step
    of that size, since each piece's intermediates are a subset of one forward's and the pieces of every bucket
    share that pool. Larger steps run eagerly, so a budget past the largest bucket (the offline engine's 16,384
    tokens against 2,048) does not size the pool."""
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    peak = _peak(model, num_tokens, num_rows, block_size, dtype, device, max_len)
    if graph_reserve is not None:
        pool = (_peak(model, graph_tokens, min(num_rows, graph_tokens), block_size, dtype, device, max_len)
                if 0 < graph_tokens < num_tokens else peak)
        peak += (pool - base) + graph_reserve
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, int((total * utilization - peak) // block_bytes))


def _peak(model, num_tokens: int, num_rows: int, block_size: int, dtype: torch.dtype, device: torch.device,
          max_len: int) -> int:
    """The most memory allocated on ``device`` during one such step."""
    torch.cuda.reset_peak_memory_stats(device)
    peak_forward(model, num_tokens, num_rows, block_size, dtype, device, max_len)
    return torch.cuda.max_memory_allocated(device)
