"""The CUDA MPS control daemon of one ``kvrelay serve --gpu-share mps``: its own pipe and log folders under a
temporary folder (so it neither needs nor disturbs a system-wide daemon), the environment that makes a worker
process its client, and a stop when serve ends."""

import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from kvrelay.shared.config.declare import ConfigError

CONTROL = "nvidia-cuda-mps-control"
FLAG = "argument --gpu-share"
ANSWER_TIMEOUT_S = 10.0


class MpsDaemon:
    def __init__(self, root: str | None = None):
        self.root = Path(root or tempfile.mkdtemp(prefix="kvrelay-mps-"))
        self.env = {"CUDA_MPS_PIPE_DIRECTORY": str(self.root / "pipe"),
                    "CUDA_MPS_LOG_DIRECTORY": str(self.root / "log")}
        self.started = False

    def start(self) -> "MpsDaemon":
        """Starts the daemon and waits for it to answer; a daemon that cannot start is one ConfigError line."""
        control = shutil.which(CONTROL)
        if control is None:
            raise ConfigError(f"{FLAG}: mps needs {CONTROL} on PATH (the NVIDIA driver's utilities); not found")
        for folder in self.env.values():
            os.makedirs(folder, mode=0o700, exist_ok=True)
        started = self._control(["-d"])
        if started.returncode:
            raise ConfigError(f"{FLAG}: {CONTROL} -d failed (exit {started.returncode}): {_said(started)}")
        self.started = True
        answer = self._control([], "get_server_list\n")
        if answer.returncode:
            self.stop()
            raise ConfigError(f"{FLAG}: the MPS daemon started but does not answer (exit {answer.returncode}): "
                              f"{_said(answer)}; its log: {self.env['CUDA_MPS_LOG_DIRECTORY']}/control.log")
        return self

    def stop(self) -> None:
        if self.started:
            self._control([], "quit\n")
            self.started = False
        shutil.rmtree(self.root, ignore_errors=True)

    def _control(self, args: list[str], text: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([CONTROL, *args], input=text, capture_output=True, text=True,
                              env=os.environ | self.env, timeout=ANSWER_TIMEOUT_S, check=False)


def _said(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    return lines[-1] if lines else "no output"
