"""Structured outputs through the engine, on the real SmolLM2 (CPU): sampled at temperature 1 with each
constraint kind, the outputs match their constraint and end with "stop" (n=3, with logprobs, streaming);
a constraint that does not compile fails its request alone; async scheduling and the decode side of a
disaggregated pair (which continues the grammar from the prefill side's first token) hold too."""

import json
import math
import re
import threading

import jsonschema
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.config.engine import EngineConfig, ModelConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.wire.structured_outputs import StructuredOutputs

EOS = 2
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Oslo"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 2},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "city", "tags", "ok"],
    "additionalProperties": False,
}
COPY_ME = ('Repeat exactly: {"answer": 42, "unit": "cm"}', 'Repeat exactly: {"name": "Bob", "ok": true}')
GRAMMAR = 'root ::= "x=" [0-9] [0-9]? ("+" [0-9])?'
GRAMMAR_RE = r"x=[0-9][0-9]?(\+[0-9])?"


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(model=str(smollm2_dir), max_model_len=512, device="cpu", seed=0)


def _prompts(llm: LLM, asks: tuple[str, ...] = ("Describe a person as JSON.", "Give me a random answer.")
             ) -> list[str]:
    tok = llm.get_tokenizer()
    return [tok.apply_chat_template([{"role": "user", "content": a}], tokenize=False, add_generation_prompt=True)
            for a in asks]


@pytest.mark.parametrize("so, check, top_k", [
    (StructuredOutputs(json=json.dumps(SCHEMA)), lambda t: jsonschema.validate(json.loads(t), SCHEMA), 0),
    # any object: nothing bounds its strings, and a 135M model at full temperature may spell one key for
    # hundreds of tokens; a prompt it can copy and top-k keep it to likely tokens (the mask still applies)
    (StructuredOutputs(json_object=True), lambda t: isinstance(json.loads(t), dict) or pytest.fail(t), 5),
    (StructuredOutputs(regex=r"[A-Z][a-z]{1,6} [0-9]{2}"),
     lambda t: re.fullmatch(r"[A-Z][a-z]{1,6} [0-9]{2}", t) or pytest.fail(t), 0),
    (StructuredOutputs(choice=["yes", "no", 'it "depends"']),
     lambda t: t in ("yes", "no", 'it "depends"') or pytest.fail(t), 0),
    (StructuredOutputs(grammar=GRAMMAR), lambda t: re.fullmatch(GRAMMAR_RE, t) or pytest.fail(t), 0),
], ids=["json", "json_object", "regex", "choice", "grammar"])
def test_sampled_outputs_match_their_constraint(llm, so, check, top_k):
    # seeded: each sample's draws are its own, whatever ran before in this engine (an unseeded json_object
    # sample of this 135M model runs past max_tokens inside one key about one time in ten)
    params = SamplingParams(temperature=1.0, top_k=top_k, max_tokens=200, n=3, logprobs=2, seed=3,
                            structured_outputs=so)
    prompts = _prompts(llm, COPY_ME) if so.json_object else _prompts(llm)
    for out in llm.generate(prompts, params):
        for c in out.outputs:
            assert c.finish_reason == "stop", (c.text, c.finish_reason)
            check(c.text)
            # logprobs come from the raw distribution (vLLM's default): one entry per token, the chosen token
            # included, and the runners-up finite even where the grammar allowed a single token
            assert len(c.logprobs) == len(c.token_ids)
            for tid, entry in zip(c.token_ids, c.logprobs, strict=True):
                assert tid in entry and len(entry) >= 2
                assert all(math.isfinite(lp.logprob) and lp.logprob <= 0 for lp in entry.values())


def test_constrained_and_unconstrained_requests_share_a_batch(llm):
    so = StructuredOutputs(json=json.dumps(SCHEMA))
    prompts = _prompts(llm)
    outs = llm.generate(prompts * 2, [SamplingParams(temperature=1.0, max_tokens=120, structured_outputs=so),
                                      SamplingParams(temperature=1.0, max_tokens=20)] * 2)
    for i, out in enumerate(outs):
        text = out.outputs[0].text
        if i % 2 == 0:
            jsonschema.validate(json.loads(text), SCHEMA)
        else:
            assert out.outputs[0].token_ids


def test_allowed_token_ids_narrow_a_constraint_and_end_it_where_nothing_is_both(llm):
    """allowed_token_ids with a constraint: the output is drawn from what both allow; where none of the allowed
    ids continues the constraint the sequence ends with its stop token instead of sampling an all -inf row,
    and the requests beside it are untouched."""
    tok = llm.get_tokenizer()
    ones, twos, letter = (tok.convert_tokens_to_ids(t) for t in ("1", "2", "x"))
    digits = StructuredOutputs(regex="[0-9]{3,6}")
    outs = llm.generate(_prompts(llm), [
        SamplingParams(temperature=1.0, seed=5, max_tokens=20, structured_outputs=digits,
                       allowed_token_ids=[ones, twos, letter, EOS]),
        SamplingParams(temperature=1.0, seed=5, max_tokens=20, structured_outputs=digits,
                       allowed_token_ids=[letter, EOS]),  # no digit: nothing continues the regex
    ])
    narrowed, starved = (o.outputs[0] for o in outs)
    assert narrowed.finish_reason == "stop" and re.fullmatch("[12]{3,6}", narrowed.text), narrowed.text
    assert starved.finish_reason == "stop" and starved.text == "" and starved.token_ids in ([], [EOS])
    again = llm.generate(_prompts(llm)[:1], SamplingParams(temperature=1.0, max_tokens=20, structured_outputs=digits))
    assert re.fullmatch("[0-9]{3,6}", again[0].outputs[0].text)


def test_streamed_text_is_the_constrained_text(llm):
    so = StructuredOutputs(json=json.dumps(SCHEMA))
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=120, structured_outputs=so)
    whole = llm.generate(_prompts(llm)[:1], params)[0].outputs[0].text
    streamed = "".join(d.text for out in llm.generate_stream(_prompts(llm)[:1], params) for d in out.outputs)
    assert streamed == whole
    jsonschema.validate(json.loads(streamed), SCHEMA)


def test_a_constraint_that_does_not_compile_is_a_value_error_naming_the_field(llm):
    with pytest.raises(ValueError, match=r"^structured_outputs\.json does not compile: "):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputs(json='{"type": "nope"}')))
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex does not compile: "):
        llm.generate(["hi"], SamplingParams(structured_outputs=StructuredOutputs(regex="([")))
    # the engine is unharmed
    assert llm.generate(["hi"], SamplingParams(max_tokens=3))[0].outputs[0].token_ids


def test_a_bad_constraint_fails_its_request_alone_in_the_engine(llm):
    """The workers' path: requests go into the core as they come; one whose constraint does not compile ends
    with an "error" output naming the field while its batch-mates complete."""
    core = llm.engine.core
    tok = llm.get_tokenizer()
    prompt = tok.encode(_prompts(llm)[0])
    good = core.make_request("good", prompt, SamplingParams(
        temperature=1.0, max_tokens=120, structured_outputs=StructuredOutputs(json=json.dumps(SCHEMA))), EOS)
    plain = core.make_request("plain", prompt, SamplingParams(temperature=1.0, max_tokens=8), EOS)
    bad_so = StructuredOutputs(json='{"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}')
    try:
        bad = core.make_request("bad", prompt, SamplingParams(max_tokens=8, structured_outputs=bad_so), EOS)
    except ValueError as exc:  # the compile thread finished before make_request looked: the same error, sooner
        errors = {"bad": str(exc)}
    else:
        errors = {}
        core.add_request(bad)
    for req in (good, plain):
        core.add_request(req)
    texts: dict[str, list[int]] = {"good": [], "plain": []}
    finish: dict[str, str] = {}
    while core.has_unfinished():
        for o in core.step():
            if o.finish_reason == "error":
                errors[o.request_id] = o.error
            else:
                texts[o.request_id] += o.new_token_ids
            if o.finished:
                finish[o.request_id] = o.finish_reason
    assert re.match(r"^structured_outputs\.json does not compile: \S", errors["bad"]), errors
    assert finish["good"] == "stop" and finish["plain"] in ("stop", "length")
    jsonschema.validate(json.loads(tok.decode(texts["good"][:-1])), SCHEMA)  # the last token is EOS
    # the same constraint again fails at once, from the cache
    with pytest.raises(ValueError, match=r"^structured_outputs\.json does not compile"):
        core.make_request("bad2", prompt, SamplingParams(structured_outputs=bad_so), EOS)


def test_compiles_are_cached_per_constraint_text(llm):
    cache = llm.engine.core.structured.cache
    so = StructuredOutputs(regex="[a-c]{3}")
    llm.generate(["a"], SamplingParams(max_tokens=8, structured_outputs=so))
    before = cache.compiles
    out = llm.generate(["b", "c"], SamplingParams(temperature=1.0, max_tokens=8, n=2, structured_outputs=so))
    assert cache.compiles == before
    assert all(re.fullmatch("[a-c]{3}", c.text) for o in out for c in o.outputs)


def test_async_scheduling_masks_with_every_token_known(smollm2_dir):
    llm = LLM(model=str(smollm2_dir), max_model_len=512, device="cpu", async_scheduling=True)
    so = StructuredOutputs(json=json.dumps(SCHEMA))
    params = [SamplingParams(temperature=1.0, max_tokens=120, n=2, structured_outputs=so),
              SamplingParams(temperature=1.0, max_tokens=30, seed=5, logit_bias={EOS: 5.0})]
    outs = llm.generate(_prompts(llm), params)
    for c in outs[0].outputs:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), SCHEMA)
    assert outs[1].outputs[0].token_ids
    # a request that ended while a step read early was forgotten; its sampler state (seeded generator, bias
    # tensors) must not outlive it
    sampler = llm.engine.core.runner.sampler
    assert not sampler._generators and not sampler._biases


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_decode_side_continues_the_grammar_the_prefill_side_started(smollm2_dir, async_scheduling):
    """The disaggregated path in one process: a prefill engine samples the first token under the grammar,
    the KV is copied into blocks the decode engine reserved, and the decode engine continues the grammar
    from that token (its matcher catches up over it) to a valid document."""
    def config(on: bool) -> EngineConfig:
        return EngineConfig(ModelConfig(str(smollm2_dir), max_model_len=512), device="cpu", async_scheduling=on)

    prefill, decode = EngineCore(config(False), hold_finished_kv=True), EngineCore(config(async_scheduling))
    from kvrelay.shared.text.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2_dir)
    so = StructuredOutputs(json=json.dumps(SCHEMA))
    texts = {}
    for i in range(3):
        rid = f"r{i}"
        prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": f"Person {i} as JSON."}],
                                                    tokenize=False, add_generation_prompt=True))
        first_params = SamplingParams(temperature=1.0, max_tokens=1, structured_outputs=so)
        prefill.add_request(prefill.make_request(rid, prompt, first_params, EOS))
        outs = []
        while prefill.has_unfinished():  # the first steps wait for the compile (the tokenizer's, the first time)
            outs += [o for o in prefill.step() if o.request_id == rid]
        (first,) = outs
        blocks = decode.kv.reserve(rid, len(prompt))
        held = prefill.kv.block_ids(rid)[:len(blocks)]
        decode.kv.kv_cache[:, :, blocks] = prefill.kv.kv_cache[:, :, held]
        prefill.kv.release_held(rid)
        params = SamplingParams(temperature=1.0, max_tokens=120, structured_outputs=so)
        decode.add_remote_prefilled(decode.make_request(rid, prompt, params, EOS), first.new_token_ids[0], 0)
        texts[rid] = list(first.new_token_ids)
    finish = {}
    while decode.has_unfinished():
        for o in decode.step():
            texts[o.request_id] += o.new_token_ids
            if o.finished:
                finish[o.request_id] = o.finish_reason
    assert finish == {f"r{i}": "stop" for i in range(3)}
    for ids in texts.values():
        assert ids[-1] == EOS
        jsonschema.validate(json.loads(tok.decode(ids[:-1])), SCHEMA)


@pytest.mark.parametrize("kwargs", [{"min_tokens": 5}, {"ignore_eos": True}])
def test_a_constraint_with_min_tokens_or_ignore_eos_is_refused(llm, kwargs):
    # a complete document allows only its end; holding the end back would leave nothing to sample
    so = StructuredOutputs(choice=["a", "b"])
    with pytest.raises(ValueError, match=f"^structured_outputs cannot be combined with {next(iter(kwargs))}$"):
        llm.generate(["hi"], SamplingParams(max_tokens=8, structured_outputs=so, **kwargs))


def test_a_request_waits_for_its_compile_while_the_batch_keeps_stepping(smollm2_dir):
    """vLLM's WAITING_FOR_FSM: a constraint compiles on the compile thread (the first one of an engine also
    builds the tokenizer's vocabulary for the grammar, seconds); meanwhile the running request keeps getting
    a token each step, and the constrained one joins once its grammar is ready."""
    from kvrelay.shared.text.tokenizer import load_tokenizer

    core = EngineCore(EngineConfig(ModelConfig(str(smollm2_dir), max_model_len=512), device="cpu"))
    # hold the compile thread until the test has seen the batch step without it
    gate = threading.Event()
    build = core.structured.cache._make_backend
    core.structured.cache._make_backend = lambda: gate.wait(60) and build()
    core.add_request(core.make_request("plain", [1, 2, 3, 4], SamplingParams(max_tokens=300, ignore_eos=True), EOS))
    so = StructuredOutputs(json=json.dumps(SCHEMA))
    core.add_request(core.make_request("json", [1, 5, 6], SamplingParams(max_tokens=120, structured_outputs=so), EOS))
    for _ in range(4):
        outs = {o.request_id: o for o in core.step()}
        assert set(outs) == {"plain"} and len(outs["plain"].new_token_ids) == 1
        assert core.num_waiting == 1  # compiling, outside the scheduler
    gate.set()
    json_ids, json_finish = [], None
    while json_finish is None and core.has_unfinished():
        for o in core.step():
            if o.request_id == "json":
                json_ids += o.new_token_ids
                json_finish = o.finish_reason
    core.abort(["plain"])
    assert json_finish == "stop"
    jsonschema.validate(json.loads(load_tokenizer(smollm2_dir).decode(json_ids[:-1])), SCHEMA)


def test_a_model_without_a_tokenizer_refuses_constraints_by_name(tiny_model_dirs):
    # a checkpoint with no tokenizer files serves token ids, but nothing can spell a grammar's text for it
    llm = LLM(model=str(tiny_model_dirs["llama"]), device="cpu", max_model_len=64)
    so = StructuredOutputs(regex="[0-9]+")
    with pytest.raises(ValueError, match=r"^structured_outputs\.regex cannot be served by this model: the model "
                                         r".* has no tokenizer files \(pass --tokenizer\)$"):
        llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4, structured_outputs=so))
    assert llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=4))[0].outputs[0].token_ids


def test_model_rows_past_the_tokenizer_are_never_sampled(tmp_path, smollm2_dir):
    """A model whose vocabulary is larger than its tokenizer's (padded embedding rows, or a dummy model given
    a real tokenizer): the grammar never allows the padding ids, even when the model favours them."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    tokenizer_size = 49152
    config = LlamaConfig(vocab_size=tokenizer_size + 64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, torch_dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.15)
        model.lm_head.weight[tokenizer_size:] *= 40  # the padding rows dominate every unconstrained step
    model.save_pretrained(tmp_path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    llm = LLM(model=str(tmp_path), device="cpu", max_model_len=256)
    schema = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "n": {"type": "integer", "minimum": 0,
                                                                                   "maximum": 9},
                                               "tag": {"type": "string", "maxLength": 4}},
              "required": ["kind", "n", "tag"], "additionalProperties": False}
    so = StructuredOutputs(json=json.dumps(schema))
    plain = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=1.0, max_tokens=8))
    assert max(plain[0].outputs[0].token_ids) >= tokenizer_size  # unconstrained, the padding rows win
    outs = llm.generate([{"prompt_token_ids": [5, 6 + i, 7]} for i in range(6)],
                        SamplingParams(temperature=1.0, max_tokens=100, structured_outputs=so))
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and max(c.token_ids) < tokenizer_size
        jsonschema.validate(json.loads(c.text), schema)
