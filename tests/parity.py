"""Greedy-token parity helpers shared by the CPU static-buffer tests and the GPU CUDA-graph tests:
HF transformers ``generate`` as the reference, our offline engine as the subject."""

import functools

import torch

from kvrelay import LLM, SamplingParams

EOS = 2  # eos of tests/conftest.py's tiny models


@functools.cache
def hf_greedy(model_dir: str, prompts: tuple[tuple[int, ...], ...], max_new: int) -> list[list[int]]:
    """HF fp32 greedy continuations on the CPU, one prompt at a time (no padding), cut after EOS."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new, eos_token_id=EOS, pad_token_id=0)
            new = gen[0, len(p):].tolist()
            outs.append(new[: new.index(EOS) + 1] if EOS in new else new)
    return outs


def engine_greedy(llm: LLM, prompts: list[list[int]], max_new: int, min_cached_tokens: int = 0) -> list[list[int]]:
    """Our greedy continuations; ``min_cached_tokens``: prompt tokens the prefix cache must have served."""
    params = SamplingParams(temperature=0.0, max_tokens=max_new)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    core = llm.engine.core
    assert core.num_free_blocks == core.num_total_blocks, "KV blocks leaked"
    assert sum(o.num_cached_tokens for o in outs) >= min_cached_tokens
    return [o.outputs[0].token_ids for o in outs]


def first_mismatch(got: list[int], want: list[int]) -> int | None:
    for i, (a, b) in enumerate(zip(got, want, strict=False)):
        if a != b:
            return i
    return None if len(got) >= len(want) else len(got)


def teacher_forced_agreement(llm: LLM, prompts: list[list[int]], reference: list[list[int]]
                             ) -> tuple[int, int, list[tuple[int, int, int]]]:
    """(positions where our greedy token equals the reference's given the reference's prefix, positions,
    the misses as (sequence, position in the continuation, our token)).

    Each sequence is generated greedily; at its first divergence the position counts as a miss and
    generation restarts from the prompt plus the reference's tokens through that position, so every
    reference position is predicted from the reference's own prefix (teacher forcing), mostly through
    decode steps. Generation ignores EOS, as the reference must.
    """
    pos = [0] * len(prompts)
    matches = 0
    misses: list[tuple[int, int, int]] = []
    pending = list(range(len(prompts)))
    while pending:
        batch = [{"prompt_token_ids": prompts[i] + reference[i][:pos[i]]} for i in pending]
        params = [SamplingParams(temperature=0.0, max_tokens=len(reference[i]) - pos[i], ignore_eos=True)
                  for i in pending]
        outs = llm.generate(batch, params)
        still = []
        for i, out in zip(pending, outs, strict=True):
            want = reference[i][pos[i]:]
            miss = first_mismatch(out.outputs[0].token_ids, want)
            if miss is None:
                matches += len(want)
                continue
            matches += miss
            if miss < len(out.outputs[0].token_ids):
                misses.append((i, pos[i] + miss, out.outputs[0].token_ids[miss]))
            pos[i] += miss + 1
            if pos[i] < len(reference[i]):
                still.append(i)
        pending = still
    return matches, sum(len(r) for r in reference), misses
