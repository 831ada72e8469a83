"""The offline API (``from kvrelay import LLM, SamplingParams``): vLLM's output shape, sampling
features end to end, beam search against HF, and bad input rejected without harming the engine."""

import pytest
import torch

from kvrelay import LLM, SamplingParams
from tests.conftest import random_prompts


@pytest.fixture(scope="module")
def llm(tiny_model_dirs):
    return LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, block_size=8)


def _ids(prompts):
    return [{"prompt_token_ids": p} for p in prompts]


def test_n_and_seed_reproducible_whatever_the_batch(llm):
    prompt = random_prompts(1, seed=11)[0]
    params = SamplingParams(n=3, temperature=1.0, seed=1234, max_tokens=10, ignore_eos=True)
    alone = llm.generate(_ids([prompt]), params)[0]
    assert len(alone.outputs) == 3 and [o.index for o in alone.outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in alone.outputs}) > 1  # children draw differently
    crowd = _ids(random_prompts(5, seed=12)) + _ids([prompt])
    mixed = llm.generate(crowd, [SamplingParams(temperature=0.8, max_tokens=7)] * 5 + [params])[-1]
    assert [o.token_ids for o in mixed.outputs] == [o.token_ids for o in alone.outputs]
    other_seed = llm.generate(_ids([prompt]), SamplingParams(n=3, seed=99, max_tokens=10, ignore_eos=True))[0]
    assert [o.token_ids for o in other_seed.outputs] != [o.token_ids for o in alone.outputs]


def test_logit_bias_reaches_every_child_of_n(llm):
    prompt = random_prompts(1, seed=13)[0]
    plain = llm.generate(_ids([prompt]), SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True))
    forced = llm.generate(_ids([prompt]), SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=4, ignore_eos=True,
                                                         logit_bias={300: 100.0}))
    assert [o.token_ids for o in forced[0].outputs] == [[300] * 4] * 2
    assert all(o.token_ids != [300] * 4 for o in plain[0].outputs)


def test_logprobs_and_prompt_logprobs_match_hf(llm, tiny_model_dirs):
    from transformers import AutoModelForCausalLM

    prompt = random_prompts(1, lo=20, hi=20, seed=5)[0]
    out = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=3, logprobs=5,
                                                       prompt_logprobs=2))[0]
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs["llama"], torch_dtype=torch.float32)
    full = prompt + out.outputs[0].token_ids
    with torch.no_grad():
        logp = torch.log_softmax(hf(torch.tensor([full])).logits[0].float(), -1)
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    for pos in range(1, len(prompt)):
        entry = out.prompt_logprobs[pos]
        assert entry[prompt[pos]].logprob == pytest.approx(logp[pos - 1, prompt[pos]].item(), abs=1e-4)
        assert len(entry) in (2, 3)  # top-2 plus the actual token when it is not among them
        # the prompt token's rank is its place in the whole vocabulary, by hand from the full log-softmax
        # (a band of 1e-4 for float error between the two implementations)
        row, lp = logp[pos - 1], logp[pos - 1, prompt[pos]].item()
        assert int((row > lp + 1e-4).sum()) + 1 <= entry[prompt[pos]].rank <= int((row >= lp - 1e-4).sum())
        alternatives = [(t, e.rank) for t, e in entry.items() if t != prompt[pos]]
        want = torch.topk(row, 2).indices.tolist()
        assert alternatives == [(t, want.index(t) + 1) for t in want if t != prompt[pos]]
    for i, (tok, entry) in enumerate(zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)):
        row = logp[len(prompt) - 1 + i]
        assert entry[tok].logprob == pytest.approx(row[tok].item(), abs=1e-4)
        top = torch.topk(row, 5).indices.tolist()
        assert set(top) <= set(entry)
    assert out.outputs[0].cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.outputs[0].token_ids, out.outputs[0].logprobs, strict=True)))


def test_max_min_tokens_and_stop_token_ids(llm):
    prompt = random_prompts(1, seed=3)[0]
    greedy = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    toks = greedy.outputs[0].token_ids
    assert len(toks) == 8 and greedy.outputs[0].finish_reason == "length"
    stop_at = toks[3]
    first = toks.index(stop_at)
    stopped = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=8, stop_token_ids=[stop_at]))[0]
    assert stopped.outputs[0].token_ids == toks[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == stop_at
    held = llm.generate(_ids([prompt]), SamplingParams(temperature=0.0, max_tokens=8, min_tokens=first + 2,
                                                       stop_token_ids=[stop_at]))[0]
    assert len(held.outputs[0].token_ids) >= first + 2


def test_generate_stream_yields_deltas(llm):
    prompts = random_prompts(3, seed=21)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    whole = {tuple(o.prompt_token_ids): o.outputs[0].token_ids for o in llm.generate(_ids(prompts), params)}
    pieces: dict[tuple, list[int]] = {}
    finished = set()
    for out in llm.generate_stream(_ids(prompts), params):
        for delta in out.outputs:
            assert len(delta.token_ids) <= 1
            pieces.setdefault(tuple(out.prompt_token_ids), []).extend(delta.token_ids)
        if out.finished:
            finished.add(out.request_id)
    assert pieces == whole and len(finished) == 3


@pytest.mark.parametrize("kwargs, field", [
    (dict(temperature=-0.1), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(n=0), "n"), (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=5, max_tokens=2), "min_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(logit_bias={5: 100.5}), "logit_bias"), (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={t: 1.0 for t in range(301)}), "logit_bias"),
    # beam search ranks beams by raw logprobs, which a bias does not touch: refused, not ignored
    (dict(use_beam_search=True, max_tokens=4, logit_bias={5: 1.0}), "logit_bias"),
])
def test_bad_sampling_params(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_bad_prompts_leave_engine_healthy(llm):
    core = llm.engine.core
    with pytest.raises(ValueError, match=r"200.*max_model_len is 128"):
        llm.generate(_ids([[5] * 200]), SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(_ids([[5, 512]]), SamplingParams())
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate(_ids([[5, 6], [-1]]), SamplingParams())
    with pytest.raises(ValueError, match="empty"):
        llm.generate(_ids([[]]), SamplingParams())
    with pytest.raises(ValueError, match="logit_bias token id 512 is outside the vocabulary"):
        llm.generate(_ids([[5, 6]]), SamplingParams(logit_bias={3: 1.0, 512: -100.0}))
    assert not core.has_unfinished() and core.num_free_blocks == core.num_total_blocks
    ok = llm.generate(_ids([[5, 6, 7]]), SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert len(ok.outputs[0].token_ids) == 3


def test_kv_cache_too_small_fails_at_start(tiny_model_dirs):
    with pytest.raises(ValueError, match="KV cache too small"):
        LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, block_size=8, num_gpu_blocks=4)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_beam_search_best_beam_equals_hf(tiny_model_dirs, arch):
    from transformers import AutoModelForCausalLM

    llm = LLM(model=str(tiny_model_dirs[arch]), dtype="float32", max_model_len=128, block_size=8)
    hf = AutoModelForCausalLM.from_pretrained(tiny_model_dirs[arch], torch_dtype=torch.float32).eval()
    for prompt in random_prompts(3, lo=5, hi=15, seed=31):
        ids = torch.tensor([prompt])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, num_beams=3,
                              max_new_tokens=6, eos_token_id=2, pad_token_id=0, length_penalty=1.0)
        ref_tokens = ref[0, len(prompt):].tolist()
        if 2 in ref_tokens:
            ref_tokens = ref_tokens[: ref_tokens.index(2) + 1]
        ours = llm.generate(_ids([prompt]), SamplingParams(use_beam_search=True, beam_width=3, max_tokens=6))[0]
        assert ours.outputs[0].token_ids == ref_tokens


def test_priority_policy_runs_urgent_requests_first(tiny_model_dirs):
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128, block_size=8,
              max_num_seqs=1, scheduling_policy="priority")
    finished_order = []
    prompts = _ids(random_prompts(4, seed=41))
    ids = llm.engine._add_all(prompts, SamplingParams(max_tokens=3, ignore_eos=True), priority=[5, 1, 3, 0])
    while llm.engine.has_unfinished():
        finished_order += [o.request_id for o in llm.engine.step() if o.finished]
    assert finished_order == [ids[3], ids[1], ids[2], ids[0]]


def test_a_priority_under_first_come_first_served_is_refused(tiny_model_dirs):
    """Under the default policy a priority would be accepted and ignored: refused, as vLLM does, before any work."""
    llm = LLM(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=64, block_size=8)
    with pytest.raises(ValueError, match="scheduling_policy='priority'"):
        llm.generate(_ids(random_prompts(2, seed=3)), SamplingParams(max_tokens=2), priority=[0, 1])
    assert not llm.engine.has_unfinished()
    assert len(llm.generate(_ids(random_prompts(2, seed=3)), SamplingParams(max_tokens=2), priority=[0, 0])) == 2
