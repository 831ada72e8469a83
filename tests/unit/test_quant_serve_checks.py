"""``kvrelay serve`` says a quantization its model cannot run in one line, exit 2, before it starts Redis or
any process: the flag against the checkpoint's own quantization_config, per model in the config file too."""

import subprocess
import sys

from kvrelay.shared.engine.quant.checkpoint import quantize_checkpoint


def serve(*argv: str, state) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--state-dir", str(state), *argv],
                          capture_output=True, text=True, timeout=120)


def test_quantization_contradicting_the_checkpoint(tiny_model_dirs, tmp_path):
    awq = quantize_checkpoint(tiny_model_dirs["llama"], tmp_path / "awq", "awq", group_size=32)
    proc = serve("--model", str(awq), "--quantization", "int8", state=tmp_path / "state")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == ("kvrelay serve: error: argument --quantization: awq: quantization int8 does not match "
                           "the checkpoint, which is quantized with awq (its config.json quantization_config); "
                           "leave --quantization unset\n")
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"models:\n  - {{name: plain, path: {tiny_model_dirs['llama']}, quantization: gptq}}\n")
    proc = serve("--config", str(cfg), state=tmp_path / "state")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"kvrelay serve: error: {cfg}: models[0].quantization: plain: quantization gptq "
                                  "needs a checkpoint quantized with gptq")
    assert proc.stderr.count("\n") == 1
