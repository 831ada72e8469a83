"""Where the ZMQ deployment secret comes from: a role on its own refuses to start without one (one line
naming the flag, exit 2) unless --insecure-zmq; a secret file open to others is refused as ssh refuses
a key; kvrelay serve makes one per start and hands the same one to every child inside its config."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvrelay.cli import build_parser
from kvrelay.serve_plan import models_to_serve, plan
from kvrelay.shared.config.zmq_secret import ZMQ_SECRET_ENV


def role(argv: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k != ZMQ_SECRET_ENV}
    return subprocess.run([sys.executable, "-m", "kvrelay.cli", *argv], capture_output=True, text=True,
                          timeout=120, env={**clean, **(env or {})})


def secret_file(tmp_path: Path, mode: int, text: str = "ab" * 32) -> str:
    path = tmp_path / "zmq-secret"
    path.write_text(text + "\n")
    path.chmod(mode)
    return str(path)


@pytest.mark.parametrize("command", ["gateway", "decode-worker"])
def test_a_role_without_a_secret_refuses_to_start(command):
    proc = role([command, "--print-config"])
    assert proc.returncode == 2 and proc.stdout == ""
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"kvrelay {command}: error: argument --zmq-secret-file: no ZMQ secret") \
        and "--insecure-zmq" in line


def test_a_secret_file_others_can_read_is_refused(tmp_path):
    path = secret_file(tmp_path, 0o644)
    proc = role(["gateway", "--zmq-secret-file", path, "--print-config"])
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"kvrelay gateway: error: argument --zmq-secret-file: {path} is open to group " \
                                  f"or others (mode 0644); chmod 600 it"


@pytest.mark.parametrize("given", ["file", "env"])
def test_a_secret_from_a_0600_file_or_the_environment_is_taken_and_never_printed(tmp_path, given):
    secret = "cd" * 32
    argv, env = (["--zmq-secret-file", secret_file(tmp_path, 0o600, secret)], {}) if given == "file" else \
        ([], {ZMQ_SECRET_ENV: secret})
    proc = role(["gateway", *argv, "--print-config"], env)
    assert proc.returncode == 0, proc.stderr
    assert '"zmq_secret": "<set>"' in proc.stdout and secret not in proc.stdout


def test_a_malformed_secret_and_a_contradiction_are_config_errors(tmp_path):
    proc = role(["gateway", "--print-config"], {ZMQ_SECRET_ENV: "not-hex"})
    assert proc.returncode == 2 and "$KVRELAY_ZMQ_SECRET: the ZMQ secret must be 64 hex digits" in proc.stderr
    proc = role(["gateway", "--insecure-zmq", "--print-config"], {ZMQ_SECRET_ENV: "ab" * 32})
    assert proc.returncode == 2 and "give it or a secret, not both" in proc.stderr
    proc = role(["gateway", "--insecure-zmq", "--print-config"])
    assert proc.returncode == 0 and '"zmq_secret": null' in proc.stdout


def _plan(argv: list[str]):
    args = build_parser().parse_args(["serve", "--model", "dummy:smollm2-135m", *argv])
    return plan(args, models_to_serve(args), "redis://127.0.0.1:6379/0")


def test_serve_makes_one_secret_per_start_for_all_its_children(monkeypatch):
    monkeypatch.delenv(ZMQ_SECRET_ENV, raising=False)
    children = _plan(["--api-server-count", "2"])
    secrets = {c.config.zmq_secret for c in children}
    assert len(children) == 4 and len(secrets) == 1 and None not in secrets
    assert secrets.isdisjoint({c.config.zmq_secret for c in _plan([])})  # a new one each start
    assert {c.config.zmq_secret for c in _plan(["--insecure-zmq"])} == {None}
    monkeypatch.setenv(ZMQ_SECRET_ENV, "ef" * 32)  # workers started elsewhere can join this deployment
    assert {c.config.zmq_secret for c in _plan([])} == {"ef" * 32}
