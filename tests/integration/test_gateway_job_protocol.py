"""The jobs a real gateway queues carry its wire protocol version (``Job.protocol``), as a worker reads them back
from the Redis stream: for a gateway process of this version, and for one of the next, whose jobs carry the field
on the wire (protocol 1 leaves it off, a missing one reading as 1, so at 1 only the next version's gateway can
show the field is really set). The next version is this code with PROTOCOL_VERSION raised before any message
class is defined, as a newer release defines it."""

import subprocess
import sys
from pathlib import Path

import httpx
import msgpack
import pytest

from kvrelay.shared.wire import redis_keys as keys
from kvrelay.shared.wire.codec import decode
from kvrelay.shared.wire.protocol import Job
from kvrelay.shared.wire.redis_conn import EmbeddedRedis, sync_client
from kvrelay.shared.wire.version import PROTOCOL_VERSION
from tests.integration.gateway_harness import MODEL, REPLY, FakeWorker, build_tokenizer, free_port

_GATEWAY = """
import asyncio, os, sys
from kvrelay.shared.wire import version
version.PROTOCOL_VERSION = int(sys.argv[3])  # before protocol.py defines Job, whose default it is
sys.path.append(os.getcwd())  # `tests`, after site-packages: the checkout's kernels/ must not shadow anything
from aiohttp import web
from kvrelay.gateway.app import create_app
from tests.integration.gateway_harness import gateway_config

async def main(redis_url, port):
    runner = web.AppRunner(create_app(gateway_config(redis_url, port=port)))
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("serving", flush=True)
    await asyncio.to_thread(sys.stdin.read)  # until the test closes our stdin
    await runner.cleanup()

asyncio.run(main(sys.argv[1], int(sys.argv[2])))
"""


@pytest.mark.parametrize("version", [PROTOCOL_VERSION, PROTOCOL_VERSION + 1])
def test_the_jobs_a_gateway_queues_carry_its_protocol_version(tmp_path, version):
    tokenizer_dir = build_tokenizer(tmp_path / "tokenizer")
    port = free_port()
    with EmbeddedRedis() as url:
        worker = FakeWorker(url, tokenizer_dir).start()
        gateway = subprocess.Popen([sys.executable, "-P", "-c", _GATEWAY, url, str(port), str(version)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   cwd=Path(__file__).parents[2])
        try:
            started = gateway.stdout.readline()
            assert started == "serving\n", started + gateway.stdout.read()[-3000:]
            reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                               json={"model": MODEL, "prompt": "hello there", "max_tokens": 32})
            assert reply.status_code == 200, reply.text
            assert reply.json()["choices"][0]["text"] == REPLY  # queued and served end to end
            (_entry_id, fields), = sync_client(url).xrange(keys.prefill_stream(MODEL))  # acked, not deleted
        finally:
            gateway.stdin.close()
            gateway.wait(30)
            worker.stop()
    raw = fields[keys.JOB_FIELD.encode()]
    assert decode(raw, Job).protocol == version
    on_wire = msgpack.unpackb(raw, raw=False)
    assert on_wire.get("protocol") == (None if version == 1 else version)  # left off at 1 (it reads as 1 then)
