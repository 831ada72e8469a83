"""What a model's HF ``config.json`` says about the sequences it can serve, read without building the
model: the repository records it in each version's manifest, the engine sizes its KV cache by it."""


def max_model_len(hf_config: dict) -> int:
    """Longest sequence we can serve exactly: the trained context (ALiBi models name it seq_length,
    if at all), capped at a sliding attention window since the kernels attend over everything."""
    trained = 2048
    for key in ("max_position_embeddings", "n_positions", "seq_length"):
        if hf_config.get(key):
            trained = int(hf_config[key])
            break
    window = hf_config.get("sliding_window")
    if window and hf_config.get("use_sliding_window", True):  # Qwen2 names the window but may not use it
        return min(trained, int(window))
    return trained
