"""The runner's side of the layer-by-layer handoff: a prefill worker's ``kv_stream`` hears of a prompt
only in the forward that computes its last chunk, then once per decoder layer, after that layer's KV
is in the cache and before the next layer's is, for every architecture; tokens are unchanged."""

import pytest

from kvrelay.shared.config.engine import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.engine import EngineCore
from kvrelay.shared.wire.sampling_params import SamplingParams

BS = 8


class Recorder:
    """Snapshots, at each reported layer, which layers of the finishing prompt's blocks hold KV."""

    def __init__(self, core: EngineCore):
        self.core = core
        self.begun: list[list[str]] = []
        self.layers: list[tuple[int, list[bool]]] = []
        self.blocks: list[int] = []

    def begin(self, finishing: list[tuple[str, list[int]]]) -> bool:
        self.begun.append([rid for rid, _ in finishing])
        self.blocks = finishing[0][1]
        return True

    def layer_done(self, layer: int) -> None:
        kv = self.core.kv.kv_cache[:, :, self.blocks]
        self.layers.append((layer, [bool(kv[i].abs().sum() > 0) for i in range(kv.shape[0])]))

    def end(self) -> None:
        self.layers.append((-1, []))


def _core(model_dir) -> EngineCore:
    return EngineCore(EngineConfig(
        model=ModelConfig(str(model_dir), dtype="float32", max_model_len=128),
        cache=CacheConfig(block_size=BS, num_gpu_blocks=64),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), device="cpu"))


def test_only_the_forward_of_the_last_chunk_reports(tiny_model_dirs):
    prompt = list(range(5, 75))  # 70 tokens, chunks of 32: the last chunk runs in the third step
    params = SamplingParams(max_tokens=1, temperature=0.0)
    plain = _core(tiny_model_dirs["llama"])
    plain.add_request(plain.make_request("r", prompt, params, None))
    want = [o.new_token_ids for _ in range(3) for o in plain.step()]
    core = _core(tiny_model_dirs["llama"])
    rec = Recorder(core)
    core.kv.set_layer_saver(rec)
    core.add_request(core.make_request("r", prompt, params, None))
    got = []
    for step in range(3):
        got += [o.new_token_ids for o in core.step()]
        assert len(rec.begun) == (step == 2)
    assert rec.begun == [["r"]] and got == want and len(want) == 1
    assert [layer for layer, _ in rec.layers] == [*range(core.kv.kv_cache.shape[0]), -1]
    assert core.runner._streaming is False


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bloom"])
def test_each_report_follows_its_layers_kv_write(tiny_model_dirs, arch):
    """A single-chunk prompt into an empty cache: each report must see exactly the layers at or below
    it written."""
    core = _core(tiny_model_dirs[arch])
    core.kv.kv_cache.zero_()
    rec = Recorder(core)
    core.kv.set_layer_saver(rec)
    core.add_request(core.make_request("r", list(range(5, 25)), SamplingParams(max_tokens=1), None))
    core.step()
    num_layers = core.kv.kv_cache.shape[0]
    assert rec.layers[:-1] == [(layer, [i <= layer for i in range(num_layers)]) for layer in range(num_layers)]
