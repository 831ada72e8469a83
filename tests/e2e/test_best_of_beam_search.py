"""best_of and beam search on SmolLM2 served by a real gateway and worker: best_of returns the most likely of
the samples n would return, and the gateway's beam search finds the offline engine's beams."""

import pytest

from kvrelay.shared.wire.sampling_params import SamplingParams
from tests.e2e.request_fields import BASE, MODEL, SAMPLED, choice_text, ok


@pytest.mark.parametrize("endpoint", list(BASE))
def test_best_of_returns_the_most_likely_samples(fields_http, endpoint):
    """Choice i of a seeded request is sampled with seed + i, so n=4 shows the four samples best_of=4 ranks:
    it returns the two whose tokens' logprobs sum highest."""
    body = {**BASE[endpoint], **SAMPLED, "max_tokens": 8}
    asked = {"logprobs": 0} if endpoint == "completions" else {"logprobs": True}
    samples = ok(fields_http, {**body, **asked, "n": 4}).json()["choices"]

    def score(choice: dict) -> float:
        lp = choice["logprobs"]
        return sum(lp["token_logprobs"]) if endpoint == "completions" else sum(e["logprob"] for e in lp["content"])

    best = sorted(samples, key=score, reverse=True)[:2]
    out = ok(fields_http, {**body, "best_of": 4, "n": 2}).json()
    assert [choice_text(c) for c in out["choices"]] == [choice_text(c) for c in best]
    assert all(c["logprobs"] is None for c in out["choices"])
    assert len({choice_text(c) for c in samples}) > 1  # they differ


@pytest.mark.parametrize("length_penalty", [1.0, 0.5])
def test_beam_search_answers_as_the_offline_engine(fields_http, smollm2_dir, length_penalty):
    """The gateway's search over the worker (one job per beam and step) finds the beams the offline LLM's
    search over its engine finds: same model, same scoring."""
    from kvrelay.llm import LLM

    prompt = BASE["completions"]["prompt"]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "use_beam_search": True, "n": 2, "best_of": 3,
            "length_penalty": length_penalty}
    served = ok(fields_http, body).json()["choices"]
    llm = LLM(str(smollm2_dir), dtype="float32", max_model_len=512, block_size=4, num_gpu_blocks=512, device="cpu")
    offline = llm.generate(prompt, SamplingParams(use_beam_search=True, n=2, beam_width=3, max_tokens=8,
                                                  length_penalty=length_penalty))[0].outputs
    assert [c["text"] for c in served] == [o.text for o in offline]
    assert [c["finish_reason"] for c in served] == [o.finish_reason for o in offline]
