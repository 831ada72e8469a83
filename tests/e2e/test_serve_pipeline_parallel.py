"""``kvrelay serve --mode unified --pipeline-parallel-size 2``: the unified worker runs its model as two
stage processes and answers as one process does; a stage killed with -9 takes its worker down with a clear
error, the supervisor restarts the worker and the request is answered after all. Prefill and decode
workers refuse the flag before loading."""

import subprocess
import sys

import psutil
import pytest

from kvrelay import LLM, SamplingParams
from tests.e2e.conftest import TINY_ENGINE
from tests.e2e.served import Served

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
PROMPT = "The capital of France is"


def _ranks(serve: psutil.Process) -> list[psutil.Process]:
    return [p for p in serve.children(recursive=True) if "kvrelay.shared.engine.ranks.rank_main" in p.cmdline()]


def test_unified_pp2_answers_like_one_process_and_survives_a_killed_stage(tiny_model_dir, tmp_path):
    with LLM(model=str(tiny_model_dir), dtype="float32", max_model_len=256) as llm:
        want = llm.generate(PROMPT, SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0].text
    argv = ["--mode", "unified", "--model", str(tiny_model_dir), *TINY_ENGINE, "--pipeline-parallel-size", "2"]
    with Served(argv, tmp_path / "serve.log") as served:
        client = served.client()

        def ask() -> str:
            return client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                             temperature=0.0).choices[0].text

        assert ask() == want
        serve = psutil.Process(served.proc.pid)
        (stage,) = _ranks(serve)
        stage.kill()
        assert ask() == want  # re-delivered to the restarted worker
        log = served.log.read_text(errors="replace")
        assert f"pipeline-parallel rank 1 of 2 (pid {stage.pid}) was killed by signal 9; the group is down" in log
        survivors = _ranks(serve)
        assert len(survivors) == 1 and survivors[0].pid != stage.pid
    gone, alive = psutil.wait_procs(survivors, timeout=30)
    assert not alive


@pytest.mark.parametrize("role", ["prefill-worker", "decode-worker"])
def test_handoff_roles_refuse_pipeline_parallelism_before_loading(role, tiny_model_dir):
    """The KV handoff carries one stage's layers until it learns parallel layouts."""
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", role, "--model", str(tiny_model_dir),
                           "--pipeline-parallel-size", "2", "--redis-url", "redis://127.0.0.1:1/0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().endswith("--pipeline-parallel-size: the KV handoff "
                                        f"{'moves' if role == 'prefill-worker' else 'fills'} one stage's layers; "
                                        "use a unified worker")
