"""Progress bars say whose they are: a worker labels its process once, and every bar it draws (loading
weights here) carries the label; on a terminal each role keeps its own line, in a log file no cursor
movement is written."""

import os

import pytest

from kvrelay.shared.engine.loader import iter_safetensors
from kvrelay.shared.text import progress


@pytest.fixture
def labelled():
    yield progress.label_process
    progress.label_process("", 0)


def test_a_labelled_process_names_its_role_on_every_bar(labelled, tiny_model_dirs, capsys):
    labelled("decode worker", line=1)
    assert len(list(iter_safetensors([tiny_model_dirs["llama"] / "model.safetensors"]))) > 0
    err = capsys.readouterr().err
    assert "decode worker: Loading weights" in err and "100%" in err
    assert "\x1b[A" not in err  # not a terminal: no cursor moves in the log


def _read_all(leader: int) -> str:
    """Everything written to the closed follower: one read may return only the first of the bar's writes
    (CI, under load: '\\r\\n' alone)."""
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 1 << 16)
        except OSError:  # EIO: the follower is closed and all it wrote has been read
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()


def test_on_a_terminal_the_role_keeps_its_line(labelled):
    def drawn(role: str, line: int) -> str:
        leader, follower = os.openpty()
        try:
            with os.fdopen(follower, "w") as tty:
                labelled(role, line=line)
                with progress.progress_bar("Loading weights", total=2, file=tty) as bar:
                    bar.update(2)
            return _read_all(leader)
        finally:
            os.close(leader)

    decode, prefill = drawn("decode worker", 1), drawn("prefill worker", 0)
    assert "decode worker: Loading weights" in decode and "\x1b[A" in decode  # drawn a line down, cursor back
    assert "prefill worker: Loading weights" in prefill and "\x1b[A" not in prefill


def test_an_unlabelled_process_draws_plain_bars(capsys):
    with progress.progress_bar("checksums", total=1) as bar:
        bar.update(1)
    assert "checksums: 100%" in capsys.readouterr().err
