"""How `kvrelay serve` splits a CPU's cores between its workers, and that it decides without importing
torch whenever the answer does not depend on a GPU, or torch is a CPU build (the supervisor otherwise spends ~3 s
of CPU on it)."""

import argparse
import importlib.metadata
import subprocess
import sys

import pytest

from kvrelay.serve import _cpu_threads_per_worker


def args(device: str) -> argparse.Namespace:
    return argparse.Namespace(device=device)


def test_cpu_workers_split_the_cores(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert _cpu_threads_per_worker(args("cpu"), 2) == 4
    assert _cpu_threads_per_worker(args("cpu"), 3) == 2
    assert _cpu_threads_per_worker(args("cpu"), 16) == 1


@pytest.mark.parametrize("device,workers,omp", [("cpu", 1, None), ("cpu", 2, "3"), ("cuda", 2, None)])
def test_no_split_where_it_is_not_ours_to_make(monkeypatch, device, workers, omp):
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    assert _cpu_threads_per_worker(args(device), workers) is None


def test_torch_is_imported_only_to_ask_for_a_gpu():
    code = ("import os, sys, argparse; os.environ['OMP_NUM_THREADS'] = '2'\n"
            "from kvrelay.serve import _cpu_threads_per_worker as f\n"
            "assert f(argparse.Namespace(device='auto'), 2) is None and f(argparse.Namespace(device='cuda'), 2) is None\n"
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"


@pytest.mark.skipif(not importlib.metadata.version("torch").endswith("+cpu"), reason="torch here may see a GPU")
def test_on_a_cpu_build_of_torch_serve_plans_its_children_without_importing_it():
    code = ("import argparse, os, sys; os.environ.pop('OMP_NUM_THREADS', None)\n"
            "from kvrelay.cli import build_parser\n"
            "from kvrelay.serve import _cpu_threads_per_worker\n"
            "from kvrelay.serve_plan import models_to_serve, plan\n"
            "args = build_parser().parse_args(['serve', '--model', 'dummy:tiny-llama'])\n"
            "children = plan(args, models_to_serve(args), 'redis://127.0.0.1:6379/0')\n"
            "assert {c.config.engine.device for c in children if not c.is_gateway} == {'cpu'}\n"
            "assert _cpu_threads_per_worker(argparse.Namespace(device='auto'), 2) >= 1\n"
            "print('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
