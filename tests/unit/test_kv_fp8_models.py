"""Tiny models with an fp8 KV cache against an independent reference: HF transformers on the same
weights, in fp32, with a cache that rounds every K and V it stores through float8_e4m3fn (scale 1, as
``--kv-cache-dtype fp8`` stores them). The engine's logprobs (prompt, by chunked prefill that reads
earlier chunks back from the cache, and each decoded token) must match that reference closely, and
must NOT match the same reference without the rounding: the fp8 effect on these random models is
~0.15-0.3 nats, the engine's agreement with the rounded reference ~1e-5, so the check cannot pass by
accident (an engine that ignored the dtype fails the second half) and has a wide margin against flakes.
Greedy tokens equal the reference's argmax wherever its top two differ by more than the tolerance.
Prefix caching and swap preemption copy fp8 blocks unchanged: those runs meet the same reference."""

import functools
import inspect
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay import LLM, SamplingParams
from tests.conftest import random_prompts

TOL = 5e-3  # nats: engine vs the rounded reference
SEPARATION = 3e-2  # nats: at least this far from the unrounded reference somewhere (observed >= 0.15)
FP8_VS_DEFAULT = 1.0  # nats: fp8 KV vs the model's-dtype KV, bounded (observed <= 0.3 on these models)
MAX_NEW = 12

MODES = {
    "chunked": dict(max_num_batched_tokens=16, enable_prefix_caching=False),
    "prefix_cache": dict(max_num_batched_tokens=64, enable_prefix_caching=True, block_size=8),
    "preempt_swap": dict(block_size=8, num_gpu_blocks=20, max_num_batched_tokens=48, swap_space=0.001,
                         enable_prefix_caching=False),
}


def _rounding_cache(scales: dict[int, list[float]] | None = None):
    from transformers import DynamicCache

    class Fp8RoundingCache(DynamicCache):
        """Stores (and hands attention) K and V as an fp8 cache would give them back: ``x / scale``
        rounded to e4m3, times the scale (layer index -> [K, V] scales; 1.0 where not given)."""

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            k_scale, v_scale = (scales or {}).get(layer_idx, [1.0, 1.0])

            def rounded(x, s):
                return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * s
            return super().update(rounded(key_states, k_scale), rounded(value_states, v_scale), layer_idx,
                                  *args, **kwargs)

    return Fp8RoundingCache()


def _cache_kwarg(model) -> str:
    """The name transformers' forward takes the cache under: ``cache`` in 5.2x, ``past_key_values`` before
    (where an unknown ``cache=`` is swallowed by **kwargs, and the reference silently would not round)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


@functools.cache
def _hf(model_dir: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _reference(model_dir: str, ids: list[int], round_kv: bool, scales: dict[int, list[float]] | None = None) -> torch.Tensor:
    """[len(ids), V] log-probabilities of the next token at each position."""
    from transformers import DynamicCache

    model = _hf(model_dir)
    cache = _rounding_cache(scales) if round_kv else DynamicCache()
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True, **{_cache_kwarg(model): cache})
    return out.logits[0].float().log_softmax(-1)


def _engine(model_dir, prompts, kv_cache_dtype: str, **kw):
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=128, kv_cache_dtype=kv_cache_dtype, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    core = llm.engine.core
    assert core.kv_dtype == (torch.float8_e4m3fn if kv_cache_dtype == "fp8" else torch.float32)
    assert core.num_free_blocks == core.num_total_blocks, "KV blocks leaked"
    return outs


def _logprobs(prompt: list[int], out) -> list[tuple[int, int, float]]:
    """(position predicting it, token, the engine's logprob) for each prompt token after the first and
    each generated token."""
    rows = [(j - 1, prompt[j], out.prompt_logprobs[j][prompt[j]].logprob) for j in range(1, len(prompt))]
    gen = out.outputs[0]
    rows += [(len(prompt) - 1 + i, t, gen.logprobs[i][t].logprob) for i, t in enumerate(gen.token_ids)]
    return rows


def _prompts(mode: str) -> list[list[int]]:
    if mode == "prefix_cache":  # three prompts share each of three prefixes
        base, tails = random_prompts(3, lo=20, hi=40, seed=7), random_prompts(9, lo=1, hi=20, seed=8)
        return [base[i % 3] + tails[i] for i in range(9)]
    return random_prompts(6, lo=20, hi=60, seed=3)


@pytest.mark.parametrize("arch,mode", [("llama", m) for m in MODES] + [("gpt2", "chunked"), ("bloom", "chunked"),
                                                                        ("qwen2", "chunked")])
def test_fp8_kv_matches_rounded_reference(tiny_model_dirs, arch, mode):
    model_dir = str(tiny_model_dirs[arch])
    prompts = _prompts(mode)
    outs = _engine(model_dir, prompts, "fp8", **MODES[mode])
    worst_rounded = worst_plain = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        tokens = out.outputs[0].token_ids
        rounded = _reference(model_dir, prompt + tokens, round_kv=True)
        plain = _reference(model_dir, prompt + tokens, round_kv=False)
        for pos, tok, lp in _logprobs(prompt, out):
            worst_rounded = max(worst_rounded, abs(lp - rounded[pos, tok].item()))
            worst_plain = max(worst_plain, abs(lp - plain[pos, tok].item()))
        for i, tok in enumerate(tokens):  # greedy: the reference's choice wherever its choice is clear
            top2 = rounded[len(prompt) - 1 + i].topk(2)
            if top2.values[0] - top2.values[1] > 2 * TOL:
                assert tok == top2.indices[0].item(), (arch, mode, prompt, i)
    assert worst_rounded <= TOL, (arch, mode, worst_rounded)
    assert worst_plain >= SEPARATION, (arch, mode, worst_plain)


def test_fp8_kv_logprobs_close_to_default_kv(tiny_model_dirs):
    """The fp8 cache's logprobs stay within a bound of the model's-dtype cache's, position by position
    (teacher-forced on the fp8 run's tokens, so one early different token does not compound)."""
    model_dir = str(tiny_model_dirs["llama"])
    prompts = _prompts("chunked")
    fp8 = _engine(model_dir, prompts, "fp8", **MODES["chunked"])
    for prompt, out in zip(prompts, fp8, strict=True):
        plain = _reference(model_dir, prompt + out.outputs[0].token_ids, round_kv=False)
        exact = _engine(model_dir, [prompt + out.outputs[0].token_ids], "auto", **MODES["chunked"])[0]
        for j in range(1, len(prompt) + len(out.outputs[0].token_ids)):
            tok = (prompt + out.outputs[0].token_ids)[j]
            assert abs(exact.prompt_logprobs[j][tok].logprob - plain[j - 1, tok].item()) < TOL
        for pos, tok, lp in _logprobs(prompt, out):
            assert abs(lp - plain[pos, tok].item()) <= FP8_VS_DEFAULT, (pos, lp, plain[pos, tok].item())


def test_fp8_kv_reads_the_checkpoints_kv_scales(tiny_model_dirs, tmp_path):
    """An FP8 checkpoint's per-layer KV scales, under both names vLLM loads (``self_attn.k_scale`` /
    ``v_scale``; ``k_proj.output_scale`` / ``v_proj.output_scale``), are what the cache divides by: the
    engine meets a reference rounding ``x / scale`` per layer, and not the unit-scale one. With the
    model's-dtype cache the same checkpoint loads and the scales change nothing."""
    src = tiny_model_dirs["llama"]
    dst = tmp_path / "kv-scales"
    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    scales = {0: [0.37, 0.61], 1: [2.3, 0.53]}  # not powers of two: a different rounding grid than 1.0
    tensors |= {"model.layers.0.self_attn.k_scale": torch.tensor(scales[0][0]),
                "model.layers.0.self_attn.v_scale": torch.tensor(scales[0][1]),
                "model.layers.1.self_attn.k_proj.output_scale": torch.tensor([scales[1][0]]),
                "model.layers.1.self_attn.v_proj.output_scale": torch.tensor([scales[1][1]])}
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    prompts = _prompts("chunked")
    llm = LLM(model=str(dst), dtype="float32", max_model_len=128, kv_cache_dtype="fp8", **MODES["chunked"])
    assert llm.engine.core.runner.kv_scales.flatten().tolist() == pytest.approx(scales[0] + scales[1])
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=1, prompt_logprobs=0))
    worst_scaled = worst_unit = 0.0
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt + out.outputs[0].token_ids
        scaled, unit = _reference(str(src), ids, True, scales), _reference(str(src), ids, True)
        for pos, tok, lp in _logprobs(prompt, out):
            worst_scaled = max(worst_scaled, abs(lp - scaled[pos, tok].item()))
            worst_unit = max(worst_unit, abs(lp - unit[pos, tok].item()))
    assert worst_scaled <= TOL, worst_scaled
    assert worst_unit >= SEPARATION, worst_unit
    same = _engine(str(dst), prompts[:2], "auto", **MODES["chunked"])
    assert [o.outputs[0].token_ids for o in same] == [
        o.outputs[0].token_ids for o in _engine(str(src), prompts[:2], "auto", **MODES["chunked"])]


@pytest.mark.parametrize("bad", [-0.5, 0.0, float("nan"), float("inf")])
def test_a_corrupt_kv_scale_is_one_line_naming_it(tiny_model_dirs, tmp_path, bad):
    dst = tmp_path / "bad-scale"
    shutil.copytree(tiny_model_dirs["llama"], dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors["model.layers.1.self_attn.v_scale"] = torch.tensor(bad)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"KV scale 'model.layers.1.self_attn.v_scale' must be one positive"):
        LLM(model=str(dst), dtype="float32", max_model_len=128, kv_cache_dtype="fp8")
