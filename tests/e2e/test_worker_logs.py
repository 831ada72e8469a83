"""What a worker says on its console, from real worker processes: its progress bar names its role (two
workers share kvrelay serve's terminal), its "serving" line names a real address or where its jobs
come from, never an empty one, and its warm-up ends before that line."""

import re
import time

import pytest

from tests.conftest import make_tiny_model
from tests.e2e.cluster import Cluster

pytestmark = pytest.mark.slow


def test_each_worker_names_its_role_and_where_it_serves(tmp_path, redis_url, smollm2_dir):
    model = make_tiny_model("llama", tmp_path / "tiny")
    for f in smollm2_dir.iterdir():
        if f.name.startswith("tokenizer"):
            (model / f.name).write_bytes(f.read_bytes())
    cluster = Cluster(redis_url, str(model), ["--dtype", "float32", "--served-model-name", "tiny"], tmp_path)
    cluster.redis.flushall()
    try:
        cluster.start_gateway()
        # each loads its own copy, so both show the load's progress (a worker mapping another's copy has none)
        cluster.start_worker("prefill", "p1", ["--no-share-weights"])
        cluster.start_worker("decode", "d1", ["--skip-warmup", "--no-share-weights"])
        cluster.wait_ready()
        # a worker registers, starts its threads and then says where it serves: the gateway can be ready first
        bound = time.monotonic() + 60
        while not all(" serving " in cluster.log(w) for w in ("p1", "d1")) and time.monotonic() < bound:
            time.sleep(0.1)
        prefill, decode = cluster.log("p1"), cluster.log("d1")
    finally:
        cluster.stop()
    assert "prefill worker: Loading weights" in prefill and "decode worker: Loading weights" in decode
    assert "prefill worker p1 serving tiny from its Redis streams" in prefill, prefill[-2000:]
    assert re.search(r"decode worker d1 serving tiny at tcp://127\.0\.0\.1:\d+\n", decode), decode[-2000:]
    assert not re.search(r"serving .* at \n", prefill + decode)
    # warm-up (no shape on the CPU, where nothing compiles) is done before the worker registers and serves
    assert prefill.index("warm-up done: 0 shapes") < prefill.index("serving tiny")
    assert "warm" not in decode  # --skip-warmup
