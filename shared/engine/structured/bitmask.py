"""The batch's token bitmask: filled on the host for the constrained rows only, applied on the device.

Layout is xgrammar's: int32 words, bit ``t % 32`` of word ``t // 32`` set when token ``t`` may come next.
Only the constrained rows get a mask row, so a batch without them pays nothing and a batch with a few pays
for those few. The mask may be wider than the logits (the tokenizer knows more ids than the model has
rows): the extra bits are never read. A model row the tokenizer does not know (padding) is never allowed.
"""

import torch
from torch import Tensor

_SHIFTS: dict[torch.device, Tensor] = {}


def new_bitmask(rows: int, words: int) -> Tensor:
    """A host bitmask of ``rows`` rows, all tokens forbidden until filled."""
    return torch.zeros((rows, words), dtype=torch.int32)


def _shifts(device: torch.device) -> Tensor:
    shifts = _SHIFTS.get(device)
    if shifts is None:
        shifts = _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return shifts


def apply_token_bitmask(logits: Tensor, rows: Tensor, bitmask: Tensor) -> Tensor:
    """-inf for every token that row ``rows[i]`` of ``logits`` may not take under ``bitmask[i]``.

    logits: [S, V] on the device; rows: [R] int64 and bitmask: [R, W] int32 with 32 * W >= V, both on the
    logits' device. Returns a new tensor (the logits of a CUDA graph are its output buffer: never written).
    """
    num_rows, vocab = logits.shape
    words = (vocab + 31) // 32
    bits = (bitmask[:, :words].unsqueeze(-1) >> _shifts(logits.device)) & 1  # [R, words, 32]
    allowed = bits.reshape(bits.shape[0], -1)[:, :vocab].bool()  # [R, V]
    constrained = logits.index_select(0, rows).masked_fill(~allowed, float("-inf"))  # [R, V]
    return logits.index_copy(0, rows, constrained)


def allowed_ids(bitmask_row: Tensor, vocab: int) -> list[int]:
    """The token ids one host mask row allows, below ``vocab`` (tests and debugging)."""
    bits = (bitmask_row.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1)[:vocab].nonzero().flatten().tolist()
