"""``kvrelay serve --config``: several models from the versioned repository behind one gateway, each
answering its own requests exactly as the offline engine does."""

import os
import shutil
import signal

import openai
import pytest

from kvrelay import LLM, SamplingParams
from kvrelay.shared.repo.model_import import import_model
from kvrelay.shared.repo.model_repo import ModelRepository
from kvrelay.shared.wire.redis_conn import sync_client
from tests.e2e.cluster import free_port
from tests.e2e.served import start_serve, until_ready

pytestmark = pytest.mark.slow


def test_two_models_from_the_repository(tmp_path, tiny_model_dirs, smollm2_dir, redis_url):
    repo = ModelRepository(tmp_path / "repo")
    sources = {}
    for arch in ("llama", "gpt2"):  # a real tokenizer beside the tiny weights, so text can be compared
        src = sources[arch] = tmp_path / arch
        shutil.copytree(tiny_model_dirs[arch], src)
        for f in smollm2_dir.iterdir():
            if f.name.startswith(("tokenizer", "special_tokens")):
                shutil.copy(f, src / f.name)
        import_model(repo, str(src), f"tiny-{arch}", progress=False)
    cfg = tmp_path / "serve.yaml"
    cfg.write_text(f"""
model_repo: {{type: local, path: {repo.root}, versioning: numbered}}
models:
  - {{name: tiny-llama, version: 1, device: cpu, precision: float32}}
  - {{name: tiny-gpt2, device: cpu, precision: float32}}
""")
    sync_client(redis_url).flushall()
    port, log = free_port(), tmp_path / "serve.log"
    proc = start_serve(["--config", str(cfg), "--port", str(port), "--redis-url", redis_url, "--max-model-len", "128",
                        "--mode", "unified"], log, dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1"))
    try:
        until_ready(proc, log, timeout=120)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        assert {m.id for m in client.models.list().data} == {"tiny-llama", "tiny-gpt2"}
        prompt = [5, 17, 99, 203, 7]
        for name, arch in (("tiny-llama", "llama"), ("tiny-gpt2", "gpt2")):
            offline = LLM(model=str(sources[arch]), dtype="float32", max_model_len=128)
            want = offline.generate([{"prompt_token_ids": prompt}],
                                    SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0].outputs[0]
            got = client.completions.create(model=name, prompt=prompt, max_tokens=8, temperature=0.0,
                                            extra_body={"ignore_eos": True})
            assert got.usage.completion_tokens == 8
            assert got.choices[0].text == want.text
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(30)
