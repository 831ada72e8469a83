"""--gpu-share and --gpu-sm-percent: parsed and checked as flags, handed by kvrelay serve to each role (its share
of the SMs, and under mps the environment that makes it an MPS client), refused in one line where a mode cannot
run (a CPU device, a unified worker's priority), and the compute stream each mode picks."""

import contextlib
import dataclasses
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.cli import build_parser
from kvrelay.mps_daemon import MpsDaemon
from kvrelay.serve import _env, _start_mps
from kvrelay.serve_plan import models_to_serve, plan
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.handover import module_argv
from kvrelay.shared.worker import gpu_share


def cli(argv: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run([*module_argv("kvrelay.cli"), *argv], capture_output=True, text=True, timeout=300)


def serve_plan(argv: list[str]):
    args = build_parser().parse_args(["serve", "--model", "dummy:tiny-llama", *argv])
    return {c.command: c for c in plan(args, models_to_serve(args), "redis://127.0.0.1:6379/0")}


@pytest.mark.parametrize("argv,message", [
    (["--gpu-share", "slices"], "argument --gpu-share: invalid choice: 'slices'"),
    (["--gpu-sm-percent", "0"], "argument --gpu-sm-percent: Input should be greater than or equal to 1"),
    (["--gpu-sm-percent", "101"], "argument --gpu-sm-percent: Input should be less than or equal to 100"),
])
def test_a_bad_value_is_one_line_naming_the_flag(argv, message):
    proc = cli(["prefill-worker", "--model", "dummy:tiny-llama", *argv, "--print-config"])
    assert proc.returncode == 2
    assert message in proc.stderr.strip().splitlines()[-1]


def test_serve_gives_each_role_its_share_and_mps_its_environment():
    children = serve_plan(["--device", "cuda", "--gpu-share", "mps", "--gpu-sm-percent", "30"])
    prefill, decode = children["prefill-worker"], children["decode-worker"]
    assert (prefill.config.gpu_share, decode.config.gpu_share) == ("mps", "mps")
    assert (prefill.config.gpu_sm_percent, decode.config.gpu_sm_percent) == (30, 70)
    assert _env(prefill, None)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "30"
    assert _env(decode, None)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "70"
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in _env(children["gateway"], None)
    children = serve_plan(["--device", "cuda", "--gpu-share", "mps", "--gpu-sm-percent", "60",
                           "--decode-gpu-sm-percent", "80"])  # MPS lets shares overlap
    assert _env(children["decode-worker"], None)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "80"
    children = serve_plan(["--device", "cuda", "--gpu-share", "mps-priority", "--gpu-sm-percent", "40"])
    assert _env(children["decode-worker"], None)["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "60"
    children = serve_plan(["--device", "cuda", "--gpu-share", "priority"])
    assert [children[c].config.gpu_share for c in ("prefill-worker", "decode-worker")] == ["priority", "priority"]
    assert "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE" not in _env(children["prefill-worker"], None)  # no MPS, no share


def stand_in_control(folder: Path, script: str) -> Path:
    """An nvidia-cuda-mps-control of ours (no MPS on this machine; the GPU suite runs the real one)."""
    program = folder / "nvidia-cuda-mps-control"
    program.parent.mkdir(exist_ok=True)
    program.write_text(f"#!/bin/sh\n{script}\n")
    program.chmod(program.stat().st_mode | stat.S_IXUSR)
    return program


@pytest.fixture
def mps_control(monkeypatch, tmp_path) -> Path:
    program = stand_in_control(tmp_path / "bin", "cat > /dev/null")
    monkeypatch.setenv("PATH", f"{program.parent}{os.pathsep}{os.environ['PATH']}")
    return program


def shares(children) -> dict[str, tuple[str, int, str | None]]:
    return {c.command: (c.config.gpu_share, c.config.gpu_sm_percent, c.env.get(gpu_share.MPS_SHARE_ENV))
            for c in children.values() if not c.is_gateway}


def test_auto_is_the_default_and_on_the_cpu_timeslice_that_sets_nothing(mps_control):
    children = serve_plan(["--device", "cpu"])
    assert {c.config.gpu_share for c in children.values() if not c.is_gateway} == {"timeslice"}
    assert all(not c.env for c in children.values())


def test_auto_on_one_gpu_is_mps_priority_with_prefill_on_90_percent(mps_control):
    assert shares(serve_plan(["--device", "cuda"])) == {"prefill-worker": ("mps-priority", 90, "90"),
                                                        "decode-worker": ("mps-priority", 100, "100")}
    assert shares(serve_plan(["--device", "cuda:0", "--gpu-share", "auto"]))["prefill-worker"][0] == "mps-priority"


@pytest.mark.parametrize("argv", [
    ["--mode", "unified"],  # one process: nothing to share
    ["--tensor-parallel-size", "2"],  # a rank group: not what the measured split is for
    ["--decode-pipeline-parallel-size", "2"],
])
def test_auto_is_timeslice_beyond_one_process_per_role_on_one_gpu(mps_control, monkeypatch, argv):
    monkeypatch.setattr("kvrelay.workers._check_group", lambda *a, **k: None)  # its check needs that many GPUs
    assert {mode for mode, _, env in shares(serve_plan(["--device", "cuda", *argv])).values()} == {"timeslice"}


def test_auto_is_timeslice_without_the_mps_control_program(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert shares(serve_plan(["--device", "cuda"])) == {"prefill-worker": ("timeslice", 50, None),
                                                        "decode-worker": ("timeslice", 50, None)}


@pytest.mark.parametrize("option", ["--gpu-sm-percent", "--decode-gpu-sm-percent"])
def test_auto_refuses_a_share_of_the_sms(mps_control, option):
    with pytest.raises(ConfigError) as err:
        serve_plan(["--device", "cuda", option, "70"])
    assert str(err.value) == (f"argument {option}: only with --gpu-share mps, mps-priority or green (--gpu-share auto "
                              "chooses the shares itself)")


def test_auto_whose_mps_daemon_does_not_start_serves_timesliced(monkeypatch, tmp_path, caplog):
    stand_in_control(tmp_path / "bin", "echo 'cannot open the pipe folder' >&2\nexit 1")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    for argv in (["--gpu-share", "mps-priority"], []):  # by name, one line; chosen by auto, a fallback said
        children = serve_plan(["--device", "cuda", *argv])
        with contextlib.ExitStack() as stack:
            if argv:
                with pytest.raises(ConfigError, match="^argument --gpu-share: nvidia-cuda-mps-control -d failed"):
                    _start_mps(build_parser().parse_args(["serve", *argv]), list(children.values()), stack)
                continue
            with caplog.at_level("WARNING", logger="kvrelay.serve"):
                _start_mps(build_parser().parse_args(["serve"]), list(children.values()), stack)
    assert shares(children) == {"prefill-worker": ("timeslice", 50, None), "decode-worker": ("timeslice", 50, None)}
    assert caplog.messages == ["--gpu-share auto: timeslice, as the MPS daemon did not start (argument --gpu-share: "
                               "nvidia-cuda-mps-control -d failed (exit 1): cannot open the pipe folder)"]


def test_auto_whose_mps_daemon_starts_makes_each_worker_its_client(mps_control, caplog):
    children = serve_plan(["--device", "cuda"])
    with contextlib.ExitStack() as stack, caplog.at_level("INFO", logger="kvrelay.serve"):
        _start_mps(build_parser().parse_args(["serve"]), list(children.values()), stack)
        pipes = {c.env.get("CUDA_MPS_PIPE_DIRECTORY") for c in children.values() if not c.is_gateway}
        assert len(pipes) == 1 and Path(pipes.pop()).is_dir()
        assert "CUDA_MPS_PIPE_DIRECTORY" not in children["gateway"].env
    assert caplog.messages == ["GPU share: prefill-worker mps-priority on 90% of the SMs, decode-worker mps-priority "
                               "on 100% of the SMs (--gpu-share auto)"]


@pytest.mark.parametrize("argv,message", [
    (["--device", "cpu", "--gpu-share", "priority"],
     "argument --gpu-share: priority needs a CUDA device (--device cpu); on the CPU only timeslice"),
    (["--device", "cuda", "--mode", "unified", "--gpu-share", "priority"],
     "argument --gpu-share: priority orders a prefill worker's stream below a decode worker's; a unified worker is "
     "both"),
    (["--device", "cuda", "--mode", "unified", "--decode-gpu-sm-percent", "40"],
     "argument --decode-gpu-sm-percent: only with --mode disaggregated (a unified worker has one share, "
     "--gpu-sm-percent)"),
])
def test_serve_refuses_a_mode_its_workers_cannot_run(argv, message):
    with pytest.raises(ConfigError) as err:
        serve_plan(argv)
    assert str(err.value) == message


NO_SHARE = "only with --gpu-share mps, mps-priority or green (--gpu-share {} gives no worker a share of the SMs)"


@pytest.mark.parametrize("mode", ["timeslice", "priority"])
@pytest.mark.parametrize("option,value", [("--gpu-sm-percent", "60"), ("--gpu-sm-percent", "50"),
                                          ("--decode-gpu-sm-percent", "70")])
def test_serve_refuses_a_share_of_the_sms_that_its_mode_would_not_apply(mode, option, value):
    with pytest.raises(ConfigError) as err:
        serve_plan(["--device", "cuda", "--gpu-share", mode, option, value])
    assert str(err.value) == f"argument {option}: {NO_SHARE.format(mode)}"


@pytest.mark.parametrize("argv", [["--gpu-share", "priority", "--gpu-sm-percent", "60"],
                                  ["--gpu-sm-percent", "50"]])  # given, its default is refused too
def test_a_worker_refuses_a_share_of_the_sms_that_its_mode_would_not_apply(argv):
    proc = cli(["decode-worker", "--model", "dummy:tiny-llama", "--device", "cuda", *argv, "--print-config"])
    assert proc.returncode == 2
    said = NO_SHARE.format("priority") if argv[0] == "--gpu-share" else NO_SHARE.format("auto").replace(
        "gives no worker a share of the SMs", "chooses the shares itself")
    assert proc.stderr.strip().splitlines()[-1] == f"kvrelay decode-worker: error: argument --gpu-sm-percent: {said}"


def test_a_config_with_a_share_of_the_sms_its_mode_would_not_apply_is_refused():
    config = serve_plan(["--device", "cuda", "--gpu-share", "priority"])["decode-worker"].config
    assert config.gpu_sm_percent == 50  # the default: no share given
    with pytest.raises(ValueError, match=re.escape(f"argument --gpu-sm-percent: {NO_SHARE.format('priority')}")):
        dataclasses.replace(config, gpu_sm_percent=70)


def test_a_rank_group_is_refused():
    # this machine has no GPUs for serve's own group check to pass: the worker's config is changed after it
    config = serve_plan(["--device", "cuda", "--gpu-share", "mps"])["decode-worker"].config
    group = dataclasses.replace(config, engine=dataclasses.replace(config.engine, tensor_parallel_size=2))
    with pytest.raises(ConfigError) as err:
        gpu_share.check(group)
    assert str(err.value) == ("argument --gpu-share: mps is for one process per role; --tensor-parallel-size and "
                              "--pipeline-parallel-size must be 1")


@pytest.mark.skipif(gpu_share.green_supported(), reason="this torch has green contexts")
def test_green_without_green_contexts_is_refused():
    with pytest.raises(ConfigError, match="^argument --gpu-share: green needs CUDA green contexts"):
        serve_plan(["--device", "cuda", "--gpu-share", "green"])


def test_a_cpu_worker_refuses_mps_before_anything_loads():
    # no Redis answers at this URL: the refusal comes before the worker would connect or load
    proc = cli(["decode-worker", "--model", "dummy:tiny-llama", "--device", "cpu", "--gpu-share", "mps",
                "--redis-url", "redis://127.0.0.1:1/0"])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("kvrelay decode-worker: error: argument --gpu-share: mps needs a "
                                                    "CUDA device (--device cpu); on the CPU only timeslice")


def test_priority_puts_decode_above_prefill(monkeypatch):
    # an extra layer over the GPU tests (tests/gpu/test_gpu_share_gpu.py): the priority each role asks for
    made = []
    monkeypatch.setattr("torch.cuda.Stream", lambda device, priority=0: made.append(priority) or priority)
    decode = gpu_share.compute_stream("priority", "decode", "cuda", 50)
    prefill = gpu_share.compute_stream("priority", "prefill", "cuda", 50)
    assert made == [decode, prefill] and decode < prefill == 0  # lower is sooner; 0 is CUDA's lowest
    assert gpu_share.compute_stream("mps-priority", "decode", "cuda", 50) == decode
    assert gpu_share.compute_stream("timeslice", "decode", "cuda", 50) is None
    assert gpu_share.compute_stream("mps", "decode", "cuda", 50) is None
    assert made == [decode, prefill, decode]


def test_mps_without_its_control_program_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))
    daemon = MpsDaemon(str(tmp_path / "mps"))
    with pytest.raises(ConfigError, match="^argument --gpu-share: mps needs nvidia-cuda-mps-control on PATH"):
        daemon.start()


def test_mps_daemon_runs_in_its_own_folders_and_quits(monkeypatch, tmp_path):
    # a stand-in that logs how it was called
    log = tmp_path / "calls"
    program = stand_in_control(tmp_path / "bin", f'echo "$* $(cat) $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY" >> {log}')
    monkeypatch.setenv("PATH", f"{program.parent}{os.pathsep}{os.environ['PATH']}")
    daemon = MpsDaemon(str(tmp_path / "mps")).start()
    dirs = f"{tmp_path}/mps/pipe {tmp_path}/mps/log"
    assert Path(daemon.env["CUDA_MPS_PIPE_DIRECTORY"]).is_dir() and Path(daemon.env["CUDA_MPS_LOG_DIRECTORY"]).is_dir()
    daemon.stop()
    assert log.read_text().splitlines() == [f"-d  {dirs}", f" get_server_list {dirs}", f" quit {dirs}"]
    assert not (tmp_path / "mps").exists()


def test_mps_daemon_that_fails_says_why(monkeypatch, tmp_path):
    stand_in_control(tmp_path, "echo 'An instance of this daemon is already running' >&2\nexit 1")
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError) as err:
        MpsDaemon(str(tmp_path / "mps")).start()
    assert str(err.value) == ("argument --gpu-share: nvidia-cuda-mps-control -d failed (exit 1): An instance of this "
                              "daemon is already running")


def test_serve_stays_free_of_torch_with_the_gpu_share_check():
    code = "import sys\nimport kvrelay.serve_plan\nprint('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
