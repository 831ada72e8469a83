"""A worker setting only some roles read (``setting(roles=...)``, shared/config/role_settings.py) is applied by
those roles and rejected by the others, never accepted and ignored: on a worker's command line its flag is one
line naming it (exit 2, before anything loads), a config handed over with a value for it is refused, and
``kvrelay serve`` gives each worker only what its role reads, refusing a value no process it starts reads."""

import dataclasses
import io
import json
import re

import pytest
from pydantic import ValidationError

from kvrelay.cli import main
from kvrelay.cli_args import SERVE_WORKER_FLAGS, WORKER_FLAGS
from kvrelay.shared.config import handover, role_settings
from kvrelay.shared.config.declare import ConfigError
from kvrelay.shared.config.engine import EngineConfig, ModelConfig, SchedulerConfig
from kvrelay.shared.config.flags import is_switch
from kvrelay.shared.config.worker import StartupModel, WorkerConfig
from tests.unit.serve_children import serve_children, setting_at

ROLED = [f for f in WORKER_FLAGS if role_settings.roles_of(f.info)]
SERVE_ROLED = [f for f in SERVE_WORKER_FLAGS if role_settings.roles_of(f.info)]  # --worker-port, ...
TINY = ["--model", "dummy:tiny-llama", "--device", "cpu"]


def _value(flag):
    """A value other than the flag's default."""
    if is_switch(flag):
        return not flag.default
    return "host-7" if flag.path[-1] == "advertise_host" else 7


def _argv(flag) -> list[str]:
    if is_switch(flag):
        return [flag.option if _value(flag) else "--no-" + flag.option[2:]]
    return [flag.option, str(_value(flag))]


def test_the_settings_that_only_some_roles_read():
    assert {f.option: role_settings.roles_of(f.info) for f in ROLED} == {
        "--port": ("decode",), "--advertise-host": ("decode",), "--encrypt-kv-frames": ("decode",),
        "--kv-frames-port": ("decode",), "--kv-frame-streams": ("decode",), "--max-handoffs-per-peer": ("decode",),
        "--handoff-timeout": ("prefill", "decode"), "--stalled-step-timeout-s": ("prefill", "unified"),
        "--kv-stream-layers": ("prefill",), "--max-deliveries": ("prefill", "unified"),
        "--reclaim-idle-ms": ("prefill", "unified"),
        # engine settings of decode steps: a prefill worker's requests end at their first token
        "--async-scheduling": ("decode", "unified"), "--max-prefill-tokens-with-decodes": ("decode", "unified"),
        "--target-step-ms": ("decode", "unified")}


@pytest.mark.parametrize("role,flag", [(r, f) for f in ROLED for r in role_settings.ROLES
                                       if not role_settings.reads(f.info, r)],
                         ids=lambda x: getattr(x, "option", x))
def test_a_role_that_does_not_read_a_setting_rejects_its_flag_in_one_line(capsys, role, flag):
    with pytest.raises(SystemExit) as exc:
        main([f"{role}-worker", *TINY, *_argv(flag)])
    assert exc.value.code == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == (f"kvrelay {role}-worker: error: argument {_argv(flag)[0]}: "
                    f"{role_settings.who_reads(role_settings.roles_of(flag.info))} (this is a {role} worker)")


def test_the_line_names_the_flag_and_the_roles_that_read_it(capsys):
    for argv, said in ((["unified-worker", "--handoff-timeout", "5"],
                        "argument --handoff-timeout: only the prefill and decode workers use it"),
                       (["decode-worker", "--stalled-step-timeout-s", "5"],
                        "argument --stalled-step-timeout-s: only the prefill and unified workers use it"),
                       (["prefill-worker", "--kv-frames-port", "5601"],
                        "argument --kv-frames-port: only the decode worker uses it")):
        with pytest.raises(SystemExit):
            main(argv)
        assert said in capsys.readouterr().err


@pytest.mark.parametrize("role,flag", [(r, f) for f in ROLED for r in role_settings.roles_of(f.info)],
                         ids=lambda x: getattr(x, "option", x))
def test_a_role_that_reads_a_setting_takes_its_flag(capsys, role, flag):
    assert main([f"{role}-worker", *TINY, *_argv(flag), "--print-config"]) == 0
    config = json.loads(capsys.readouterr().out)
    for name in flag.path:
        config = config[name]
    assert config == _value(flag)


def test_a_config_with_a_value_its_role_does_not_read_is_refused():
    engine = EngineConfig(ModelConfig("dummy:tiny-llama", load_format="dummy"), device="cpu")
    with pytest.raises(ValidationError, match="argument --handoff-timeout: only the prefill and decode workers"):
        WorkerConfig("unified", engine, handoff_timeout_s=3.0)
    sent = handover.encode(WorkerConfig("prefill", engine, stalled_step_timeout_s=5.0)).decode()
    with pytest.raises(ConfigError) as exc:
        handover.receive(WorkerConfig, io.StringIO(sent.replace('"role":"prefill"', '"role":"decode"')))
    assert str(exc.value) == ("config from the parent: argument --stalled-step-timeout-s: only the prefill and "
                              "unified workers use it (this is a decode worker)")
    assert WorkerConfig("decode", engine, handoff_timeout_s=3.0).handoff_timeout_s == 3.0


def test_an_engine_setting_its_role_does_not_read_is_refused_in_any_model_of_the_config():
    engine = EngineConfig(ModelConfig("dummy:tiny-llama", load_format="dummy"), device="cpu")
    decoding = dataclasses.replace(engine, scheduler=SchedulerConfig(max_prefill_tokens_with_decodes=64))
    said = ("argument --max-prefill-tokens-with-decodes: only the decode and unified workers use it (this is a "
            "prefill worker)")
    with pytest.raises(ValidationError, match=re.escape(said)):
        WorkerConfig("prefill", decoding)
    with pytest.raises(ValidationError, match=re.escape(said)):  # a model loaded at startup besides the first
        WorkerConfig("prefill", engine, more_models=[StartupModel("second", decoding)])
    assert WorkerConfig("decode", engine, more_models=[StartupModel("second", decoding)]).more_models
    assert EngineConfig(ModelConfig("m"), async_scheduling=True).async_scheduling  # no role: the offline API


def _plan(argv: list[str]) -> dict:
    return serve_children([*TINY, *argv])


# encrypted KV frames come on the CURVE socket, and a port or a count for the plain ones beside it is refused
# (shared/config/depends.py): each side is walked without the other
APART = (("--encrypt-kv-frames",), ("--kv-frames-port", "--kv-frame-streams"))


@pytest.mark.parametrize("without", APART, ids=lambda w: w[0])
def test_serve_gives_each_worker_only_the_settings_its_role_reads(without):
    flags = [f for f in SERVE_ROLED if f.option not in without]
    children = _plan([a for f in flags for a in _argv(f)])
    for i, command in enumerate(("prefill-worker", "decode-worker")):
        config, role = children[command].config, command.removesuffix("-worker")
        for flag in flags:
            want = _value(flag) + i if flag.option == "--worker-port" else _value(flag)  # one port per worker
            got = setting_at(config, flag.path)
            assert got == (want if role_settings.reads(flag.info, role) else flag.default), (command, flag.option)
        # what the child receives is its config whole, checked again on arrival
        assert handover.receive(WorkerConfig, io.StringIO(handover.encode(config).decode())) == config
    assert children["gateway"].config.stalled_step_timeout_s == 7


@pytest.mark.parametrize("flag", [f for f in SERVE_ROLED if not role_settings.reads(f.info, "unified")],
                         ids=lambda f: f.option)
def test_serve_refuses_a_setting_no_process_it_starts_reads(flag):
    said = f"argument {flag.option}: {role_settings.who_reads(role_settings.roles_of(flag.info))} (--mode unified " \
           "starts none)"
    with pytest.raises(ConfigError, match=re.escape(said)):
        _plan(["--mode", "unified", *_argv(flag)])
    if is_switch(flag):  # given as its default, it is refused all the same (a default of None is no flag)
        at_default = [] if flag.default is None else [flag.option if flag.default else "--no-" + flag.option[2:]]
    else:
        at_default = [flag.option, str(flag.default)] if flag.default is not None else []
    if at_default:
        with pytest.raises(ConfigError, match=re.escape(said)):
            _plan(["--mode", "unified", *at_default])


def test_serve_unified_takes_the_job_readers_settings():
    children = _plan(["--mode", "unified", "--stalled-step-timeout-s", "5", "--reclaim-idle-ms", "9"])
    assert children["gateway"].config.stalled_step_timeout_s == 5
    unified = children["unified-worker"].config
    assert unified.stalled_step_timeout_s == 5 and unified.reclaim_idle_ms == 9
    for command, child in children.items():
        if command != "gateway":
            assert handover.receive(WorkerConfig, io.StringIO(handover.encode(child.config).decode())) == child.config
