"""Sampler filters: top-k, top-p and min-p against a per-row reference, ties and edge values included."""

import torch

from kvrelay.shared.engine.logits_processors import apply_top_k_top_p_min_p

NEG_INF = float("-inf")


def reference_filter(row: torch.Tensor, k: int, p: float, min_p: float) -> torch.Tensor:
    """Straightforward per-row version: sort, walk, keep ties at each boundary."""
    x = row.clone().double()
    vocab = x.numel()
    if 0 < k < vocab:
        kth = sorted(x.tolist(), reverse=True)[k - 1]
        x[x < kth] = NEG_INF
    if p < 1:
        probs = torch.softmax(x, dim=0).tolist()
        cumulative, threshold = 0.0, 0.0
        for prob in sorted(probs, reverse=True):
            cumulative += prob
            threshold = prob
            if cumulative >= p:
                break
        keep = torch.tensor([q >= threshold for q in probs])
        x[~keep] = NEG_INF
    if min_p > 0:
        probs = torch.softmax(x, dim=0)
        x[probs < min_p * probs.max()] = NEG_INF
    return x.float()


def test_filters_match_reference_on_random_logits_with_ties_and_edges() -> None:
    gen = torch.Generator().manual_seed(0)
    vocab = 40
    rows = []
    for i in range(120):
        row = torch.randn(vocab, generator=gen) * 2
        if i % 3 == 0:
            row = row.round()  # many exact ties, including at the top-k / top-p boundary
        if i % 7 == 0:
            row[:5] = 1.5  # a tie group near the top
        rows.append(row)
    logits = torch.stack(rows)  # [S, V]
    edge_ks = [-1, 1, vocab, vocab + 5, 3]
    edge_ps = [1.0, 0.5, 1e-6, 0.9, 0.999]
    edge_min_ps = [0.0, 1.0, 0.05, 0.3, 0.0]
    top_k, top_p, min_p = [], [], []
    for i in range(logits.shape[0]):
        if i < 25:  # every combination of edge values
            top_k.append(edge_ks[i % 5])
            top_p.append(edge_ps[(i // 5) % 5])
            min_p.append(edge_min_ps[(i * 3) % 5])
        else:
            top_k.append(int(torch.randint(-1, vocab + 1, (1,), generator=gen)))
            top_p.append(float(torch.rand(1, generator=gen)) * 0.99 + 0.01 if i % 2 else 1.0)
            min_p.append(float(torch.rand(1, generator=gen)) * 0.3 if i % 5 else 0.0)
    got = apply_top_k_top_p_min_p(logits, torch.tensor(top_k), torch.tensor(top_p), torch.tensor(min_p))
    for i in range(logits.shape[0]):
        want = reference_filter(logits[i], top_k[i], top_p[i], min_p[i])
        assert torch.equal(torch.isinf(got[i]), torch.isinf(want)), (i, top_k[i], top_p[i], min_p[i])
        finite = ~torch.isinf(want)
        assert torch.equal(got[i][finite], logits[i][finite])
        assert finite.any()


def test_filters_edge_semantics() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 0.0]])  # [1, 5]
    off = apply_top_k_top_p_min_p(logits, torch.tensor([-1]), torch.tensor([1.0]), torch.tensor([0.0]))
    assert torch.equal(off, logits)
    assert torch.equal(apply_top_k_top_p_min_p(logits, None, None, None), logits)
    top1 = apply_top_k_top_p_min_p(logits, torch.tensor([1]), None, None)
    assert torch.isfinite(top1).tolist() == [[False, True, True, False, False]]  # tie at the top kept
    top3 = apply_top_k_top_p_min_p(logits, torch.tensor([3]), None, None)
    assert torch.isfinite(top3).tolist() == [[False, True, True, True, False]]
    tiny_p = apply_top_k_top_p_min_p(logits, None, torch.tensor([1e-9]), None)
    assert torch.isfinite(tiny_p).tolist() == [[False, True, True, False, False]]
    full_min_p = apply_top_k_top_p_min_p(logits, None, None, torch.tensor([1.0]))
    assert torch.isfinite(full_min_p).tolist() == [[False, True, True, False, False]]
    # min_p = 0.5 keeps p >= p_max / 2, i.e. logit >= 3 - ln 2 = 2.31: only the two 3.0 logits.
    half = apply_top_k_top_p_min_p(logits, None, None, torch.tensor([0.5]))
    assert torch.isfinite(half).tolist() == [[False, True, True, False, False]]
    # min_p = 0.3 keeps logit >= 3 + ln 0.3 = 1.80: also the 2.0 logit.
    third = apply_top_k_top_p_min_p(logits, None, None, torch.tensor([0.3]))
    assert torch.isfinite(third).tolist() == [[False, True, True, True, False]]
