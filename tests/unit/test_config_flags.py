"""Flags generated from the config declarations: named like vLLM's, every value checked as it is parsed
(one line naming the flag, exit 2, before anything loads), ``kvrelay serve`` taking every flag of every
role it starts, each setting's default written once, and the JSON a child receives checked strictly."""

import io
import re
from pathlib import Path

import pytest

from kvrelay.cli import ROLES, build_parser, main
from kvrelay.cli_args import ENGINE_FLAGS, GATEWAY_FLAGS, WORKER_FLAGS
from kvrelay.shared.config import handover, role_settings
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.engine import EngineConfig, ModelConfig
from kvrelay.shared.config.flags import is_switch
from kvrelay.shared.config.gateway import GatewayConfig
from kvrelay.shared.config.serve import WORKER_RENAMES
from kvrelay.shared.config.worker import StartupModel, WorkerConfig
from kvrelay.shared.wire.protocol import ModelSpec

ROOT = Path(__file__).parents[2]


def options(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command").choices[command]
    return {o for a in sub._actions if a.help != "==SUPPRESS==" for o in a.option_strings} - {"-h", "--help"}


@pytest.mark.parametrize("argv,flag,message", [
    (["serve", "--max-num-seqs", "0"], "--max-num-seqs", "greater than or equal to 1"),
    (["serve", "--drain-timeout", "nan"], "--drain-timeout", "finite number"),
    (["serve", "--gpu-memory-utilization", "1.5"], "--gpu-memory-utilization", "less than or equal to 1"),
    (["serve", "--block-size", "24"], "--block-size", "must be a power of two"),
    (["serve", "--dtype", "float8"], "--dtype", "invalid choice"),
    (["serve", "--max-model-len", "2.5"], "--max-model-len", "valid integer"),
    (["serve", "--admin-key", "short"], "--admin-key", "at least 16 characters"),
    (["serve", "--redis-url", "http://x"], "--redis-url", "redis://"),
    (["serve", "--device", "gpu9"], "--device", "auto, cpu, cuda or cuda:N"),
    (["serve", "--zmq-port", "70000"], "--zmq-port", "less than or equal to 65535"),
    (["serve", "--reconcile-interval-s", "-1"], "--reconcile-interval-s", "greater than or equal to 0"),
    (["serve", "--api-server-count", "0"], "--api-server-count", "greater than or equal to 1"),
    (["gateway", "--port", "-1"], "--port", "greater than or equal to 0"),
    (["prefill-worker", "--tenant-kv-quota", "0"], "--tenant-kv-quota", "greater than 0"),
    (["decode-worker", "--handoff-timeout", "0"], "--handoff-timeout", "greater than 0"),
    (["unified-worker", "--no-such-flag"], "--no-such-flag", "unrecognized arguments"),
])
def test_a_bad_flag_is_one_line_naming_it_and_exit_2(capsys, argv, flag, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"kvrelay {argv[0]}: error: ") and flag in line and message in line, line


def test_a_model_that_does_not_resolve_is_one_line_naming_model(capsys, tmp_path):
    assert main(["serve", "--model", str(tmp_path / "nowhere")]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("kvrelay serve: error: argument --model: model ")


def test_flags_are_named_like_vllms():
    worker = options("prefill-worker")
    for flag in ("--max-num-seqs", "--gpu-memory-utilization", "--max-model-len", "--max-num-batched-tokens",
                 "--enable-prefix-caching", "--no-enable-prefix-caching", "--enable-chunked-prefill",
                 "--no-enable-chunked-prefill", "--num-gpu-blocks-override", "--scheduling-policy", "--swap-space",
                 "--served-model-name", "--enforce-eager", "--load-format", "--kv-stream-layers",
                 "--no-kv-stream-layers", "--handoff-timeout", "--drain-timeout", "--verify-checksums"):
        assert flag in worker, flag
    gateway = options("gateway")
    for flag in ("--prefix-affinity", "--no-prefix-affinity", "--reconcile-interval-s", "--zmq-port", "--reuse-port"):
        assert flag in gateway, flag


def test_every_declared_setting_has_a_flag_on_its_role_and_on_serve():
    """On every role that reads it: a worker setting of other roles is rejected (tests/unit/test_role_settings.py)."""
    for command, flags in (("gateway", GATEWAY_FLAGS), *((c, WORKER_FLAGS) for c in ROLES if c != "gateway")):
        flags = [f for f in flags if command == "gateway" or role_settings.reads(f.info, ROLES[command])]
        negated = {"--no-" + f.option[2:] for f in flags if is_switch(f)}
        assert {f.option for f in flags} | negated == options(command), command
    assert {f.option for f in ENGINE_FLAGS} <= options("unified-worker")


def test_serve_accepts_every_flag_of_every_role():
    serve = options("serve")
    renamed = {"--" + name.replace("_", "-"): option for name, option in WORKER_RENAMES.items()}
    for command in ROLES:
        for flag in options(command):
            wanted = renamed.get(flag, flag) if command != "gateway" else flag
            assert wanted in serve, f"kvrelay serve lacks {command}'s {flag}"


def test_serve_help_groups_flags_by_role(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    out = capsys.readouterr().out
    titles = [line for line in out.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert [t.split(" (")[0].rstrip(":") for t in titles] == [
        "options", "serve", "several models", "gateway", "model", "KV cache", "scheduler", "engine", "worker"]


def test_the_drain_timeout_default_is_written_once():
    sources = [p for d in ("gateway", "shared", "kvrelay", "prefill_worker", "decode_worker", "unified_worker")
               for p in (ROOT / d).rglob("*.py")]
    holders = [p.relative_to(ROOT) for p in sources
               if re.search(r"drain\w*\s*(:[^=\n]+)?=\s*30", p.read_text(), re.I)
               or re.search(r"--drain-timeout.{0,80}default=", p.read_text())]
    assert [str(p) for p in holders] == ["shared/config/common.py"]
    worker = WorkerConfig("prefill", EngineConfig(ModelConfig("m"), device="cpu"))
    assert GatewayConfig().drain_timeout == worker.drain_timeout_s == 30.0


def test_the_stalled_step_timeout_is_one_setting_of_the_gateway_and_the_prefill_worker():
    """The gateway routes no job, and a prefill worker hands no KV, to a worker stalled past the same timeout."""
    worker = WorkerConfig("prefill", EngineConfig(ModelConfig("m"), device="cpu"))
    assert GatewayConfig().stalled_step_timeout_s == worker.stalled_step_timeout_s == 60.0
    for command in ("gateway", "prefill-worker", "serve"):
        assert "--stalled-step-timeout-s" in options(command), command


def test_config_from_stdin_is_the_whole_config(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["gateway", "--config-from-stdin", "--port", "9000"])
    assert exc.value.code == 2 and "remove --port" in capsys.readouterr().err


def test_handover_round_trips_and_is_strict():
    engine = EngineConfig(ModelConfig("dummy:tiny-llama", load_format="dummy", max_model_len=128), device="cpu")
    config = WorkerConfig("decode", engine, "redis://127.0.0.1:7/0", model_name="tiny", handoff_timeout_s=2.5,
                          more_models=[StartupModel("b", engine, version=3, pinned=True)],
                          register=[ModelSpec(name="b", version=3, pinned=True, updated=1.5)])
    assert handover.receive(WorkerConfig, io.StringIO(handover.encode(config).decode())) == config
    worker_id_left_to_child = handover.receive(WorkerConfig, io.StringIO(
        handover.encode(config, exclude={"worker_id"}).decode()))
    assert worker_id_left_to_child.worker_id != config.worker_id
    good = handover.encode(GatewayConfig(admin_key="k" * 16)).decode()
    assert handover.receive(GatewayConfig, io.StringIO(good)).admin_key == "k" * 16
    for bad, where in ((good.replace('"port":8000', '"port":"8000"'), "port"),
                       (good.replace('"port":8000', '"prot":8000'), "prot"),
                       (good.replace('"request_timeout":600.0', '"request_timeout":-1'), "request_timeout")):
        with pytest.raises(ConfigError, match=f"config from the parent: {where}: "):
            handover.receive(GatewayConfig, io.StringIO(bad))
    assert '"<set>"' in handover.printable(GatewayConfig(admin_key="k" * 16)) and "k" * 16 not in \
        handover.printable(GatewayConfig(admin_key="k" * 16))
