"""Each ``--gpu-share`` mode on a GPU (``pytest -m gpu tests/gpu/test_gpu_share_gpu.py``; skips without CUDA):
``kvrelay serve --mode disaggregated`` starts under it and answers greedy prompts with timeslice's tokens
(CUDA graphs captured and replayed on the mode's compute stream), and the priority streams are what each role
asks for. A mode this machine cannot run (no MPS control program, a torch without green contexts) is a skip
that says why; serve itself refuses it in one line (tests/unit/test_gpu_share.py). ``auto``, the default, is
mps-priority with the measured split where the MPS control program is here."""

import shutil
from pathlib import Path

import pytest
import torch

from kvrelay.shared.worker import gpu_share
from tests.e2e.served import Served

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.timeout(600)]

PROMPTS = [[5, 17, 99, 203, 7], list(range(40, 140)), [1] * 33]
# a fixed KV size, not a fraction of the device: the suite runs a dozen processes at once, and each of its
# stacks sizing its KV from a share of the whole GPU ran the others out of memory. No warm-up: it runs every step
# shape on both workers before ready, five stacks here, while three prompts need a few of those shapes; the
# graphs are captured when the engine is built, warm-up or not, and tests/gpu/test_warmup_gpu.py is warm-up's test
ENGINE = ["--model", "dummy:smollm2-135m", "--load-format", "dummy", "--device", "cuda", "--max-model-len", "512",
          "--kv-cache-memory", str(512 << 20), "--max-num-seqs", "8", "--skip-warmup"]


def greedy(mode: str, tmp_path) -> list[str]:
    with Served(["--mode", "disaggregated", *ENGINE, "--gpu-share", mode], serve_log(mode, tmp_path),
                timeout=300) as served:
        client = served.client()
        listed = client.models.list().data
        # ready means a request for the model is served, so it must be listed; if not, /ready, the workers as the
        # gateway sees them and serve's log say which went: a worker that exited, one judged stalled, ...
        assert listed, f"/v1/models empty after ready; now:\n{served.state()}"
        model = listed[0].id
        return [client.completions.create(model=model, prompt=p, max_tokens=24, temperature=0.0).choices[0].text
                for p in PROMPTS]


def serve_log(mode: str, tmp_path) -> Path:
    return tmp_path / f"serve-{mode}.log"


@pytest.fixture(scope="module")
def timesliced(tmp_path_factory) -> list[str]:
    return greedy("timeslice", tmp_path_factory.mktemp("timeslice"))


@pytest.mark.parametrize("mode", ["priority", "mps", "mps-priority", "green"])
def test_each_mode_serves_timeslices_greedy_tokens(mode, timesliced, tmp_path):
    if mode.startswith("mps") and shutil.which("nvidia-cuda-mps-control") is None:
        pytest.skip("no nvidia-cuda-mps-control on this machine")
    if mode == "green" and not gpu_share.green_supported():
        pytest.skip(f"torch {torch.__version__} has no CUDA green contexts")
    assert greedy(mode, tmp_path) == timesliced


def test_auto_serves_timeslices_greedy_tokens_under_the_measured_split(timesliced, tmp_path):
    assert greedy("auto", tmp_path) == timesliced
    chosen = [line for line in serve_log("auto", tmp_path).read_text().splitlines() if "GPU share:" in line]
    if shutil.which("nvidia-cuda-mps-control") is None:
        assert not chosen, chosen  # no daemon: timeslice, nothing to say
    else:  # the daemon started: a fallback to timeslice on this machine would leave auto never tried
        assert any(("prefill-worker mps-priority on 90% of the SMs, decode-worker mps-priority on 100% of the SMs"
                    in line) for line in chosen), serve_log("auto", tmp_path).read_text()[-4000:]


def test_decode_computes_on_a_higher_priority_stream_than_prefill():
    device = torch.device("cuda")
    decode = gpu_share.compute_stream("priority", "decode", device, 50)
    prefill = gpu_share.compute_stream("priority", "prefill", device, 50)
    # lower is sooner; 0 is CUDA's lowest and every default stream's
    assert decode.priority < prefill.priority == torch.cuda.current_stream().priority == 0


@pytest.mark.skipif(not gpu_share.green_supported(), reason="this torch has no CUDA green contexts")
def test_a_green_share_is_whole_sm_groups():
    total = torch.cuda.get_device_properties(0).multi_processor_count
    sms = gpu_share.green_sms(0, 50)
    assert sms % gpu_share.GREEN_SM_GRANULE == 0 and 0 < sms <= total // 2 + gpu_share.GREEN_SM_GRANULE
    assert gpu_share.compute_stream("green", "prefill", torch.device("cuda"), 50) is not None
