"""``kvrelay models import --quantization``: a real CLI process stores a quantized version in the repository,
with its manifest (checksums, the quantization), and the engine loads it with the quantization detected
from the stored config.json."""

import json
import subprocess
import sys

import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.repo.verified_files import verify_parallel


def kvrelay(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", *argv], capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("method", ["awq"])
def test_import_stores_a_quantized_version(tiny_model_dirs, tmp_path, method):
    repo = tmp_path / "repo"
    proc = kvrelay("models", "import", str(tiny_model_dirs["llama"]), "--name", "tiny", "--quantization", method,
                   "--group-size", "32", "--repo", str(repo))
    assert proc.returncode == 0, proc.stderr
    mv = ModelRepository(repo).get("tiny", 1)
    assert mv.quantization == ("awq" if method == "awq" else "compressed-tensors")
    assert f"(quantized: {method})" in mv.source
    verify_parallel(mv, ModelRepository(repo))  # every file matches its manifest checksum
    config = json.loads((repo / "tiny" / "1" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] in ("awq", "compressed-tensors")
    listed = kvrelay("models", "list", "--repo", str(repo))
    assert listed.returncode == 0 and mv.quantization in listed.stdout
    llm = LLM(model=mv.path, kv_cache_memory=1 << 22)
    model = llm.engine.core.runner.model
    assert model.quant is not None and model.quant.method == method
    out = llm.generate([{"prompt_token_ids": [5, 17, 33]}], SamplingParams(max_tokens=4, temperature=0.0))
    assert len(out[0].outputs[0].token_ids) == 4


def test_a_model_the_quantizer_does_not_take_is_one_line(tiny_model_dirs, tmp_path):
    proc = kvrelay("models", "import", str(tiny_model_dirs["gpt2"]), "--name", "g", "--quantization", "int8",
                   "--repo", str(tmp_path / "repo"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"kvrelay models import: error: quantizing a checkpoint supports the Llama family; "
        f"{tiny_model_dirs['gpt2']} is 'gpt2'"]
