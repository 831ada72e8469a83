"""The ``kvrelay serve`` that the vLLM OpenAI-server test mirrors (tests/e2e/test_vllm_openai_*.py) run against:
SmolLM2 on one unified worker, float32 on the CPU, and SmolLM2's tokenizer for checks that need one (as vLLM's
tests load their model's)."""

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from tests.e2e.served import Served

MODEL = "smollm2"
VOCAB = 49152  # SmolLM2's vocabulary: ids from here on are out of it
ENGINE = ["--mode", "unified", "--dtype", "float32", "--max-model-len", "512", "--block-size", "8",
          "--served-model-name", MODEL, "--num-gpu-blocks-override", "2048"]


@contextmanager
def serve_smollm2(model_dir: Path, log: Path, *extra: str) -> Iterator[tuple[Served, openai.OpenAI]]:
    """One ``kvrelay serve`` of SmolLM2 with ``extra`` flags, and a tenant's openai client of it."""
    with Served(["--model", str(model_dir), *ENGINE, *extra], log, timeout=300) as served:
        yield served, served.client()


def tokenizer(model_dir: Path) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(str(model_dir))


# vLLM's test_return_tokens_as_ids.py, shared by its two variants (the server's flag, the request's field)
def check_completion_token_ids(client: openai.OpenAI, tok: PreTrainedTokenizerBase, extra: dict) -> None:
    out = client.completions.create(model=MODEL, prompt="Say 'Hello, world! 🎉'", echo=True, temperature=0.0,
                                    max_tokens=10, logprobs=1, extra_body=extra)
    choice = out.choices[0]
    tokens = choice.logprobs.tokens
    assert all(t.startswith("token_id:") for t in tokens), tokens
    assert tokens[1:] == [next(iter(top)) for top in choice.logprobs.top_logprobs[1:]]
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert choice.text == tok.decode(ids, skip_special_tokens=True)


def check_chat_token_ids(client: openai.OpenAI, tok: PreTrainedTokenizerBase, extra: dict) -> None:
    out = client.chat.completions.create(model=MODEL, temperature=0.0, max_tokens=8, logprobs=True, extra_body=extra,
                                         messages=[{"role": "system", "content": "You like to respond in only emojis, "
                                                                                 "like 🎉"},
                                                   {"role": "user", "content": "Please write some emojis: 🐱🐶🎉"}])
    ids = [int(t.token.removeprefix("token_id:")) for t in out.choices[0].logprobs.content]
    assert tok.decode(ids, skip_special_tokens=True) == out.choices[0].message.content
