"""Property-based fuzzing of the gateway from its own OpenAPI description (schemathesis), against a live
gateway with real workers on a tiny model: whatever schemathesis sends, valid or not, the gateway never
answers 5xx and no process dies. Bounded: a fixed number of examples per operation (schemathesis's
--max-time is a budget it fills, not a cap, so it is not used), a wall-clock timeout on the run, and a
fixed seed (a failure reproduces)."""

import json
import os
import re
import shutil
import subprocess
import sys

import httpx
import pytest
import yaml

from kvrelay.shared.wire.redis_conn import EmbeddedRedis
from tests.e2e.cluster import Cluster
from tests.e2e.conftest import TINY_ENGINE, TINY_VOCAB

pytestmark = pytest.mark.slow
MAX_EXAMPLES = 15
TIME_BUDGET_S = 300  # a hang, not a slow run: alone the run takes well under a minute, beside another test file 2 min


@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory):
    with EmbeddedRedis() as redis_url:
        # a 96-token context: valid requests default to (and are bounded by) short outputs, which keeps
        # the largest legal fan-out (n=128) quick on two cores
        c = Cluster(redis_url, str(tiny_model_dir), TINY_ENGINE + ["--max-model-len", "96"],
                    tmp_path_factory.mktemp("fuzz"))
        # a short request timeout keeps the biggest legal requests (n=128, long outputs) bounded
        with c.disaggregated(gateway_extra=["--request-timeout", "60"]):
            yield c


def test_served_openapi_matches_the_routes(cluster):
    spec = httpx.get(f"http://127.0.0.1:{cluster.port}/openapi.json").json()
    assert spec["openapi"].startswith("3.")
    from kvrelay.gateway.routes import ROUTES

    served = {(r.method.lower(), r.path) for r in ROUTES if not r.path.startswith(("/admin", "/metrics", "/openapi"))}
    described = {(m, p) for p, ops in spec["paths"].items() for m in ops}
    assert described == served


def test_schemathesis_finds_no_server_error(cluster, tmp_path):
    exe = shutil.which("schemathesis", path=os.path.dirname(sys.executable)) or shutil.which("schemathesis")
    if exe is None:
        pytest.skip("schemathesis is not installed (pip install -e '.[dev]')")
    base = f"http://127.0.0.1:{cluster.port}"
    report = tmp_path / "report.json"
    # The served document is generic; tailored to this deployment (its one model name, its vocabulary)
    # most generated requests get past validation into the workers, where crashes live.
    spec = httpx.get(f"{base}/openapi.json").json()
    schemas = spec["components"]["schemas"]
    schemas["Sampling"]["properties"]["model"] = {"type": "string", "enum": ["tiny"]}
    schemas["TokenIds"]["items"]["maximum"] = TINY_VOCAB - 1
    spec_path = tmp_path / "openapi.json"
    spec_path.write_text(json.dumps(spec))
    proc = subprocess.run(
        [exe, "run", str(spec_path), "--url", base, "--checks", "not_a_server_error",
         "--phases", "examples,coverage,fuzzing", "--max-examples", str(MAX_EXAMPLES),
         "--seed", "1", "--request-timeout", "90",
         "--generation-database", "none", "--report", "json", "--report-json-path", str(report),
         "--no-color"],
        capture_output=True, text=True, timeout=TIME_BUDGET_S, env=dict(os.environ, NO_COLOR="1"),
        cwd=tmp_path)  # schemathesis keeps a .schemathesis/ cache in its working directory
    assert proc.returncode == 0, f"exit {proc.returncode}\n" + proc.stdout[-6000:] + proc.stderr[-2000:]
    generated = re.search(r"(\d+) generated", proc.stdout)  # it ran cases, not just loaded the schema
    assert generated and int(generated.group(1)) >= 100, proc.stdout[-2000:]
    for name, p in cluster.procs.items():
        assert p.poll() is None, f"{name} died during fuzzing:\n{cluster.log(name)[-3000:]}"
    # the workers still answer a real request after the fuzzing
    ok = httpx.post(f"{base}/v1/completions", json={"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 4,
                                                     "temperature": 0.0, "ignore_eos": True}, timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 4


def test_openapi_document_is_valid_yaml_with_every_schema_resolvable():
    from pathlib import Path

    spec = yaml.safe_load((Path(__file__).parents[2] / "gateway" / "openapi.yaml").read_text())
    refs: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            if "$ref" in node:
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(spec)
    assert refs
    for ref in refs:
        node = spec
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]  # KeyError: a dangling $ref
