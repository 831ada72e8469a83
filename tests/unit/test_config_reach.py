"""Every flag of every role reaches the process that uses it. Each flag gets a value other than its
default; ``kvrelay serve --print-config`` starts every child as it would to serve (config as JSON on
stdin), each child prints the config it resolved, and the test finds each value where the child keeps
it. The roles started on their own (``kvrelay gateway --print-config ...``) are walked the same way."""

import json
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from kvrelay.cli_args import GATEWAY_FLAGS, SERVE_FLAGS, WORKER_FLAGS
from kvrelay.shared.config import role_settings
from kvrelay.shared.config.flags import Flag, is_switch
from kvrelay.shared.config.serve import WORKER_RENAMES

pytestmark = pytest.mark.slow

# Values a generic rule would get wrong (a constraint, a format, a path that must resolve).
CHOSEN = {"--model": "dummy:tiny-llama", "--device": "cuda:1", "--redis-url": "redis://127.0.0.1:6390/3",
          "--gpu-memory-utilization": 0.5, "--admin-key": "0123456789abcdef-admin", "--block-size": 32,
          "--tenant-kv-quota": 0.25, "--api-server-count": 2, "--mode": "unified",
          "--model-repo": str(Path(__file__).parent), "--tokenizer": str(Path(__file__).parent),
          "--tool-call-parser": "hermes", "--quantization": "int8",
          "--gpu-share": "mps"}  # priority is for two roles (not --mode unified), green for a torch that has it
# --config: the models file (tests/unit/test_config_yaml.py and the e2e serve_config test); the ZMQ secret's
# two flags exclude each other and the secret the tests run under (tests/unit/test_zmq_secret.py); a rank
# group's sizes are checked against the model, the devices and async scheduling before any child starts, so
# they cannot take arbitrary values beside every other flag: test_parallel_sizes_reach_every_worker below
GROUP = {"--tensor-parallel-size", "--pipeline-parallel-size"}
DECODE_GROUP = {"--decode-tensor-parallel-size", "--decode-pipeline-parallel-size",  # serve's, disaggregated only
                "--decode-gpu-sm-percent"}
# A setting that takes effect only under another's value (shared/config/depends.py) is refused beside a value of the
# other that leaves it none: the batch queue needs a pipeline (GROUP; test_parallel_sizes_reach_every_worker), and
# the flags that switch others off are walked on their own (test_the_flags_that_switch_others_off_reach_their_child)
SWITCHES_OFF = {"--enable-chunked-prefill": ["--no-enable-chunked-prefill"],  # --max-prefill-tokens-with-decodes,
                # --target-step-ms
                "--prefix-affinity": ["--no-prefix-affinity"],  # --affinity-slack, --affinity-prefix-tokens
                "--encrypt-kv-frames": ["--encrypt-kv-frames"],  # --kv-frames-port
                "--num-gpu-blocks-override": ["--num-gpu-blocks-override", "64"],  # --kv-cache-memory, --model-repo
                "--state-dir": ["--state-dir", "x-state"]}  # --redis-url
SKIPPED = {"--config", "--zmq-secret-file", "--insecure-zmq", "--pipeline-batch-queue", *GROUP, *DECODE_GROUP,
           *SWITCHES_OFF}


def types(annotation: typing.Any) -> set:
    """int for int, int | None and Annotated[int, ...] | None alike."""
    if typing.get_origin(annotation) is typing.Annotated:
        return types(typing.get_args(annotation)[0])
    args = typing.get_args(annotation)
    return set().union(*map(types, args)) if args else {annotation}


def other_value(flag: Flag) -> typing.Any:
    """A value that is not the flag's default, so finding it proves the flag arrived."""
    annotation = flag.info.annotation
    if flag.option in CHOSEN:
        value = CHOSEN[flag.option]
    elif is_switch(flag):
        value = not flag.default
    elif typing.get_origin(annotation) is typing.Literal:
        value = next(c for c in typing.get_args(annotation) if c != flag.default)
    elif int in types(annotation):
        value = (flag.default or 0) + 7
    elif float in types(annotation):
        value = (flag.default or 0) + 0.25
    else:
        value = f"x-{flag.dest}"
    assert value != flag.default, flag.option
    return value


def reads(flag: Flag, roles: list[str]) -> bool:
    return any(role_settings.reads(flag.info, role) for role in roles)


def argv_for(flags: list[Flag], roles: typing.Sequence[str] = role_settings.ROLES) -> tuple[list[str], dict[str, typing.Any]]:
    """``roles``: the workers that will read the flags; one that none of them reads is left out (it is an error)."""
    argv, given = [], {}
    gateway = {f.option for f in GATEWAY_FLAGS}
    for flag in flags:
        if flag.option in SKIPPED or flag.option in given or not (flag.option in gateway or reads(flag, roles)):
            continue
        given[flag.option] = value = other_value(flag)
        if isinstance(value, bool):
            argv.append(flag.option if value else "--no-" + flag.option[2:])
        else:
            argv += [flag.option, str(value)]
    return argv, given


def resolved(path: tuple[str, ...], config: dict) -> typing.Any:
    for name in path:
        config = config[name]
    return config


def expected(option: str, value: typing.Any, child: str, command: str, index: int) -> typing.Any:
    """What serve makes of a value for one of its children (index: the child's number among its kind)."""
    if option in ("--worker-port", "--worker-monitoring-port", "--zmq-port"):
        return value + index  # one port per process
    if option == "--worker-id":
        return f"{value}-{child}"
    if option == "--admin-key":
        return "<set>"  # masked when printed
    if option == "--gpu-sm-percent" and command == "decode-worker":
        return 100 - value  # the prefill worker's share, the decode worker the rest (kvrelay/serve_plan.py)
    if option == "--gpu-memory-utilization":  # workers sharing a GPU split it: prefill 30%, decode 70%
        return round(value * {"prefill-worker": 0.3, "decode-worker": 0.7, "unified-worker": 1.0}[command], 4)
    return value


def print_config(argv: list[str]) -> dict:
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", *argv, "--print-config"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def check(config: dict, flags: list[Flag], given: dict, child: str, command: str, index: int,
          rename: dict[str, str]) -> set[str]:
    seen = set()
    for flag in (f for f in flags if f.option not in SKIPPED):
        option = rename.get(flag.path[-1], flag.option)
        got = resolved(flag.path, config)
        if command != "gateway" and not reads(flag, [command.removesuffix("-worker")]):
            assert got == flag.default, f"{child}: {option}, which it does not read, is {got!r}"
            continue
        want = expected(option, given[option], child, command, index)
        assert got == want, f"{child}: {option} {given[option]!r} arrived as {got!r}"
        seen.add(option)
    return seen


@pytest.mark.parametrize("mode", ["unified", "disaggregated"])
def test_every_serve_flag_reaches_the_child_that_uses_it(mode):
    workers = ["unified-worker"] if mode == "unified" else ["prefill-worker", "decode-worker"]
    argv, given = argv_for(SERVE_FLAGS, [w.removesuffix("-worker") for w in workers])
    given["--mode"] = mode
    argv[argv.index("--mode") + 1] = mode
    children = print_config(["serve", *argv])
    # with a --model-repo one worker per role hosts every model, named after its role alone
    assert {n: c["command"] for n, c in children.items()} == {"gateway": "gateway", "gateway-1": "gateway",
                                                             **{w: w for w in workers}}
    # serve's own: children, supervision, the embedded Redis's folder
    seen = {"--mode", "--api-server-count", "--max-crashes", "--crash-window"}
    worker_flags = [f for f in WORKER_FLAGS if f.option not in SKIPPED]
    for name, child in children.items():
        command, config = child["command"], child["config"]
        if command == "gateway":
            seen |= check(config, GATEWAY_FLAGS, given, name, command, int(name[len("gateway-"):] or 0), {})
            assert config["reuse_port"]  # two gateways share the port
        else:
            seen |= check(config, worker_flags, given, name, command, workers.index(command), WORKER_RENAMES)
            assert config["role"] == command.removesuffix("-worker") and config["model_name"] == "x-served_model_name"
    assert seen == set(given)  # every flag serve took was found in a child


@pytest.mark.parametrize("command", ["gateway", "prefill-worker", "decode-worker", "unified-worker"])
def test_every_role_flag_reaches_its_config(command):
    flags = [f for f in (GATEWAY_FLAGS if command == "gateway" else WORKER_FLAGS) if f.option not in SKIPPED
             and (command == "gateway" or reads(f, [command.removesuffix("-worker")]))]
    argv, given = argv_for(flags)
    config = print_config([command, *argv])
    for flag in flags:
        want = "<set>" if flag.option == "--admin-key" else given[flag.option]
        assert resolved(flag.path, config) == want, f"{command}: {flag.option}"


@pytest.mark.parametrize("mode", ["unified", "disaggregated"])
def test_parallel_sizes_reach_every_worker(mode):
    children = print_config(["serve", "--mode", mode, "--model", "dummy:tiny-llama", "--device", "cpu",
                             "--tensor-parallel-size", "2", "--pipeline-parallel-size", "2", "--pipeline-batch-queue"])
    workers = [c["config"] for c in children.values() if c["command"] != "gateway"]
    assert workers
    flags = [f for f in WORKER_FLAGS if f.option in GROUP]
    assert len(flags) == len(GROUP)
    for flag in flags:
        assert all(resolved(flag.path, config) == 2 for config in workers), flag.option
    assert all(config["engine"]["pipeline_batch_queue"] for config in workers)


def test_the_decode_workers_own_parallel_sizes_reach_it_alone():
    children = print_config(["serve", "--model", "dummy:tiny-llama", "--device", "cpu", "--tensor-parallel-size", "2",
                             "--decode-tensor-parallel-size", "1", "--decode-pipeline-parallel-size", "2"])
    sizes = {c["command"]: (c["config"]["engine"]["tensor_parallel_size"],
                            c["config"]["engine"]["pipeline_parallel_size"])
             for c in children.values() if c["command"] != "gateway"}
    assert sizes == {"prefill-worker": (2, 1), "decode-worker": (1, 2)}
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", "serve", "--mode", "unified", "--model",
                           "dummy:tiny-llama", "--decode-pipeline-parallel-size", "2", "--print-config"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == ("kvrelay serve: error: argument --decode-pipeline-parallel-size: "
                                                    "only with --mode disaggregated (a unified worker has one size)")


def test_the_flags_that_switch_others_off_reach_their_child():
    children = print_config(["serve", "--model", "dummy:tiny-llama", "--device", "cpu",
                             *(a for argv in SWITCHES_OFF.values() for a in argv)])
    by_command = {c["command"]: c["config"] for c in children.values()}
    workers = [by_command["prefill-worker"], by_command["decode-worker"]]
    assert [w["engine"]["scheduler"]["enable_chunked_prefill"] for w in workers] == [False, False]
    assert [w["engine"]["cache"]["num_gpu_blocks"] for w in workers] == [64, 64]
    assert [w["encrypt_kv_frames"] for w in workers] == [False, True]  # the decode worker's
    assert by_command["gateway"]["prefix_affinity"] is False
