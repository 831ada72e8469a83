"""Logprob fields on SmolLM2 served by a real gateway and worker: prompt_logprobs rank the prompt token in
the whole vocabulary (the best k ranked 1..k), echo gives the prompt tokens their logprobs (streamed too), and
-1 asks for the whole vocabulary."""

import pytest

from tests.e2e.request_fields import BASE, MODEL, PARIS, VOCAB, ok, post, prompt_logprobs, sse_events


@pytest.mark.parametrize("endpoint", list(BASE))
def test_prompt_logprobs_rank_the_prompt_token_in_the_whole_vocabulary(fields_http, endpoint):
    entries = prompt_logprobs(ok(fields_http, {**BASE[endpoint], "prompt_logprobs": 3}))
    assert entries[0] is None
    prompt_ids = fields_http.post("/tokenize", json={"model": MODEL, **({"prompt": BASE[endpoint]["prompt"]}
                           if endpoint == "completions" else {"messages": BASE[endpoint]["messages"]})}).json()["tokens"]
    assert len(entries) == len(prompt_ids)
    unlikely = 0
    for position, token in zip(entries[1:], prompt_ids[1:], strict=True):
        own = position[str(token)]
        assert list(position)[0] == str(token)  # the prompt token first, as vLLM orders them
        best = sorted(((e["logprob"], t) for t, e in position.items() if t != str(token)), reverse=True)
        ranked = [position[t]["rank"] for _, t in best]
        if own["rank"] <= 3:  # among the best three: it holds its own rank, the others the remaining ones
            assert sorted(ranked + [own["rank"]]) == [1, 2, 3]
        else:  # below them: the best three are 1..3, each at least as likely as the prompt token
            unlikely += 1
            assert ranked == [1, 2, 3] and all(lp >= own["logprob"] for lp, _ in best)
    assert unlikely, "every prompt token was among the model's best three: the prompt shows no true rank"


def test_echo_with_logprobs_gives_the_prompt_tokens_their_logprobs(fields_http):
    body = {**BASE["completions"], "max_tokens": 2, "logprobs": 2}
    echoed = ok(fields_http, {**body, "echo": True}).json()["choices"][0]
    plain = ok(fields_http, {**body, "prompt_logprobs": 2}).json()["choices"][0]
    prompt = BASE["completions"]["prompt"]
    assert echoed["text"] == prompt + plain["text"]
    n = len(plain["prompt_logprobs"])
    lp = echoed["logprobs"]
    assert lp["tokens"][n:] == plain["logprobs"]["tokens"] and lp["token_logprobs"][0] is None
    for i, entry in enumerate(plain["prompt_logprobs"][1:], start=1):
        own = next(iter(entry.values()))  # the prompt token first
        assert lp["token_logprobs"][i] == pytest.approx(own["logprob"], abs=1e-5)
        assert lp["tokens"][i] == own["decoded_token"]
    assert lp["text_offset"][n] == len(prompt)
    # streamed (vLLM's way): the prompt and its logprobs lead the first chunk; joined, the whole reply
    streamed = post(fields_http, {**body, "echo": True, "stream": True})
    chunks = [e["choices"][0] for e in sse_events(streamed)]
    assert chunks[0]["text"].startswith(prompt) and chunks[0]["logprobs"]["token_logprobs"][0] is None
    assert "".join(c["text"] for c in chunks) == echoed["text"]
    joined = {key: [v for c in chunks for v in c["logprobs"][key]] for key in lp}
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    assert joined["token_logprobs"] == pytest.approx(lp["token_logprobs"], abs=1e-4)
    assert [t and sorted(t) for t in joined["top_logprobs"]] == [t and sorted(t) for t in lp["top_logprobs"]]


def test_logprobs_of_minus_one_are_the_whole_vocabulary(fields_http):
    """With --max-logprobs -1 (the default 20 refuses it: tests/integration/test_openai_fields.py)."""
    body = {**BASE["completions"], "max_tokens": 1, "return_tokens_as_token_ids": True}  # ids: keys stay unique
    top = ok(fields_http, {**body, "logprobs": -1}).json()["choices"][0]["logprobs"]["top_logprobs"][0]
    assert len(top) == VOCAB and {int(k.split(":")[1]) for k in top} == set(range(VOCAB))
    assert max(top.values()) == top[f"token_id:{PARIS}"]  # greedy took the best
    chat = ok(fields_http, {**BASE["chat"], "max_tokens": 1, "logprobs": True, "top_logprobs": -1}).json()
    assert len(chat["choices"][0]["logprobs"]["content"][0]["top_logprobs"]) == VOCAB
    positions = prompt_logprobs(ok(fields_http, {**BASE["completions"], "max_tokens": 1, "prompt_logprobs": -1}))
    assert all(len(p) == VOCAB and sorted(e["rank"] for e in p.values()) == list(range(1, VOCAB + 1))
               for p in positions[1:])
