"""What a process kvrelay starts imports before it does its work. Every ``kvrelay serve`` starts its supervisor,
a gateway and workers as fresh interpreters, and importing is most of what each spends its CPU on: the
supervisor (it plans, spawns and polls) needs no torch, transformers, aiohttp or numpy; a worker needs torch
but neither transformers (it tokenizes nothing) nor aiohttp (it serves no HTTP); a command that only reads
a config (``--help``, ``--print-config``, as tests and operators run by the hundred) needs no Redis client.
The gateway's side is tests/integration/test_gateway_no_torch.py. Each is checked in a fresh interpreter,
as the process starts."""

import json
import subprocess
import sys

HEAVY = ("torch", "transformers", "tokenizers", "aiohttp", "numpy")


def imported_by(*modules: str) -> list[str]:
    """Which of HEAVY a fresh interpreter holds after importing ``modules`` and building the CLI's parser,
    as ``python -m kvrelay.cli`` does before it hands off to a subcommand."""
    code = (f"import sys, {', '.join(modules)}\n"
            "import kvrelay.cli\nkvrelay.cli.build_parser()\n"
            f"print(__import__('json').dumps([m for m in {HEAVY!r} if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_serve_supervisor_imports_none_of_the_heavy_packages():
    assert imported_by("kvrelay.serve", "kvrelay.supervisor", "kvrelay.serve_plan") == []


def test_a_worker_imports_torch_but_not_transformers_nor_aiohttp():
    roles = ("kvrelay.workers", "kvrelay.prefill_worker.worker", "kvrelay.decode_worker.worker",
             "kvrelay.unified_worker.worker")
    imported = imported_by(*roles)
    assert "torch" in imported  # the check sees what a worker really imports
    assert [m for m in imported if m in ("transformers", "tokenizers", "aiohttp")] == []


def test_reading_a_config_imports_no_redis_client():
    # a Redis URL in the config is still checked (shared/config/declare.py): its grammar needs no redis-py;
    # the ZMQ secret is the session's (tests/zmq_secret.py), in the environment
    code = ("import sys\nfrom kvrelay.cli import main\n"
            "assert main(['gateway', '--redis-url', 'redis+sentinel://h:26379/m', '--print-config']) == 0\n"
            "assert main(['decode-worker', '--model', 'dummy:tiny-llama', '--redis-url', "
            "'redis-cluster://h:7000', '--print-config']) == 0\n"
            "print('redis' in sys.modules)")
    out = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert '"redis_url": "redis+sentinel://h:26379/m"' in out.stdout  # the configs were really read
    assert out.stdout.strip().splitlines()[-1] == "False"
