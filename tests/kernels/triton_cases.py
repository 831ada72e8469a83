"""Checks shared by the GPU tests and the CPU interpreter tests: Triton kernel vs kernels/reference.py.

Each ``check_*`` takes the Triton module namespace ``tk`` (``kernels.triton``, imported by the caller
in whichever mode it runs), a device, and the shape to test; inputs are fresh random draws per call.
Attention is compared against the reference run in float32 on upcast inputs (METHOD: compare with
higher precision), so the tolerance reflects only the kernel's own rounding.
"""

import random
from importlib import import_module

import torch

from kvrelay.kernels import reference
from kvrelay.kernels.metadata import AttentionMetadata

TOL = {torch.float32: 2e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # atol = rtol per dtype


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> None:
    assert not torch.isnan(actual).any(), "NaN in kernel output"
    tol = TOL[dtype] * scale
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def make_paged_case(
    q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int,
    page: int, dtype: torch.dtype, device: str, seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Random q [T, H, D] and a cache whose blocks are shuffled across sequences, plus metadata."""
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    blocks_per_seq = [-(-n // page) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks stay random: reading them would show
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(blocks_per_seq) + rng.randint(0, 2)  # tables padded with 0 past each sequence
    tables = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = torch.tensor(perm[used:used + n], dtype=torch.int32)
        used += n
    # one layer of a block-major pool ([N, L, 2, bs, Hkv, D] storage): the kernels must follow the
    # view's real strides, as they do for the shared KV pool
    pool = torch.randn(num_blocks, 2, 2, page, num_kv_heads, head_dim, generator=gen).to(dtype)
    kv_cache = pool.to(device)[:, 1].permute(1, 0, 2, 3, 4)  # [2, N, bs, Hkv, D]
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype)
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    slots = []
    for i, (ql, sl) in enumerate(zip(q_lens, seq_lens, strict=True)):
        for pos in range(sl - ql, sl):
            slots.append(int(tables[i, pos // page]) * page + pos % page)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=tables.to(device),
        query_start_loc_cpu=qsl, seq_lens_cpu=list(seq_lens),
        max_query_len=max(q_lens), max_seq_len=max(seq_lens),
    )
    return q.to(device), kv_cache, meta


def alibi_slopes(num_heads: int, device: str) -> torch.Tensor:
    return torch.tensor([2.0 ** (-8.0 * (h + 1) / num_heads) for h in range(num_heads)], device=device)


def check_paged_attention(
    tk, device: str, q_lens: list[int], seq_lens: list[int], num_heads: int, num_kv_heads: int,
    head_dim: int, page: int, dtype: torch.dtype, alibi: bool = False, num_splits: int | None = None,
    seed: int = 0, configs: tuple = (), block_n: int | None = None,
) -> None:
    q, kv_cache, meta = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, page, dtype, device, seed)
    slopes = alibi_slopes(num_heads, device) if alibi else None
    scale = head_dim ** -0.5
    if num_splits is not None or block_n is not None:  # a forced split-K + merge path or decode key tile
        decode = import_module("kvrelay.kernels.triton.decode_attention").decode_attention
        out = decode(q, kv_cache, meta, scale, slopes, num_splits=num_splits, block_n=block_n)
    else:
        out = tk.paged_attention(q, kv_cache, meta, scale, slopes)
    expected = reference.paged_attention(q.float(), kv_cache.float(), meta, scale, slopes)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_close(out, expected, dtype)
    if num_splits is None and not meta.decode_only:
        # this step's keys read from their own contiguous k/v (as the models pass them), not the cache
        k, v = fresh_kv(kv_cache, meta)
        assert_close(tk.paged_attention(q, kv_cache, meta, scale, slopes, k=k, v=v), expected, dtype)
    for config in configs:  # explicit prefill tilings (bench sweeps them; each must stay exact)
        prefill = import_module("kvrelay.kernels.triton.prefill_attention").prefill_attention
        k, v = fresh_kv(kv_cache, meta)
        assert_close(prefill(q, kv_cache, meta, scale, slopes, k, v, config=config), expected, dtype)


def fresh_kv(kv_cache: torch.Tensor, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, Hkv, D] keys and values of the step's tokens, gathered from their slots (strided views of a
    wider buffer, the way they come out of a fused qkv projection)."""
    page = kv_cache.shape[2]
    slots = meta.slot_mapping.long()
    kv = kv_cache[:, slots // page, slots % page]  # [2, T, Hkv, D]
    wide = torch.cat([kv[0], kv[1], kv[0]], dim=-1)  # [T, Hkv, 3D]
    d = kv_cache.shape[-1]
    return wide[..., :d], wide[..., d:2 * d]


def check_write_kv(tk, device: str, num_tokens: int, num_kv_heads: int, head_dim: int, page: int,
                   dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    num_blocks = -(-num_tokens // page) + 2
    slots = torch.randperm(num_blocks * page)[:num_tokens]
    slots[torch.rand(num_tokens) < 0.2] = -1  # padding tokens must not be written
    # k and v as strided views into a fused qkv projection output, the way models produce them
    qkv = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, device=device).to(dtype)
    k = qkv[:, num_kv_heads * head_dim: 2 * num_kv_heads * head_dim].view(num_tokens, num_kv_heads, head_dim)
    v = qkv[:, 2 * num_kv_heads * head_dim:].view(num_tokens, num_kv_heads, head_dim)
    cache = torch.randn(2, num_blocks, page, num_kv_heads, head_dim, device=device).to(cache_dtype)
    expected = cache.clone()
    slots = slots.to(device)
    tk.write_kv(k, v, cache, slots)
    reference.write_kv(k, v, expected, slots)
    assert torch.equal(cache, expected)


def check_rotary_write_kv(tk, device: str, tokens: int, heads: int, kv_heads: int, head_dim: int, page: int,
                          dtype: torch.dtype, cache_dtype: torch.dtype, layers: int = 3) -> None:
    """The fused rotary + KV write against rotary_embedding then write_kv, into one layer of a
    block-major pool ([N, L, 2, bs, Hkv, D] storage viewed as [L, 2, N, bs, Hkv, D]): every KV stride
    is non-contiguous, as the shared pool makes them, and the other layers must stay untouched."""
    max_pos = 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cs = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    num_blocks = -(-tokens // page) + 2
    slots = torch.randperm(num_blocks * page)[:tokens]
    slots[torch.rand(tokens) < 0.2] = -1
    slots = slots.to(device)
    positions = torch.randint(0, max_pos, (tokens,), device=device)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, device=device).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q = q.view(tokens, heads, head_dim)
    k = k.view(tokens, kv_heads, head_dim)
    v = v.view(tokens, kv_heads, head_dim)
    pool = torch.randn(num_blocks, layers, 2, page, kv_heads, head_dim, device=device).to(cache_dtype)
    caches = pool.permute(1, 2, 0, 3, 4, 5)  # [L, 2, N, bs, Hkv, D], strided
    expected = caches.clone()
    got_q, got_k = tk.rotary_write_kv(positions, q, k, v, cs, caches[1], slots)
    want_q, want_k = reference.rotary_write_kv(positions, q, k, v, cs, expected[1], slots)
    assert_close(got_q, want_q, dtype, scale=0.5)
    assert_close(got_k, want_k, dtype, scale=0.5)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[2], expected[2])
    # the stored k is the kernel's own rotated k, bit for bit; v is a plain copy
    keep = slots >= 0
    blocks, offs = slots[keep] // page, slots[keep] % page
    assert torch.equal(caches[1, 0, blocks, offs], got_k[keep].to(cache_dtype))
    assert torch.equal(caches[1, 1, blocks, offs], v[keep].to(cache_dtype))
    untouched = torch.ones(num_blocks * page, dtype=torch.bool, device=device)
    untouched[slots[keep]] = False
    flat = caches[1].reshape(2, num_blocks * page, kv_heads, head_dim)
    assert torch.equal(flat[:, untouched], expected[1].reshape(2, num_blocks * page, kv_heads, head_dim)[:, untouched])


def check_rotary_decode_attention(tk, device: str, seq_lens: list[int], heads: int, kv_heads: int, head_dim: int,
                                  rot_dim: int, page: int, dtype: torch.dtype, num_splits: int | None = None) -> None:
    """Rotary + KV write + decode attention in one kernel against the two ops in turn (reference rotary and
    write, attention in float32): q, k, v unrotated strided views of one qkv row per sequence, the step's
    token not yet in the cache; a padding row (slot -1) must store nothing."""
    q0, kv_cache, meta = make_paged_case([1] * len(seq_lens), seq_lens, heads, kv_heads, head_dim, page, dtype,
                                         device, seed=len(seq_lens) + rot_dim)
    gen = torch.Generator().manual_seed(7)
    n = len(seq_lens)
    qkv = torch.randn(n, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype).to(device)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = q.view(n, heads, head_dim), k.view(n, kv_heads, head_dim), v.view(n, kv_heads, head_dim)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.arange(4096, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cs = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(device)
    positions = meta.seq_lens.long() - 1
    meta.slot_mapping[-1] = -1  # the last row is padding: its token is not stored
    expected_cache = kv_cache.clone()
    want_q, want_k = reference.rotary_write_kv(positions, q, k, v, cs, expected_cache, meta.slot_mapping)
    scale = head_dim ** -0.5
    fused = import_module("kvrelay.kernels.triton.decode_attention").rotary_decode_attention
    out = fused(positions, q, k, v, cs, kv_cache, meta, scale, num_splits=num_splits)
    assert out.dtype == dtype and out.shape == (n, heads, head_dim)
    # the cache as the two ops leave it (rotation rounded to the input dtype, as the unfused kernel does)
    assert_close(kv_cache, expected_cache, dtype, scale=0.5)
    expected = reference.paged_attention(want_q.float(), kv_cache.float(), meta, scale)
    assert_close(out[:-1], expected[:-1], dtype)


def check_rms_norm(tk, device: str, rows: int, hidden: int, dtype: torch.dtype, residual: bool,
                   weight_dtype: torch.dtype | None = None) -> None:
    x = torch.randn(rows, hidden, device=device).to(dtype)
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(weight_dtype or dtype)
    res = torch.randn(rows, hidden, device=device).to(dtype) if residual else None
    x_before = x.clone()
    got = tk.rms_norm(x, w, 1e-6, res)
    want = reference.rms_norm(x, w, 1e-6, res)
    assert torch.equal(x, x_before), "inputs must not be modified"
    if residual:
        # the residual stream is a plain add: exact on the GPU; the interpreter's fp32->bf16 cast
        # truncates instead of rounding to nearest, so there it may differ by one ulp
        if device == "cpu":
            assert_close(got[1], want[1], dtype, scale=0.5)
        else:
            assert torch.equal(got[1], want[1])
        got, want = got[0], want[0]
    assert got.dtype == want.dtype
    assert_close(got, want, dtype, scale=0.5)  # x's dtype bounds the precision (normed is rounded to it)


def check_skinny_linear(tk, device: str, rows: int, n: int, k: int, dtype: torch.dtype, op: str, bias: bool) -> None:
    """The linear ops with a fused prologue (kernels/triton/skinny_linear.py: one row fused, more rows
    composed) against the reference ops; inputs are never modified."""
    w = (torch.randn(n, k, device=device) / k ** 0.5).to(dtype)
    b = (0.1 * torch.randn(n, device=device)).to(dtype) if bias else None
    x = torch.randn(rows, 2 * k if op == "silu_mul" else k, device=device).to(dtype)
    res = torch.randn(rows, k, device=device).to(dtype)
    nw = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    before = (x.clone(), res.clone())
    if op == "linear":
        got, want = tk.linear(x, w, b), reference.linear(x, w, b)
    elif op == "silu_mul":
        got, want = tk.silu_mul_linear(x, w, b), reference.silu_mul_linear(x, w, b)
    else:
        residual = res if op == "add_norm" else None
        (got, got_res), (want, want_res) = (mod.rms_norm_linear(x, residual, nw, 1e-5, w, b) for mod in (tk, reference))
        if device == "cpu":  # the interpreter's fp32 -> bf16 cast truncates (see check_rms_norm)
            assert_close(got_res, want_res, dtype, scale=0.5)
        else:
            assert torch.equal(got_res, want_res)
    assert torch.equal(x, before[0]) and torch.equal(res, before[1]), "inputs must not be modified"
    assert got.shape == want.shape and got.dtype == want.dtype
    # the fused input is rounded as the reference rounds it: only the summation order differs (the
    # interpreter's truncating bf16 casts excepted)
    assert_close(got, want, dtype, scale=1.0 if device == "cpu" and dtype == torch.bfloat16 else 0.25)


def check_layer_norm(tk, device: str, rows: int, hidden: int, dtype: torch.dtype, bias: bool) -> None:
    x = (3 + 2 * torch.randn(rows, hidden, device=device)).to(dtype)  # nonzero mean exercises centering
    w = (1 + 0.1 * torch.randn(hidden, device=device)).to(dtype)
    b = (0.1 * torch.randn(hidden, device=device)).to(dtype) if bias else None
    assert_close(tk.layer_norm(x, w, b, 1e-5), reference.layer_norm(x, w, b, 1e-5), dtype, scale=0.5)


def check_rotary(tk, device: str, tokens: int, heads: int, kv_heads: int, head_dim: int, rot_dim: int,
                 dtype: torch.dtype, cache_dtype: torch.dtype) -> None:
    max_pos = 4096
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rot_dim, 2, dtype=torch.float32) / rot_dim))
    freqs = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv_freq[None, :]
    cache = torch.cat((freqs.cos(), freqs.sin()), dim=-1).to(cache_dtype).to(device)  # [max_pos, rot_dim]
    positions = torch.randint(0, max_pos, (tokens,), device=device)
    q = torch.randn(tokens, heads, head_dim, device=device).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, device=device).to(dtype)
    gq, gk = tk.rotary_embedding(positions, q, k, cache)
    wq, wk = reference.rotary_embedding(positions, q, k, cache)
    assert_close(gq, wq, dtype, scale=0.5)
    assert_close(gk, wk, dtype, scale=0.5)
    assert torch.equal(gq[..., rot_dim:], q[..., rot_dim:])  # channels past rot_dim pass through


def check_silu_mul(tk, device: str, rows: int, inter: int, dtype: torch.dtype) -> None:
    x = (2 * torch.randn(rows, 2 * inter, device=device)).to(dtype)
    assert_close(tk.silu_mul(x), reference.silu_mul(x), dtype, scale=0.5)


def check_gelu(tk, device: str, numel: int, dtype: torch.dtype, approximate: str) -> None:
    x = (3 * torch.randn(numel, device=device)).to(dtype)
    x[:4] = torch.tensor([-60.0, 60.0, 0.0, -5.0])  # saturated tails must not turn into NaN
    x = x.view(-1, 7) if numel % 7 == 0 else x
    assert_close(tk.gelu(x, approximate), reference.gelu(x, approximate), dtype, scale=0.5)


def naive_filter(logits: torch.Tensor, top_k: list[int], top_p: list[float], min_p: list[float]) -> torch.Tensor:
    """Row-by-row restatement of the sampling semantics with python ints: the test's own oracle."""
    out = logits.clone()
    vocab = logits.shape[1]
    for i in range(logits.shape[0]):
        row = out[i]
        if 0 < top_k[i] <= vocab:
            row[row < row.sort(descending=True).values[top_k[i] - 1]] = float("-inf")
        if top_p[i] < 1:
            values = row.sort().values  # ascending
            cumulative = values.softmax(-1).cumsum(-1)
            drop = int(((cumulative <= 1 - top_p[i])[:-1]).sum())
            row[row < values[drop]] = float("-inf")
        if min_p[i] > 0:
            row[row < row.max() + torch.tensor(min_p[i]).log()] = float("-inf")
    return out


def check_sampling(tk, device: str, rows: int, vocab: int, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(device)
    logits[1, :5] = logits[1].max() + 1  # five-way tie at the top of a top-k=1 row: all five stay
    temps = [0.0 if i % 4 == 0 else 0.5 + 0.25 * (i % 3) for i in range(rows)]
    top_k = [[-1, 1, 5, vocab, 3][i % 5] for i in range(rows)]
    top_p = [[1.0, 0.9, 0.5, 1.0][i % 4] for i in range(rows)]
    min_p = [[0.0, 0.0, 0.1][i % 3] for i in range(rows)]
    noise = torch.empty(rows, vocab).exponential_(generator=gen).to(device)
    t = torch.tensor(temps, device=device)
    k = torch.tensor(top_k, device=device)
    p = torch.tensor(top_p, device=device)
    m = torch.tensor(min_p, device=device)
    ids = tk.sample_from_logits(logits, t, k, p, m, noise=noise)
    scaled = logits.float() / torch.tensor([x if x > 0 else 1.0 for x in temps], device=device)[:, None]
    filtered = naive_filter(scaled, top_k, top_p, min_p)
    want = (filtered.softmax(-1) / noise).argmax(-1)
    want = torch.where(t == 0, logits.argmax(-1), want)
    assert torch.equal(ids, want)
    # sort-free top-k (bounded topk) must agree with the sorting path
    bound = max(x for x in top_k if 0 < x < vocab)
    a = tk.filter_logits(scaled, top_k=k)
    b = tk.filter_logits(scaled, top_k=k, top_k_bound=bound)
    assert torch.equal(a, b) and torch.equal(a, naive_filter(scaled, top_k, [1.0] * rows, [0.0] * rows))
    # the exponential race draws from the filtered distribution
    probs = torch.tensor([2.0, 1.0, 0.5, 0.25]).log().to(device)
    many = probs.expand(20000, 4).contiguous()
    ones = torch.ones(20000, device=device)
    draws = tk.sample_from_logits(many, ones, top_k=torch.full((20000,), 3, device=device),
                                  generator=torch.Generator(device=device).manual_seed(seed))
    freq = torch.bincount(draws, minlength=4).float() / 20000
    torch.testing.assert_close(freq.cpu(), torch.tensor([4 / 7, 2 / 7, 1 / 7, 0.0]), atol=0.02, rtol=0)


def check_sampling_with_logit_bias(tk, device: str, rows: int, vocab: int, seed: int = 0) -> None:
    """logit_bias through the engine's Sampler: its torch path and its GPU path (``tk.sample_from_logits``)
    draw the same tokens from the same noise, and both equal a dense per-row oracle."""
    from kvrelay.shared.engine.request import Request
    from kvrelay.shared.engine.sampler import Sampler
    from kvrelay.shared.wire.sampling_params import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    logits = (3 * torch.randn(rows, vocab, generator=gen)).to(device)
    top = logits.argmax(-1).tolist()
    biases: list[dict[int, float] | None] = []
    for i in range(rows):
        bias = {t: rng.uniform(-5, 5) for t in rng.sample(range(vocab), 4)}
        if i % 3 == 1:
            bias[top[i]] = -100.0  # banned: the argmax moves
        elif i % 3 == 2:
            bias[rng.randrange(vocab)] = 100.0  # forced, whatever the filters
        biases.append(bias if i % 5 else None)
    temps = [0.0 if i % 4 == 0 else 0.5 + 0.25 * (i % 3) for i in range(rows)]
    top_k = [[-1, 1, 5, vocab, 3][i % 5] for i in range(rows)]
    top_p = [[1.0, 0.9, 0.5, 1.0][i % 4] for i in range(rows)]
    min_p = [[0.0, 0.0, 0.1][i % 3] for i in range(rows)]
    requests = [Request(f"r{i}", [0], SamplingParams(temperature=temps[i], top_k=top_k[i], top_p=top_p[i],
                                                     min_p=min_p[i], seed=i, logit_bias=biases[i]))
                for i in range(rows)]
    greedy = [t == 0 for t in temps]

    dense = logits.float().clone()
    for i, bias in enumerate(biases):
        for t, v in (bias or {}).items():
            dense[i, t] += v
    torch_sampler, gpu_sampler = Sampler(seed=seed), Sampler(seed=seed)
    biased = torch_sampler._penalize(logits.float(), requests)
    assert torch.equal(biased, dense)

    sampled = torch_sampler._sample(biased, requests, greedy)
    torch_ids = torch.where(torch.tensor(greedy, device=device), biased.argmax(-1), sampled)
    gpu_ids = gpu_sampler._sample_on_gpu(gpu_sampler._penalize(logits.float(), requests), requests, greedy)
    assert torch.equal(torch_ids, gpu_ids)

    noise = Sampler(seed=seed)._noise(requests, greedy, logits.shape, logits.device).clamp(min=torch.finfo().tiny)
    scaled = dense / torch.tensor([t if t > 0 else 1.0 for t in temps], device=device)[:, None]
    want = (naive_filter(scaled, top_k, top_p, min_p).softmax(-1) / noise).argmax(-1)
    want = torch.where(torch.tensor(greedy, device=device), dense.argmax(-1), want)
    assert torch.equal(gpu_ids, want)
    assert torch.equal(tk.sample_from_logits(dense, torch.tensor(temps, device=device), torch.tensor(top_k, device=device),
                                             torch.tensor(top_p, device=device), torch.tensor(min_p, device=device),
                                             noise=noise), want)
    for i, bias in enumerate(biases):
        if bias and i % 3 == 1 and greedy[i]:
            assert want[i] != top[i]
        if bias and i % 3 == 2:
            assert want[i] == max(bias, key=bias.get)
