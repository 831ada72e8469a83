"""``--calculate-kv-scales`` on the CPU (shared/engine/kv_calibration.py): a tiny Llama whose keys and values
lie far outside what e4m3 holds at scale 1.0 (k_proj and v_proj weights times F, q_proj and o_proj divided by
F: the model computes exactly what the original does in fp32, but its K/V are F times larger) loses its
logprobs under ``--kv-cache-dtype fp8`` with scale 1.0 and keeps them with measured scales. The measured
scales are the amax of the calibration batch's keys and values over vLLM's constants, computed here
independently through HF transformers; a prefill-role and a decode-role engine measure the same ones (the
handoff digest agrees); every attention (rotary or not) measures its own; measured scales replace a
checkpoint's; the step budget changes neither the scales nor the logprobs; and the flag is refused, in one line
naming both flags, without fp8 and beside ranks."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvrelay import LLM, SamplingParams
from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig
from kvrelay.shared.engine.engine_core import EngineCore
from kvrelay.shared.engine.kv_calibration import calibration_length, calibration_prompt
from kvrelay.shared.engine.kv_dtype import K_SCALE_RANGE, V_SCALE_RANGE
from kvrelay.shared.engine.kv_scales import scales_digest
from tests.conftest import random_prompts
from tests.unit.test_kv_fp8_models import TOL, _logprobs, _reference

MAX_NEW = 8
# nats, worst over every position: measured scales vs the fp32 cache is e4m3's rounding alone (observed 0.25,
# as tests/unit/test_kv_fp8_models.py sees on these random models at their own magnitudes, scale 1.0); scale
# 1.0 on the outsized model vs the fp32 cache (observed 4.3 for F = 1000, 5.8 for F = 1e-4)
CALIBRATED_TOL = 0.5
UNIT_SCALE_OFF = 2.0
ENGINE = dict(dtype="float32", max_model_len=128, max_num_batched_tokens=64, enable_prefix_caching=False)
# nats: the same prompts at two step budgets, engine against engine (observed 3e-6)
BUDGET_TOL = 1e-4


def _rescaled(src, dst, factor: float):
    """A copy of ``src`` whose keys and values are ``factor`` times larger and whose outputs are unchanged."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for name in list(tensors):
        if name.endswith(("k_proj.weight", "v_proj.weight")):
            tensors[name] = tensors[name] * factor
        elif name.endswith(("q_proj.weight", "o_proj.weight")):
            tensors[name] = tensors[name] / factor
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module", params=[1000.0, 1e-4], ids=["large", "tiny"])
def outsized(request, tiny_model_dirs, tmp_path_factory):
    """(model dir, factor): K/V magnitudes ~4 * factor, against e4m3's 2^-9 .. 448 at scale 1.0."""
    return _rescaled(tiny_model_dirs["llama"], tmp_path_factory.mktemp("outsized") / "m", request.param), request.param


def _run(model_dir, prompts, **kw):
    llm = LLM(model=str(model_dir), **ENGINE, **kw)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, logprobs=2, prompt_logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return llm, outs


def _prompt_logprobs(model_dir, ids: list[int], **kw) -> list[float]:
    """The logprob of each token of ``ids`` after the first, teacher-forced (prompt logprobs)."""
    _, (out,) = _run(model_dir, [ids], **kw)
    return [out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]


def test_measured_scales_keep_an_outsized_models_logprobs(outsized):
    model_dir, factor = outsized
    prompts = random_prompts(4, lo=20, hi=50, seed=11)
    _, calibrated = _run(model_dir, prompts, kv_cache_dtype="fp8", calculate_kv_scales=True)
    worst_calibrated = worst_unit = 0.0
    for prompt, out in zip(prompts, calibrated, strict=True):
        ids = prompt + list(out.outputs[0].token_ids)
        exact = _prompt_logprobs(model_dir, ids, kv_cache_dtype="auto")
        measured = _prompt_logprobs(model_dir, ids, kv_cache_dtype="fp8", calculate_kv_scales=True)
        unit = _prompt_logprobs(model_dir, ids, kv_cache_dtype="fp8")
        worst_calibrated = max(worst_calibrated, *(abs(a - b) for a, b in zip(measured, exact, strict=True)))
        worst_unit = max(worst_unit, *(abs(a - b) for a, b in zip(unit, exact, strict=True)))
        # greedy: the fp32 cache's choice wherever its margin is wider than the calibrated cache's error
        _, (ref,) = _run(model_dir, [prompt], kv_cache_dtype="auto")
        for i, (tok, want) in enumerate(zip(out.outputs[0].token_ids, ref.outputs[0].token_ids, strict=True)):
            if tok != want:
                top2 = sorted(ref.outputs[0].logprobs[i].values(), key=lambda lp: -lp.logprob)[:2]
                print("MISMATCH", i, top2[0].logprob - top2[1].logprob)
                break  # the two runs continue from different tokens
    assert worst_calibrated <= CALIBRATED_TOL, (factor, worst_calibrated)
    assert worst_unit >= UNIT_SCALE_OFF, (factor, worst_unit)


def _hf_amax(model_dir, ids: list[int], scales: list[list[float]]) -> list[list[float]]:
    """[layer][amax |K|, amax |V|] of ``ids`` through HF transformers in fp32, keys after rotary as its cache
    receives them, each layer's K/V stored rounded through fp8 under ``scales`` (as the engine's cache stores
    them, so a later layer sees what the engine's did)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    seen: dict[int, list[float]] = {}

    class Recording(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            seen[layer_idx] = [key_states.abs().max().item(), value_states.abs().max().item()]
            k_scale, v_scale = scales[layer_idx]

            def rounded(x, s):
                return (x / s).clamp(-448, 448).to(torch.float8_e4m3fn).to(x.dtype) * s
            return super().update(rounded(key_states, k_scale), rounded(value_states, v_scale), layer_idx,
                                  *args, **kwargs)

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    import inspect
    kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    with torch.no_grad():
        model(torch.tensor([ids]), use_cache=True, **{kwarg: Recording()})
    return [seen[i] for i in range(len(seen))]


def test_measured_scales_are_the_calibration_batchs_amax(outsized):
    model_dir, _ = outsized
    llm = LLM(model=str(model_dir), **ENGINE, kv_cache_dtype="fp8", calculate_kv_scales=True)
    scales = llm.engine.core.runner.kv_scales.tolist()
    ids = calibration_prompt(llm.engine.core.vocab_size, calibration_length(128))  # min(256, 127)
    amax = _hf_amax(model_dir, ids, scales)
    assert len(scales) == len(amax) == 2
    for (k_scale, v_scale), (k_amax, v_amax) in zip(scales, amax, strict=True):
        assert k_scale == pytest.approx(k_amax / K_SCALE_RANGE, rel=1e-4)
        assert v_scale == pytest.approx(v_amax / V_SCALE_RANGE, rel=1e-4)
    assert llm.engine.core.kv.scales_digest == scales_digest(scales, 2)
    assert llm.engine.core.num_free_blocks == llm.engine.core.num_total_blocks  # the batch's blocks are back


def test_the_step_budget_changes_neither_the_scales_nor_the_logprobs(outsized):
    """64-token steps run these prompts whole beside other requests' decodes; 16-token ones chunk every prompt, so
    most of its attention reads K/V back from the fp8 cache. Both measure the same scales (the calibration batch
    is one step whatever the budget, kv_calibration.py), give the same tokens and logprobs, and meet HF
    transformers with a cache that rounds K/V through fp8 under those scales. A budget that cut the calibration
    batch gave each budget scales of its own, and logprobs apart by far more than BUDGET_TOL."""
    model_dir, factor = outsized
    prompts = random_prompts(6, lo=20, hi=60, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=1, prompt_logprobs=0)
    runs = {}
    for batched in (64, 16):
        llm = LLM(model=str(model_dir), **{**ENGINE, "max_num_batched_tokens": batched}, max_num_seqs=16,
                  kv_cache_dtype="fp8", calculate_kv_scales=True)
        assert llm.engine.core.max_num_batched_tokens == batched  # the calibration step's budget is not kept
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
        runs[batched] = (llm.engine.core.runner.kv_scales.tolist(),
                         [_logprobs(p, out) for p, out in zip(prompts, outs, strict=True)])
    (scales, whole), (chunked_scales, chunked) = runs[64], runs[16]
    assert scales == chunked_scales, (factor, scales, chunked_scales)
    apart = from_reference = 0.0
    for prompt, rows, chunked_rows in zip(prompts, whole, chunked, strict=True):
        assert [r[:2] for r in rows] == [r[:2] for r in chunked_rows], factor  # the same tokens
        apart = max(apart, *(abs(a[2] - b[2]) for a, b in zip(rows, chunked_rows, strict=True)))
        ids = prompt + [tok for pos, tok, _ in rows[len(prompt) - 1:]]
        rounded = _reference(str(model_dir), ids, True, dict(enumerate(scales)))
        from_reference = max(from_reference, *(abs(lp - rounded[pos, tok].item()) for pos, tok, lp in rows))
    print(f"factor {factor}: budgets 64 vs 16 {apart:.2e} nats apart, {from_reference:.2e} from the reference")
    assert apart <= BUDGET_TOL, (factor, apart)
    assert from_reference <= TOL, (factor, from_reference)


def test_prefill_and_decode_engines_measure_the_same_scales(tiny_model_dirs):
    """Two processes of a disaggregated pair each measure their own; the handoff digest (which the decode side
    compares, decode_worker/receiver.py) agrees, and differs from the digest of a cache at scale 1.0, whose
    decode worker therefore refuses this prefill worker's blocks instead of misreading them."""
    config = EngineConfig(model=ModelConfig(model=str(tiny_model_dirs["llama"]), dtype="float32", max_model_len=128),
                          cache=CacheConfig(kv_cache_dtype="fp8", calculate_kv_scales=True), device="cpu")
    prefill, decode = EngineCore(config, hold_finished_kv=True), EngineCore(config)
    assert prefill.runner.kv_scales.tolist() == decode.runner.kv_scales.tolist()
    assert prefill.kv.scales_digest == decode.kv.scales_digest != scales_digest([], 2)
    assert prefill.scheduler.num_held == 0 and prefill.num_free_blocks == prefill.num_total_blocks


def test_calculate_kv_scales_without_fp8_is_refused_in_one_line(tiny_model_dirs):
    with pytest.raises(ValueError, match=r"--calculate-kv-scales: only with --kv-cache-dtype fp8") as err:
        LLM(model=str(tiny_model_dirs["llama"]), **ENGINE, calculate_kv_scales=True)
    assert "\n" not in str(err.value)


def test_calculate_kv_scales_beside_ranks_is_refused_in_one_line(tiny_model_dirs):
    """A rank holds only its own heads or layers of the calibration batch; ranks take rank 0's table."""
    for sizes in (dict(tensor_parallel_size=2), dict(pipeline_parallel_size=2)):
        with pytest.raises(ValueError, match=r"argument --calculate-kv-scales: not with --tensor-parallel-size or "
                                             r"--pipeline-parallel-size above 1"):
            EngineConfig(model=ModelConfig(model=str(tiny_model_dirs["llama"])), device="cpu", **sizes,
                         cache=CacheConfig(kv_cache_dtype="fp8", calculate_kv_scales=True))


@pytest.mark.parametrize("arch", ["qwen2", "gpt2", "bloom"])
def test_each_attention_measures_its_scales(tiny_model_dirs, arch):
    """Llama's attention measures keys after rotary; GPT-2's and BLOOM's fused q|k|v attention has none."""
    model_dir = tiny_model_dirs[arch]
    ids = random_prompts(1, lo=40, hi=41, seed=5)[0]
    exact = _prompt_logprobs(model_dir, ids, kv_cache_dtype="auto")
    llm, (out,) = _run(model_dir, [ids], kv_cache_dtype="fp8", calculate_kv_scales=True)
    scales = llm.engine.core.runner.kv_scales.flatten().tolist()
    assert all(0 < s != 1.0 for s in scales), scales
    measured = [out.prompt_logprobs[j][ids[j]].logprob for j in range(1, len(ids))]
    assert max(abs(a - b) for a, b in zip(measured, exact, strict=True)) <= CALIBRATED_TOL


def test_measured_scales_replace_the_checkpoints(tiny_model_dirs, tmp_path):
    """As in vLLM: with the flag, a checkpoint's KV scales give way to the measured ones (the same as the
    same weights measure without them)."""
    src = tiny_model_dirs["llama"]
    dst = tmp_path / "with-scales"
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    for layer in range(2):
        tensors[f"model.layers.{layer}.self_attn.k_scale"] = torch.tensor(0.37)
        tensors[f"model.layers.{layer}.self_attn.v_scale"] = torch.tensor(0.61)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    flagged = LLM(model=str(dst), **ENGINE, kv_cache_dtype="fp8", calculate_kv_scales=True)
    plain = LLM(model=str(src), **ENGINE, kv_cache_dtype="fp8", calculate_kv_scales=True)
    assert flagged.engine.core.runner.kv_scales.tolist() == plain.engine.core.runner.kv_scales.tolist()
    assert flagged.engine.core.runner.kv_scales.tolist() != [[0.37, 0.61]] * 2
