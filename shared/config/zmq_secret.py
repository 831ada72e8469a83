"""Where a process's ZMQ deployment secret comes from (shared/wire/zmq_auth.py turns it into the CURVE
keypair every internal socket uses). ``kvrelay serve`` generates one per start and hands it to its
children inside their config on stdin; a role started on its own reads it from ``--zmq-secret-file``
(mode 0600, as ssh insists on for its keys) or ``$KVRELAY_ZMQ_SECRET``. Never argv: ``ps`` shows argv
to every local user. With none, a process refuses to start unless ``--insecure-zmq`` says so: loopback
is no protection against the local processes that forged handoffs in issue #13."""

import os
import re
import secrets
import stat
from pathlib import Path

from kvrelay.shared.config.declare import ConfigError

ZMQ_SECRET_ENV = "KVRELAY_ZMQ_SECRET"
SECRET_PATTERN = r"^[0-9a-f]{64}$"  # 32 bytes: a CURVE secret key
FLAG = "argument --zmq-secret-file"


def generate() -> str:
    return secrets.token_hex(32)


def resolve(secret_file: str | None, insecure: bool, generate_if_none: bool = False) -> str | None:
    """The secret from the file, else the environment, else a new one (``generate_if_none``: serve);
    None only with ``insecure``. Any mistake is a ConfigError naming the flag or variable."""
    if insecure:
        if secret_file or os.environ.get(ZMQ_SECRET_ENV):
            raise ConfigError("--insecure-zmq turns ZMQ authentication off: give it or a secret, not both")
        return None
    if secret_file:
        return _check(_read(Path(secret_file).expanduser()), f"{FLAG}: {secret_file}")
    if os.environ.get(ZMQ_SECRET_ENV):
        return _check(os.environ[ZMQ_SECRET_ENV], f"${ZMQ_SECRET_ENV}")
    if generate_if_none:
        return generate()
    raise ConfigError(f"{FLAG}: no ZMQ secret: give --zmq-secret-file (a 0600 file of 64 hex digits, e.g. from "
                      f"'openssl rand -hex 32') or ${ZMQ_SECRET_ENV}, the same for every process of the deployment; "
                      f"--insecure-zmq runs without authentication")


def _read(path: Path) -> str:
    try:
        mode = path.stat().st_mode
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            raise ConfigError(f"{FLAG}: {path} is open to group or others (mode {stat.S_IMODE(mode):04o}); "
                              f"chmod 600 it")
        return path.read_text()
    except OSError as exc:
        raise ConfigError(f"{FLAG}: cannot read {path}: {exc.strerror}") from None


def _check(text: str, where: str) -> str:
    secret = text.strip().lower()
    if not re.fullmatch(SECRET_PATTERN, secret):
        raise ConfigError(f"{where}: the ZMQ secret must be 64 hex digits (32 bytes)")
    return secret
