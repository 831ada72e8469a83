"""The gateway imports the wire format and a tokenizer loader, nothing of the engine: a fresh process that
imports the app, builds it and serves requests (chat template, tokenization, a streamed completion) never
imports torch or transformers' model code (~200 MB resident it does not need)."""

import json
import subprocess
import sys
from pathlib import Path

from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.integration.gateway_harness import MODEL, REPLY, FakeWorker, build_tokenizer, free_port

_GATEWAY = """
import asyncio, json, os, sys
sys.path.append(os.getcwd())  # `tests`, after site-packages: the checkout's kernels/ must not shadow anything
import aiohttp
from aiohttp import web
from kvrelay.gateway.app import create_app
from tests.integration.gateway_harness import gateway_config  # what it imports, the gateway imports too

HEAVY = ("torch", "transformers.configuration_utils", "transformers.modeling_utils", "kvrelay.shared.engine")

async def main(redis_url, port, model):
    imported = [m for m in HEAVY if m in sys.modules]
    runner = web.AppRunner(create_app(gateway_config(redis_url, port=port)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    url = f"http://127.0.0.1:{port}/v1"
    texts = []
    async with aiohttp.ClientSession() as http:
        chat = {"model": model, "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 32}
        async with http.post(f"{url}/chat/completions", json=chat) as r:
            texts.append((await r.json())["choices"][0]["message"]["content"])
        stream = {"model": model, "prompt": "the lazy dog " * 4, "max_tokens": 32, "stream": True}
        async with http.post(f"{url}/completions", json=stream) as r:
            pieces = [json.loads(line[6:])["choices"][0]["text"] async for line in r.content
                      if line.startswith(b"data: {")]
        texts.append("".join(pieces))
    await runner.cleanup()
    served = [m for m in HEAVY if m in sys.modules]
    print(json.dumps({"at_import": imported, "after_serving": served, "texts": texts}))

asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
"""


def test_gateway_process_never_imports_torch(tmp_path):
    tokenizer_dir = build_tokenizer(tmp_path / "tokenizer")
    with EmbeddedRedis() as url:
        worker = FakeWorker(url, tokenizer_dir).start()
        try:
            out = subprocess.run([sys.executable, "-c", _GATEWAY, url, str(free_port()), MODEL], capture_output=True,
                                 text=True, timeout=120, cwd=Path(__file__).parents[2])
        finally:
            worker.stop()
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["texts"] == [REPLY, REPLY]  # it really served: tokenized, queued, detokenized
    assert report["at_import"] == [] and report["after_serving"] == []


def test_the_gateway_command_loads_no_torch_to_parse_its_flags():
    # `kvrelay gateway` goes through the CLI, which also knows the benchmarks (they import torch): they
    # must load only when a benchmark runs.
    probe = ("import sys; from kvrelay.cli import main; code = main(['gateway', '--port', '8123', '--print-config']);"
             "print(code, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "0 False"
    assert '"port": 8123' in out.stdout
