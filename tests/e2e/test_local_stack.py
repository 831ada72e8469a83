"""What the multi-process benchmarks start their stacks with (kvrelay/local_cluster.py, kvrelay/nginx.py):
a gateway, a prefill and a decode worker as processes behind nginx running the shipped configuration,
ready when it says so, answering through nginx, and gone after ``stop``."""

import shutil

import openai
import pytest

from kvrelay.local_cluster import LocalCluster, free_port
from kvrelay.nginx import loopback_nginx
from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.conftest import TINY_ENGINE

pytestmark = pytest.mark.slow


def test_local_cluster_behind_nginx_serves_and_stops(tiny_model_dir, tmp_path):
    nginx = shutil.which("nginx") or pytest.skip("nginx is not installed (apt-get install -y nginx)")
    with EmbeddedRedis() as redis_url:
        cluster = LocalCluster(redis_url, tmp_path, cli_flags=["--log-level", "WARNING"])
        try:
            port = cluster.start_gateway()
            cluster.start_worker("prefill", "p1", str(tiny_model_dir), TINY_ENGINE)
            cluster.start_worker("decode", "d1", str(tiny_model_dir), TINY_ENGINE)
            listen = free_port()
            with loopback_nginx(nginx, [port], listen, tmp_path / "nginx", tmp_path / "nginx.log") as proc:
                cluster.wait_ready(timeout=180)
                client = openai.OpenAI(base_url=f"http://127.0.0.1:{listen}/v1", api_key="none", max_retries=5)
                out = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, extra_body={
                    "ignore_eos": True})
                assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
            assert proc.returncode is not None  # nginx stopped with the context
        finally:
            cluster.stop()
    assert all(p.returncode is not None for p in cluster.procs.values())
