"""HF-style config dicts of real model shapes, for ``--load-format dummy`` (our machines reach no
hub) and for fast tests. Values follow each model's published config.json."""

import copy

DUMMY_PREFIX = "dummy:"  # --model dummy:<preset>: the preset's shape with random weights

_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
          "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False}
_GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_inner": None, "activation_function": "gelu_new",
         "layer_norm_epsilon": 1e-5, "tie_word_embeddings": True}
_BLOOM = {"architectures": ["BloomForCausalLM"], "model_type": "bloom", "layer_norm_epsilon": 1e-5,
          "apply_residual_connection_post_layernorm": False, "tie_word_embeddings": True}

PRESETS: dict[str, dict] = {
    "llama-3-8b": {
        **_LLAMA, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
        "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
        "bos_token_id": 128000, "eos_token_id": 128001,
    },
    "llama-2-7b": {
        **_LLAMA, "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
        "num_key_value_heads": 32, "intermediate_size": 11008, "vocab_size": 32000,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "qwen2-0.5b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_act": "silu",
        "hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "intermediate_size": 4864, "vocab_size": 151936, "max_position_embeddings": 131072,
        "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
        "use_sliding_window": False, "sliding_window": 131072, "bos_token_id": 151643, "eos_token_id": 151643,
    },
    "smollm2-135m": {
        **_LLAMA, "hidden_size": 576, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "head_dim": 64, "intermediate_size": 1536, "vocab_size": 49152,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    },
    "gpt2": {
        **_GPT2, "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12,
        "bos_token_id": 50256, "eos_token_id": 50256,
    },
    "bloom-560m": {
        **_BLOOM, "vocab_size": 250880, "hidden_size": 1024, "n_layer": 24, "n_head": 16, "seq_length": 2048,
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 3,
    },
    "tiny-llama": {
        **_LLAMA, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "intermediate_size": 128, "vocab_size": 512,
        "max_position_embeddings": 512, "rope_theta": 10000.0, "rms_norm_eps": 1e-6,
        "bos_token_id": 1, "eos_token_id": 2,
    },
    "tiny-gpt2": {
        **_GPT2, "vocab_size": 512, "n_positions": 512, "n_embd": 64, "n_layer": 2, "n_head": 4,
        "bos_token_id": 0, "eos_token_id": 0,
    },
    "tiny-bloom": {
        **_BLOOM, "vocab_size": 512, "hidden_size": 64, "n_layer": 2, "n_head": 4, "seq_length": 512,
        "bos_token_id": 1, "eos_token_id": 2,
    },
}


def get_preset(name: str) -> dict:
    """A fresh copy (callers may edit it) of the named preset's config."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(PRESETS))}")
    return copy.deepcopy(PRESETS[name])
