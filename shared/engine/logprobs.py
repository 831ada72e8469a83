"""Logprobs as the API reports them: the packed top-k rows one transfer brings to the host, and the
prompt's logprobs (each position's actual next token with its true rank, then the k best).

Raw distribution (``log_softmax`` of the unmodified logits), as vLLM returns by default.
"""

import torch
from torch import Tensor

from kvrelay.shared.engine.logits_processors import to_device
from kvrelay.shared.engine.outputs import Logprob, PositionLogprobs

# Bound for the [rows, V] float32 working set of prompt_logprobs (2**26 elements = 256 MiB), so a long
# prompt over a large vocabulary does not materialise its whole log-softmax at once.
_PROMPT_LOGPROBS_CHUNK_ELEMENTS = 1 << 26


def pack_topk(logprobs: Tensor, chosen: Tensor, k: int) -> Tensor:
    """[R, 2 + 2k] float64 rows: chosen id, its logprob, k best ids, their logprobs.

    Ids ride as float64 (exact below 2**53) so ids and logprobs leave the device in one transfer.
    logprobs: [R, V]; chosen: [R] int64.
    """
    chosen_lp = logprobs.gather(1, chosen.unsqueeze(1))  # [R, 1]
    parts = [chosen.unsqueeze(1).double(), chosen_lp.double()]
    if k > 0:
        top_lp, top_ids = logprobs.topk(k, dim=-1)  # [R, k] each, highest first
        parts += [top_ids.double(), top_lp.double()]
    return torch.cat(parts, dim=1)


def prompt_logprobs(logits: Tensor, next_token_ids: list[int], k: int) -> list[PositionLogprobs]:
    """Per prompt position: {actual next token: its logprob and TRUE rank in the vocabulary, then the k best
    tokens with ranks 1..k}, as vLLM reports them.

    logits: [q, V], row j predicting ``next_token_ids[j]``. Each dict holds k or k + 1 entries (the
    actual token first, as vLLM orders them). Raw distribution, like the sampled-token logprobs. The
    actual token's rank counts the tokens at least as likely as it (itself included), vLLM's rule, so a
    token tied with the top-1 reports the tie's last rank.
    """
    num_rows, vocab = logits.shape
    if num_rows != len(next_token_ids):
        raise ValueError(f"{num_rows} logit rows for {len(next_token_ids)} next tokens")
    if num_rows == 0:
        return []
    k = vocab if k < 0 else min(k, vocab)  # -1: the whole vocabulary
    targets = to_device(next_token_ids, torch.int64, logits.device)  # [q]
    chunk = max(1, _PROMPT_LOGPROBS_CHUNK_ELEMENTS // vocab)
    packed_chunks = []
    for start in range(0, num_rows, chunk):
        lp = logits[start : start + chunk].float().log_softmax(dim=-1)  # [c, V]
        rows = targets[start : start + chunk]
        packed = pack_topk(lp, rows, k)
        rank = (lp >= lp.gather(1, rows.unsqueeze(1))).sum(dim=1, keepdim=True)  # [c, 1]
        packed_chunks.append(torch.cat([packed, rank.double()], dim=1))
    packed_rows = torch.cat(packed_chunks).tolist()  # one transfer for the whole prompt
    out = []
    for row in packed_rows:
        entry = {int(row[0]): Logprob(row[1], rank=int(row[-1]))}
        for j in range(k):
            entry.setdefault(int(row[2 + j]), Logprob(row[2 + k + j], rank=j + 1))
        out.append(entry)
    return out
