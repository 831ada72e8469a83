"""The forward pass that measures a model's activation peak on CUDA before the KV cache is sized: the
largest step the scheduler may run, against a throwaway cache. Rank 0 and, under tensor parallelism,
every other rank run it together (its all-reduces pair up), each on its own device. A pipeline stage runs
its own layers alone, on zeros where the previous stage's output would be, and forms logits only if it is
the last."""

import math

import torch

from kvrelay.kernels import AttentionMetadata


def peak_forward(model, num_tokens: int, num_rows: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
    blocks = math.ceil(num_tokens / block_size)
    kv = torch.zeros((model.kv_layers, 2, blocks, block_size, model.num_kv_heads, model.head_dim),
                     dtype=dtype, device=device)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, device=device),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32, device=device),
        block_tables=torch.arange(blocks, dtype=torch.int32, device=device)[None],
        query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens],
        max_query_len=num_tokens, max_seq_len=num_tokens,
    )
    ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
    stage = model.stage
    carried = None if stage.first else tuple(
        torch.zeros(num_tokens, model.hidden_size, dtype=next(model.parameters()).dtype, device=device)
        for _ in range(model.carried_tensors))
    with torch.inference_mode():
        hidden = model(ids, torch.arange(num_tokens, device=device), kv, meta, carried)
        if stage.last:
            model.compute_logits(hidden[-num_rows:])


def free_kv_blocks(model, num_tokens: int, num_rows: int, block_size: int, dtype: torch.dtype,
                   device: torch.device, utilization: float, block_bytes: int, graph_reserve: int | None = None) -> int:
    """KV blocks that fit in ``utilization`` of the device after the weights and the activation peak.
    ``graph_reserve``: bytes of static buffers that piecewise CUDA graphs (piecewise_graphs.py) will hold; their
    private graph pool is counted as one more activation peak, since each piece's intermediates are a subset
    of one forward's and the pieces of every bucket share that pool."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    peak_forward(model, num_tokens, num_rows, block_size, dtype, device)
    peak = torch.cuda.max_memory_allocated(device)
    if graph_reserve is not None:
        peak += (peak - base) + graph_reserve
    total = torch.cuda.get_device_properties(device).total_memory
    return max(0, int((total * utilization - peak) // block_bytes))
