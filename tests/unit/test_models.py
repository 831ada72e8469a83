"""Our model implementations against HF transformers on the same random weights.

Each architecture is built tiny with transformers, saved as safetensors, loaded through
shared.loader, and run through a paged KV cache whose blocks are handed out shuffled (so a
wrong block table or slot mapping shows up as wrong logits): one prompt, several prompts packed
in one step, chunked prefill against the cached prefix, batched decode, and greedy generation.
"""

import pytest
import torch
from transformers import AutoModelForCausalLM, BloomConfig, GPT2Config, LlamaConfig, MistralConfig, Qwen2Config

from kvrelay import kernels
from kvrelay.shared.config.engine import ModelConfig
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.models import build_model, get_model_class
from kvrelay.shared.engine.models.bloom import alibi_slopes
from kvrelay.shared.engine.models.rope import build_cos_sin_cache

ATOL = RTOL = 1e-4
_LLAMA_DIMS = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
_LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32}  # short, so all three wavelength regimes occur

CASES = {
    "llama": lambda: LlamaConfig(**_LLAMA_DIMS),
    "llama3-rope": lambda: LlamaConfig(**_LLAMA_DIMS, rope_theta=500000.0, rope_scaling=_LLAMA3_ROPE),
    "llama-linear-rope": lambda: LlamaConfig(**_LLAMA_DIMS, rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "llama-bias": lambda: LlamaConfig(**_LLAMA_DIMS, attention_bias=True, mlp_bias=True),
    "mistral": lambda: MistralConfig(**_LLAMA_DIMS, head_dim=16, sliding_window=None),
    "qwen2": lambda: Qwen2Config(**_LLAMA_DIMS),
    "smollm2-tied": lambda: LlamaConfig(**_LLAMA_DIMS, tie_word_embeddings=True),
    "gpt2": lambda: GPT2Config(vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4),
    "bloom": lambda: BloomConfig(vocab_size=256, hidden_size=96, n_layer=2, n_head=6),  # 6 heads: ALiBi's odd case
}


class PagedBatch:
    """What the engine's model runner does, in miniature: per-sequence block tables over one
    shared paged cache, flat packing of every scheduled token, AttentionMetadata for the step."""

    def __init__(self, model: torch.nn.Module, num_blocks: int = 96, block_size: int = 4, seed: int = 0) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.model, self.block_size = model, block_size
        self.free = torch.randperm(num_blocks, generator=gen).tolist()  # shuffled: neighbours land far apart
        dtype = next(model.parameters()).dtype
        shape = (model.num_layers, 2, num_blocks, block_size, model.num_kv_heads, model.head_dim)
        # finite garbage, not zeros: slots the masks fail to hide would change the result
        self.kv_caches = (torch.randn(shape, generator=gen) * 10).to(dtype)
        self.tables: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}

    @torch.no_grad()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Run one forward over (seq_id, new tokens) chunks; logits [q_len, vocab] per chunk."""
        ids, positions, slots, starts, seq_lens = [], [], [], [0], []
        for seq, tokens in chunks:
            start = self.lens.get(seq, 0)
            end = start + len(tokens)
            table = self.tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free.pop())
            ids += tokens
            positions += range(start, end)
            slots += [table[p // self.block_size] * self.block_size + p % self.block_size for p in range(start, end)]
            starts.append(starts[-1] + len(tokens))
            seq_lens.append(end)
            self.lens[seq] = end
        width = max(len(self.tables[seq]) for seq, _ in chunks)
        tables = [self.tables[seq] + [0] * (width - len(self.tables[seq])) for seq, _ in chunks]
        meta = kernels.AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            block_tables=torch.tensor(tables, dtype=torch.int32),
            query_start_loc_cpu=starts, seq_lens_cpu=seq_lens,
            max_query_len=max(len(t) for _, t in chunks), max_seq_len=max(seq_lens))
        hidden = self.model(torch.tensor(ids), torch.tensor(positions), self.kv_caches, meta)  # [T, hidden]
        logits = self.model.compute_logits(hidden)  # [T, vocab] fp32
        assert logits.dtype == torch.float32
        return list(logits.split([len(t) for _, t in chunks]))


def greedy(model: torch.nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    batch = PagedBatch(model)
    logits = batch.step([(0, prompt)])[0][-1]
    out: list[int] = []
    for _ in range(max_new_tokens):
        out.append(int(logits.argmax()))
        logits = batch.step([(0, [out[-1]])])[0][-1]
    return out


@torch.no_grad()
def hf_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    return hf(torch.tensor([tokens])).logits[0].float()  # [L, vocab]


def make_hf_model(config, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        # HF inits biases to 0 and norm scales to 1; perturb everything so those load paths count
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return hf


def random_tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(CASES))
def pair(request, tmp_path_factory):
    hf = make_hf_model(CASES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ours, _ = load_model(ModelConfig(model=str(path)), "cpu", progress=False)
    return hf, ours


def test_full_prompt(pair):
    hf, ours = pair
    tokens = random_tokens(13, ours.vocab_size, seed=1)
    (logits,) = PagedBatch(ours).step([(0, tokens)])
    torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_packed_sequences_of_different_lengths(pair):
    hf, ours = pair
    prompts = [random_tokens(n, ours.vocab_size, seed=n) for n in (5, 11, 8)]
    outs = PagedBatch(ours).step(list(enumerate(prompts)))
    for tokens, logits in zip(prompts, outs, strict=True):
        torch.testing.assert_close(logits, hf_logits(hf, tokens), atol=ATOL, rtol=RTOL)


def test_chunked_prefill_attends_to_cached_prefix(pair):
    hf, ours = pair
    a, b = random_tokens(17, ours.vocab_size, seed=2), random_tokens(9, ours.vocab_size, seed=3)
    batch = PagedBatch(ours)
    a1, b1 = batch.step([(0, a[:6]), (1, b[:4])])
    a2, b2 = batch.step([(0, a[6:11]), (1, b[4:])])
    (a3,) = batch.step([(0, a[11:])])
    torch.testing.assert_close(torch.cat([a1, a2, a3]), hf_logits(hf, a), atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(torch.cat([b1, b2]), hf_logits(hf, b), atol=ATOL, rtol=RTOL)


def test_batched_decode(pair):
    hf, ours = pair
    prompt_lens, steps = (3, 7, 5), 4
    seqs = [random_tokens(n + steps, ours.vocab_size, seed=10 + n) for n in prompt_lens]
    batch = PagedBatch(ours)
    got = [[logits] for logits in batch.step([(i, s[:n]) for i, (s, n) in enumerate(zip(seqs, prompt_lens, strict=True))])]
    for k in range(steps):  # every sequence advances one token per step: the q_len == 1 kernel path
        outs = batch.step([(i, [s[n + k]]) for i, (s, n) in enumerate(zip(seqs, prompt_lens, strict=True))])
        for i, logits in enumerate(outs):
            got[i].append(logits)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(torch.cat(got[i]), hf_logits(hf, seq), atol=ATOL, rtol=RTOL)


def test_greedy_matches_hf_generate(pair):
    hf, ours = pair
    prompt = random_tokens(6, ours.vocab_size, seed=4)
    hf.generation_config.eos_token_id = None  # a random model may emit "eos"; compare all 8 tokens
    with torch.no_grad():
        expected = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                               max_new_tokens=8, do_sample=False, pad_token_id=0)[0, len(prompt):].tolist()
    assert len(expected) == 8
    assert greedy(ours, prompt, 8) == expected


@pytest.mark.parametrize("case", ["llama", "llama3-rope", "llama-linear-rope"])
def test_rope_cache_matches_hf(case):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = CASES[case]()
    head_dim = config.hidden_size // config.num_attention_heads
    positions = torch.arange(config.max_position_embeddings)
    cos, sin = LlamaRotaryEmbedding(config)(torch.zeros(1, dtype=torch.float32), positions[None])  # [1, P, D]
    cache = build_cos_sin_cache(config.to_dict(), head_dim, config.max_position_embeddings)  # [P, D]
    torch.testing.assert_close(cache, torch.cat([cos[0, :, : head_dim // 2], sin[0, :, : head_dim // 2]], -1),
                               atol=1e-6, rtol=1e-6)


def test_unsupported_rope_type_is_refused():
    config = LlamaConfig(**_LLAMA_DIMS, rope_scaling={"rope_type": "dynamic", "factor": 2.0}).to_dict()
    with pytest.raises(ValueError, match="dynamic"):
        build_model(config, device="meta")


def test_alibi_slopes_match_hf():
    from transformers.models.bloom.modeling_bloom import _get_alibi_slopes

    for heads in range(1, 41):
        assert torch.equal(alibi_slopes(heads), _get_alibi_slopes(heads, torch.device("cpu"))), heads


def test_registry():
    assert get_model_class({"architectures": ["MistralForCausalLM"]}).__name__ == "MistralForCausalLM"
    assert get_model_class({"model_type": "gpt2"}).__name__ == "GPT2LMHeadModel"
    with pytest.raises(ValueError, match="unsupported model architecture T5ForConditionalGeneration"):
        get_model_class({"architectures": ["T5ForConditionalGeneration"]})
