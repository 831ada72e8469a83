"""The tensor-parallel shard math against unsharded torch: each rank's slice of a column- or row-parallel
projection, of the fused QKV and gate/up projections and of the vocabulary, recombined the way the
collectives recombine them (concatenation for columns and the vocabulary, a sum for rows), gives the full
layer's output. The collectives themselves run in tests/unit/test_tensor_parallel.py, in real processes."""

import pytest
import torch
import torch.nn.functional as F

from kvrelay.shared.engine.models.bloom import _regroup_qkv, alibi_slopes
from kvrelay.shared.engine.parallel import linear as tp
from kvrelay.shared.engine.parallel.embedding import VocabParallelEmbedding, vocab_range, vocab_rows
from kvrelay.shared.engine.parallel.state import ParallelState

torch.manual_seed(0)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_column_then_row_parallel_equals_the_full_mlp(world):
    x, w1, b1, w2, b2 = torch.randn(5, 16), torch.randn(32, 16), torch.randn(32), torch.randn(16, 32), torch.randn(16)
    full = F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)
    # column: each rank's own activations; row: partial sums the all-reduce adds, rank 0 alone adding the bias
    partial = [F.linear(F.gelu(F.linear(x, tp.column(w1, r, world), tp.column(b1, r, world))),
                        tp.row(w2, r, world), tp.row_bias(b2, r)) for r in range(world)]
    torch.testing.assert_close(sum(partial), full)


def test_even_split_refuses_what_does_not_divide():
    with pytest.raises(ValueError, match="tensor_parallel_size 3 does not divide the attention heads 4"):
        tp.even(4, 0, 3, "the attention heads")


def test_kv_heads_shard_or_replicate():
    assert [tp.kv_heads(4, r, 2) for r in range(2)] == [(0, 2), (2, 2)]
    # fewer KV heads than ranks: each rank holds the one KV head its query heads read
    assert [tp.kv_heads(2, r, 4) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="tensor_parallel_size 2 does not divide the KV heads 3"):
        tp.kv_heads(3, 0, 2)
    with pytest.raises(ValueError, match="neither a divisor nor a multiple of the 3 KV heads"):
        tp.kv_heads(3, 0, 4)


@pytest.mark.parametrize("world", [2, 4])
def test_gqa_attention_sharded_by_heads_equals_full(world):
    """Llama's separate q/k/v: each rank's query heads attend with the KV heads of their group, and the
    row-parallel o projection sums the ranks' heads back into the full output."""
    heads, kv, d, hidden, t = 8, 2, 4, 32, 6
    x = torch.randn(t, hidden)
    wq, wk, wv, wo = torch.randn(heads * d, hidden), torch.randn(kv * d, hidden), torch.randn(kv * d, hidden), \
        torch.randn(hidden, heads * d)

    def attend(q_w, k_w, v_w, o_w, h, h_kv):
        q = F.linear(x, q_w).view(t, h, d).transpose(0, 1)
        k = F.linear(x, k_w).view(t, h_kv, d).transpose(0, 1).repeat_interleave(h // h_kv, dim=0)
        v = F.linear(x, v_w).view(t, h_kv, d).transpose(0, 1).repeat_interleave(h // h_kv, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(t, h * d)
        return F.linear(out, o_w)

    full = attend(wq, wk, wv, wo, heads, kv)
    parts = []
    for r in range(world):
        q0, qn = tp.even(heads, r, world)
        k0, kn = tp.kv_heads(kv, r, world)
        parts.append(attend(tp.heads(wq, heads, q0, qn), tp.heads(wk, kv, k0, kn), tp.heads(wv, kv, k0, kn),
                            tp.row(wo, r, world), qn, kn))
    torch.testing.assert_close(sum(parts), full, rtol=1e-4, atol=1e-4)


def test_fused_gate_up_rows_stack_per_rank():
    """gate and up are each split by rows and stacked per rank: rank r's fused weight is [gate_r | up_r]."""
    gate, up, world = torch.randn(8, 4), torch.randn(8, 4), 2
    for r in range(world):
        fused = torch.cat([tp.column(gate, r, world), tp.column(up, r, world)])
        assert torch.equal(fused[:4], gate[4 * r:4 * r + 4]) and torch.equal(fused[4:], up[4 * r:4 * r + 4])


def test_stacked_qkv_gives_each_rank_its_heads_of_q_k_and_v():
    heads, d, world = 4, 3, 2
    q, k, v = (torch.randn(heads * d, 5) for _ in range(3))
    fused = torch.cat([q, k, v])  # GPT-2's c_attn, transposed to [out, in]
    for r in range(world):
        part = tp.stacked_qkv(fused, heads, r, world)
        rows = slice(r * 2 * d, (r + 1) * 2 * d)
        torch.testing.assert_close(part, torch.cat([q[rows], k[rows], v[rows]]))


def test_interleaved_qkv_slice_regroups_like_the_full_tensor():
    """BLOOM interleaves q, k, v per head; the rank's heads, regrouped, are the full regrouping's heads."""
    heads, d, world = 4, 3, 2
    t = torch.randn(heads * 3 * d, 5)
    q, k, v = _regroup_qkv(t, heads).chunk(3)
    for r in range(world):
        mine_q, mine_k, mine_v = _regroup_qkv(tp.interleaved_qkv(t, heads, r, world), heads // world).chunk(3)
        rows = slice(r * 2 * d, (r + 1) * 2 * d)
        assert torch.equal(mine_q, q[rows]) and torch.equal(mine_k, k[rows]) and torch.equal(mine_v, v[rows])


def test_alibi_slopes_are_sliced_not_recomputed():
    # a rank's slopes depend on each head's index among all heads: slopes(2) is not the second half of slopes(4)
    assert not torch.equal(alibi_slopes(4)[2:], alibi_slopes(2))


@pytest.mark.parametrize("vocab,world", [(512, 2), (50257, 2), (10, 4)])
def test_vocab_parallel_embedding_and_logits_equal_full(vocab, world):
    hidden = 8
    table = torch.randn(vocab, hidden)
    ids = torch.randint(0, vocab, (20,))
    partial = []
    logits = []
    for r in range(world):
        # a group of one rank's state: the all-reduce is left out, and summed here instead
        emb = VocabParallelEmbedding(vocab, hidden, torch.float32, ParallelState(r, world))
        assert emb.weight.shape[0] == vocab_range(vocab, r, world)[2]
        emb.weight.data.copy_(vocab_rows(table, vocab, r, world))
        partial.append(emb(ids))
        logits.append(F.linear(partial[0], emb.weight))  # each rank's vocabulary slice, padding rows included
    torch.testing.assert_close(sum(partial), F.embedding(ids, table))
    torch.testing.assert_close(torch.cat(logits, dim=-1)[:, :vocab], F.linear(partial[0], table))
