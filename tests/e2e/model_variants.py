"""Test models that differ only in their weights, and what the offline engine answers with them: a served
model's answer equal to its own offline answer (and unequal to the others') shows which model served it."""

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kvrelay import LLM, SamplingParams

PROMPT = [5, 17, 99, 203, 7, 311, 42]  # inside every test model's vocabulary (tiny gpt2: 512)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def variant(src: Path, dst: Path, seed: int) -> Path:
    """``src`` with every matrix re-drawn from ``seed``: the same shapes and tokenizer, other weights."""
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        g = torch.Generator().manual_seed(seed)
        for name, t in tensors.items():
            if t.dim() > 1:
                tensors[name] = torch.randn(t.shape, generator=g) * 0.15
        save_file(tensors, f, metadata={"format": "pt"})
    return dst


def offline_text(path: Path, prompt=PROMPT) -> str:
    llm = LLM(model=str(path), dtype="float32", max_model_len=256)
    return llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].text
