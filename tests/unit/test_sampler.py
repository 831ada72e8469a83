"""Sampler: filters against a per-row reference, penalties by hand, seeded reproducibility, logprobs."""

import math

import pytest
import torch

import kvrelay.shared.engine.logprobs as logprobs_module
from kvrelay.shared.engine.logits_processors import (
    apply_allowed_tokens,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    apply_top_k_top_p_min_p,
    logit_bias_tensors,
)
from kvrelay.shared.engine.logprobs import prompt_logprobs
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.sampler import Sampler
from kvrelay.shared.wire.sampling_params import SamplingParams

NEG_INF = float("-inf")

DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")],
    ),
]


def make_request(
    request_id: str = "r", prompt: list[int] | None = None, eos: int | None = None, **params: object
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt or [0]),
        sampling_params=SamplingParams(**params),
        eos_token_id=eos,
    )


# ---------------------------------------------------------------------------------------------------
# top-k / top-p / min-p


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


# ---------------------------------------------------------------------------------------------------
# penalties and min_tokens


def test_penalties_hand_computed() -> None:
    row = [2.0, -1.0, 0.5, -0.5, 3.0, 0.0]
    logits = torch.tensor([row, row, row])  # [3, 6]
    prompts = [[0, 1], [0, 1], [0, 1]]
    outputs = [[2, 2, 3], [2, 2, 3], [2, 2, 3, 3, 3]]
    got = apply_penalties(
        logits,
        prompts,
        outputs,
        repetition_penalty=torch.tensor([2.0, 1.0, 1.0]),
        frequency_penalty=torch.tensor([0.5, 0.0, 0.1]),
        presence_penalty=torch.tensor([0.25, 0.0, -0.5]),
    )
    want = torch.tensor(
        [
            # 0: prompt, positive -> /2; 1: prompt, negative -> *2; 2: output x2 -> 0.5/2 - 2*0.5 - 0.25;
            # 3: output x1 -> -0.5*2 - 0.5 - 0.25; 4, 5: unseen.
            [1.0, -2.0, -1.0, -1.75, 3.0, 0.0],
            row,  # neutral penalties leave the row alone
            # frequency 0.1, presence -0.5 (a bonus): 2: 0.5 - 0.2 + 0.5; 3: -0.5 - 0.3 + 0.5.
            [2.0, -1.0, 0.8, -0.3, 3.0, 0.0],
        ]
    )
    torch.testing.assert_close(got, want)


def test_apply_min_tokens_ignores_out_of_range_ids() -> None:
    logits = torch.zeros(2, 4)
    got = apply_min_tokens(logits, [[1, 3, 99], []])
    assert torch.isinf(got).tolist() == [[False, True, False, True], [False, False, False, False]]


def test_min_tokens_masks_eos_and_stop_ids_only_until_reached() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0, 5.0, 9.0]])  # eos (4) best, then stop id 3, then 2
    request = make_request(eos=4, temperature=0.0, min_tokens=2, stop_token_ids=[3])
    sampler = Sampler(seed=0)
    assert sampler(logits, [request])[0].token_id == 2
    request.output_token_ids.append(2)
    assert sampler(logits, [request])[0].token_id == 2
    request.output_token_ids.append(2)
    assert sampler(logits, [request])[0].token_id == 4  # min_tokens reached: eos allowed again
    ignoring = make_request(eos=4, temperature=0.0, ignore_eos=True)
    assert sampler(logits, [ignoring])[0].token_id == 4  # ignore_eos is the scheduler's business


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.9, 0.0]])  # [1, 4]
    plain = make_request("a", prompt=[0], temperature=0.0)
    plain.output_token_ids = [1]
    presence = make_request("b", prompt=[0], temperature=0.0, presence_penalty=0.5)
    presence.output_token_ids = [1]
    repetition = make_request("c", prompt=[1], temperature=0.0, repetition_penalty=1.2)
    out = Sampler(seed=0)(logits.repeat(3, 1), [plain, presence, repetition])
    assert [r.token_id for r in out] == [1, 2, 2]


def test_apply_logit_bias_hand_computed() -> None:
    logits = torch.arange(12, dtype=torch.float32).view(3, 4)  # [3, 4]
    got = apply_logit_bias(logits, [logit_bias_tensors({1: -100.0, 3: 0.5}), None,
                                    logit_bias_tensors({0: 100.0, 7: 5.0, -1: 5.0})])
    want = torch.tensor([[0.0, -99.0, 2.0, 3.5], [4.0, 5.0, 6.0, 7.0], [108.0, 9.0, 10.0, 11.0]])
    torch.testing.assert_close(got, want)  # ids outside [0, V) are dropped, never wrapped into another row
    assert logits[0, 1] == 1.0  # a new tensor: the model's logits are left alone


@pytest.mark.parametrize("device", DEVICES)
def test_logit_bias_bans_and_forces_in_greedy_and_sampled_rows(device: str) -> None:
    gen = torch.Generator().manual_seed(5)
    logits = torch.randn(6, 50, generator=gen).to(device)  # [6, 50]
    top = logits.argmax(dim=-1).tolist()
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    weakest = logits.argmin(dim=-1).tolist()
    requests = [
        make_request("ban-greedy", temperature=0.0, logit_bias={top[0]: -100}),
        make_request("force-greedy", temperature=0.0, logit_bias={weakest[1]: 100}),
        make_request("plain-greedy", temperature=0.0),
        make_request("force-sampled", temperature=1.0, seed=1, logit_bias={weakest[3]: 100}),
        make_request("ban-top-k", temperature=1.0, top_k=1, seed=2, logit_bias={top[4]: -100}),
        make_request("force-top-p", temperature=0.7, top_p=0.5, logit_bias={weakest[5]: 100.0}),
    ]
    out = [r.token_id for r in Sampler(seed=0)(logits, requests)]
    assert out == [second[0], weakest[1], top[2], weakest[3], second[4], weakest[5]]


def test_logit_bias_tensors_are_kept_per_request_until_free() -> None:
    logits = torch.zeros(1, 4)
    sampler = Sampler(seed=0)
    first = make_request("a", temperature=0.0, logit_bias={2: 1.0})
    assert sampler(logits, [first])[0].token_id == 2
    kept = sampler._biases["a"]
    assert sampler(logits, [first])[0].token_id == 2 and sampler._biases["a"] is kept
    reused = make_request("a", temperature=0.0, logit_bias={3: 1.0})  # same id, other params
    assert sampler(logits, [reused])[0].token_id == 3
    sampler.free("a")
    assert "a" not in sampler._biases


def test_logprobs_stay_raw_under_logit_bias() -> None:
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    biased = make_request(temperature=0.0, logprobs=1, logit_bias={0: 100})
    res = Sampler(seed=0)(logits, [biased])[0]
    raw = logits.log_softmax(dim=-1)[0]
    assert res.token_id == 0  # the bias chose it ...
    assert res.logprob == pytest.approx(raw[0].item())  # ... its logprob is the model's, as for penalties
    assert res.top_logprobs[0][0] == 1


# ---------------------------------------------------------------------------------------------------
# greedy, seeds, distribution


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_argmax_next_to_sampled_rows(device: str) -> None:
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(16, 100, generator=gen).to(device)  # [16, 100]
    requests = [
        make_request(f"r{i}", temperature=0.0 if i % 2 == 0 else 1.5, top_k=-1 if i % 4 else 5) for i in range(16)
    ]
    sampler = Sampler(seed=3)
    expected = logits.argmax(dim=-1).tolist()
    sampled_differs = False
    for _ in range(5):
        out = sampler(logits, requests)
        for i, res in enumerate(out):
            if i % 2 == 0:
                assert res.token_id == expected[i]
            elif res.token_id != expected[i]:
                sampled_differs = True
    assert sampled_differs  # the temperature-1.5 rows really sample


def _step_logits(step: int, vocab: int) -> torch.Tensor:
    """The target request's logits at a step: fixed, so only the batch around it changes."""
    return torch.randn(vocab, generator=torch.Generator().manual_seed(1000 + step)) * 0.5  # [V]


def _run_seeded(
    seed: int, layout: list[str], sampler_seed: int, steps: int = 8, vocab: int = 500, device: str = "cpu"
) -> list[int]:
    """Generate ``steps`` tokens for request "target" inside a batch laid out as ``layout``.

    Layout entries: "target", "seeded" (another seeded request), "free" (unseeded); others get noise.
    """
    sampler = Sampler(seed=sampler_seed)
    target = make_request("target", seed=seed, temperature=0.9, top_p=0.95, presence_penalty=0.3)
    others = {
        i: make_request(f"o{i}", seed=77 + i if kind == "seeded" else None, temperature=1.0)
        for i, kind in enumerate(layout)
        if kind != "target"
    }
    noise = torch.Generator().manual_seed(sampler_seed + 5)
    for step in range(steps):
        rows, batch = [], []
        for i, kind in enumerate(layout):
            if kind == "target":
                rows.append(_step_logits(step, vocab))
                batch.append(target)
            else:
                rows.append(torch.randn(vocab, generator=noise))
                batch.append(others[i])
        out = sampler(torch.stack(rows).to(device), batch)  # [S, V]
        for req, res in zip(batch, out, strict=True):
            req.output_token_ids.append(res.token_id)
    return target.output_token_ids


@pytest.mark.parametrize("device", DEVICES)
def test_seeded_request_is_independent_of_batch_composition(device: str) -> None:
    alone = _run_seeded(42, ["target"], sampler_seed=0, device=device)
    layouts = [
        ["free", "target", "seeded"],
        ["seeded", "seeded", "free", "free", "target"],
        ["target", "free"],
    ]
    for n, layout in enumerate(layouts):
        assert _run_seeded(42, layout, sampler_seed=10 + n, device=device) == alone
    assert _run_seeded(43, ["target"], sampler_seed=0, device=device) != alone


def test_free_drops_the_generator_so_a_new_request_restarts_the_stream() -> None:
    logits = _step_logits(0, 500).unsqueeze(0)  # [1, V]
    sampler = Sampler()
    first = [sampler(logits, [make_request("x", seed=5)])[0].token_id for _ in range(6)]
    assert len(set(first)) > 1  # the generator advances between steps
    sampler.free("x")
    again = [sampler(logits, [make_request("x", seed=5)])[0].token_id for _ in range(6)]
    assert again == first


def _chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# 99.9th percentile of chi-square with 4 degrees of freedom: a correct sampler fails ~1 run in 1000,
# and with fixed seeds the outcome is deterministic.
CHI2_DF4_P999 = 18.47


@pytest.mark.parametrize("seeded", [False, True])
def test_sampled_frequencies_match_distribution(seeded: bool) -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    rows = 4000
    logits = probs.log().repeat(rows, 1)  # [rows, 5]
    requests = [make_request(f"r{i}", seed=i if seeded else None) for i in range(rows)]
    out = Sampler(seed=123)(logits, requests)
    counts = torch.bincount(torch.tensor([r.token_id for r in out]), minlength=5).float()
    assert _chi_square(counts, probs) < CHI2_DF4_P999


def test_temperature_and_top_k_reshape_the_distribution() -> None:
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])
    rows = 4000
    logits = probs.log().repeat(rows, 1)  # [rows, 5]
    sharpened = probs**2 / (probs**2).sum()  # temperature 0.5 squares the probabilities
    out = Sampler(seed=7)(logits, [make_request(f"t{i}", temperature=0.5) for i in range(rows)])
    counts = torch.bincount(torch.tensor([r.token_id for r in out]), minlength=5).float()
    assert _chi_square(counts, sharpened) < CHI2_DF4_P999
    out = Sampler(seed=8)(logits, [make_request(f"k{i}", top_k=2) for i in range(rows)])
    counts = torch.bincount(torch.tensor([r.token_id for r in out]), minlength=5).float()
    assert counts[2:].sum() == 0
    # two categories (1 degree of freedom): 99.9th percentile 10.83
    assert _chi_square(counts[:2], torch.tensor([4 / 7, 3 / 7])) < 10.83


# ---------------------------------------------------------------------------------------------------
# logprobs


def test_logprobs_are_raw_and_top_alternatives_sorted() -> None:
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(4, 50, generator=gen)  # [4, 50]
    requests = [
        make_request("a", temperature=0.7, top_k=10, repetition_penalty=1.3, logprobs=5),
        make_request("b", temperature=0.0, logprobs=0),
        make_request("c", temperature=1.0),
        make_request("d", temperature=1.0, min_p=0.1, logprobs=3, seed=9),
    ]
    requests[0].output_token_ids = [int(logits[0].argmax())]
    raw = torch.log_softmax(logits, dim=-1)
    out = Sampler(seed=0)(logits, requests)
    for i, res in enumerate(out):
        assert math.isclose(res.logprob, float(raw[i, res.token_id]), rel_tol=0, abs_tol=1e-6)
    assert out[1].top_logprobs == []
    assert out[2].top_logprobs is None
    for res, k, i in ((out[0], 5, 0), (out[3], 3, 3)):
        assert res.top_logprobs is not None and len(res.top_logprobs) == k
        values = [lp for _, lp in res.top_logprobs]
        assert values == sorted(values, reverse=True)
        want_ids = raw[i].topk(k).indices.tolist()
        assert [t for t, _ in res.top_logprobs] == want_ids
        for token, lp in res.top_logprobs:
            assert math.isclose(lp, float(raw[i, token]), abs_tol=1e-6)


@pytest.mark.parametrize("chunk_elements", [1 << 26, 7])
def test_prompt_logprobs(monkeypatch: pytest.MonkeyPatch, chunk_elements: int) -> None:
    monkeypatch.setattr(logprobs_module, "_PROMPT_LOGPROBS_CHUNK_ELEMENTS", chunk_elements)
    logits = torch.tensor(
        [
            [0.0, 1.0, 2.0, 3.0],
            [3.0, 0.0, 0.0, 0.0],
            [1.0, 1.0, 5.0, 0.0],
        ]
    )  # [3, 4]
    raw = torch.log_softmax(logits, dim=-1)
    out = prompt_logprobs(logits, [0, 0, 3], k=2)
    assert list(out[0]) == [0, 3, 2]  # actual token first, then the top 2
    assert list(out[1])[0] == 0 and len(out[1]) == 2  # actual is top-1; one of the tied zeros is second
    assert list(out[2])[0] == 3 and 2 in out[2] and len(out[2]) == 3
    for j, entry in enumerate(out):
        for token, lp in entry.items():
            assert math.isclose(lp.logprob, float(raw[j, token]), abs_tol=1e-6)
    # ranks by hand: row 0 has 0 < 1 < 2 < 3, so token 0 is 4th; row 2's token 3 is below 2 and the tied 0, 1
    assert [lp.rank for lp in out[0].values()] == [4, 1, 2]
    assert out[1][0].rank == 1 and list(out[1].values())[1].rank == 2
    assert out[2][3].rank == 4 and out[2][2].rank == 1
    bare = prompt_logprobs(logits, [1, 2, 3], k=0)
    assert [{t: (lp.logprob, lp.rank) for t, lp in e.items()} for e in bare] == [
        {1: (pytest.approx(float(raw[0, 1])), 3)},
        {2: (pytest.approx(float(raw[1, 2])), 4)},  # tied with 1 and 3: vLLM counts every token at least as likely
        {3: (pytest.approx(float(raw[2, 3])), 4)},
    ]


def test_rejects_mismatched_rows() -> None:
    with pytest.raises(ValueError):
        Sampler()(torch.zeros(2, 4), [make_request()])
    with pytest.raises(ValueError):
        prompt_logprobs(torch.zeros(2, 4), [1], k=1)


def test_allowed_token_ids_mask_every_other_token() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    allowed = [3, 17, 41]
    reqs = [make_request(f"a{i}", temperature=t, allowed_token_ids=allowed, seed=i)
            for i, t in enumerate((0.0, 1.0, 2.0))] + [make_request("free", temperature=0.0)]
    sampler = Sampler(seed=1)
    for _ in range(20):
        out = sampler(logits, reqs)
        assert all(r.token_id in allowed for r in out[:3])
    assert out[0].token_id == max(allowed, key=lambda t: float(logits[0, t]))  # greedy: the best allowed one
    assert out[3].token_id == int(logits[3].argmax())  # a row without the field is untouched
    masked = apply_allowed_tokens(logits, [torch.tensor(allowed), None, None, None])
    assert torch.isinf(masked[0]).sum() == 50 - len(allowed) and torch.equal(masked[1:], logits[1:])
    # out-of-vocabulary ids are dropped, not written into another row
    masked = apply_allowed_tokens(logits, [torch.tensor([3, 50, 120]), None, None, None])
    assert torch.isfinite(masked[0]).sum() == 1 and torch.equal(masked[1:], logits[1:])


def test_logprobs_of_minus_one_cover_the_whole_vocabulary() -> None:
    torch.manual_seed(1)
    logits = torch.randn(2, 30)
    raw = torch.log_softmax(logits, dim=-1)
    out = Sampler()(logits, [make_request("all", temperature=0.0, logprobs=-1), make_request("two", logprobs=2)])
    assert [t for t, _ in out[0].top_logprobs] == raw[0].argsort(descending=True).tolist()
    assert len(out[1].top_logprobs) == 2
    entries = prompt_logprobs(logits, [4, 9], k=-1)
    assert all(len(e) == 30 for e in entries)
    assert sorted(lp.rank for lp in entries[0].values() if lp is not entries[0][4]) == \
        [r for r in range(1, 31) if r != entries[0][4].rank]
