"""Sampler logprobs: raw (before any processor) and sorted, prompt logprobs and their ranks, the whole
vocabulary for -1."""

import math

import pytest
import torch

import kvrelay.shared.engine.logprobs as logprobs_module
from kvrelay.shared.engine.logprobs import prompt_logprobs
from kvrelay.shared.engine.sampler import Sampler
from tests.unit.sampler_requests import make_request


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
