"""What changes the logits before sampling: penalties by hand, min_tokens, logit_bias and allowed_token_ids."""

import pytest
import torch

from kvrelay.shared.engine.logits_processors import (
    apply_allowed_tokens,
    apply_logit_bias,
    apply_min_tokens,
    apply_penalties,
    logit_bias_tensors,
)
from kvrelay.shared.engine.sampler import Sampler
from tests.unit.sampler_requests import DEVICES, make_request


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
