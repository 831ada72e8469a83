"""A pipeline stage's share of a model: contiguous layers, as even as the count allows; only its own
checkpoint tensors loaded (the embedding on the first stage, and on the last too when the LM head is tied to
it; the final norm and LM head on the last); its activation-peak forward runs on its own layers alone."""

import pytest
import torch

from kvrelay.shared.config.engine import ModelConfig
from kvrelay.shared.engine.activation_peak import peak_forward
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.engine.parallel.pipeline import MissingLayer, stage_bounds


def test_stage_bounds_are_contiguous_and_even():
    assert stage_bounds(8, 2) == [(0, 4), (4, 8)]
    assert stage_bounds(7, 3) == [(0, 3), (3, 5), (5, 7)]
    assert stage_bounds(2, 2) == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        stage_bounds(2, 3)


@pytest.mark.parametrize(("arch", "embedding", "norm", "tied"), [("llama", "model.embed_tokens", "model.norm", False),
                                                                  ("gpt2", "transformer.wte", "transformer.ln_f", True)])
def test_each_stage_loads_its_own_tensors_and_profiles_its_own_layers(tiny_model_dirs, arch, embedding, norm, tied):
    config = ModelConfig(model=str(tiny_model_dirs[arch]), dtype="float32")
    first, _ = load_model(config, "cpu", progress=False, pipeline=(0, 2))
    last, _ = load_model(config, "cpu", progress=False, pipeline=(1, 2))
    for model, held in ((first, 0), (last, 1)):
        layers = model.decoder_layers()
        assert [not isinstance(layer, MissingLayer) for layer in layers] == [i == held for i in range(2)]
        assert model.kv_layers == 1
        peak_forward(model, 24, 2, 8, torch.float32, torch.device("cpu"))
    assert not isinstance(first.get_submodule(embedding), MissingLayer)
    assert isinstance(last.get_submodule(embedding), MissingLayer) != tied  # the tied head is the embedding
    assert isinstance(first.get_submodule(norm), MissingLayer)
    assert not isinstance(last.get_submodule(norm), MissingLayer)
    if not tied:
        assert isinstance(first.get_submodule("lm_head"), MissingLayer)
        assert not isinstance(last.get_submodule("lm_head"), MissingLayer)
