"""What the attention kernels need to know about one forward step.

The model runner packs every scheduled token of every sequence into one flat batch (no padding,
vLLM V1 style). Sequence ``i`` owns query rows ``query_start_loc[i]:query_start_loc[i+1]``; those
rows are the *last* ``q_len`` tokens of a sequence whose KV length after this step is
``seq_lens[i]``. Decode is the ``q_len == 1`` case, chunked prefill and prefix-cache hits are
``q_len < seq_len``, a plain prefill is ``q_len == seq_len``.
"""

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot (block * block_size + offset) per new token
    query_start_loc: torch.Tensor  # [S + 1] int32
    seq_lens: torch.Tensor  # [S] int32: KV length including this step's tokens
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    query_start_loc_cpu: list[int]  # host copies: the reference kernels loop on them without a sync
    seq_lens_cpu: list[int]
    max_query_len: int
    max_seq_len: int

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1
