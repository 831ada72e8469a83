"""The README's examples run as a new user runs them: every python and bash snippet that talks to the
server is run against ``kvrelay serve`` started as ``make serve`` starts it (no flags: SmolLM2-135M-Instruct,
an embedded Redis), and the offline API snippet in a process of its own. Each must finish well inside a
minute on two cores; one that samples at temperature 1 with no max_tokens does not."""

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.cluster import free_port
from tests.e2e.served import start_serve, until_ready

pytestmark = pytest.mark.slow
README = Path(__file__).parents[2] / "README.md"
DEFAULT_ADDRESS = "127.0.0.1:8000"  # what the snippets dial; the test's server listens on a free port instead
# The "Many models" walkthrough runs against its own deployment, in its own test
OWN_TEST_SECTIONS = {"Many models"}
SNIPPET_TIMEOUT_S = 60.0  # a liveness bound: the answers take seconds; a rambling one takes many minutes


def readme_snippets() -> list[tuple[str, str, str]]:
    """(section, language, code) of each fenced python or bash block."""
    section, found = "", []
    for match in re.finditer(r"^## (?P<title>[^\n]+)$|^```(?P<lang>\w+)\n(?P<code>.*?)^```$", README.read_text(),
                             re.MULTILINE | re.DOTALL):
        if match["title"]:
            section = match["title"].strip()
        elif match["lang"] in ("python", "bash") and section not in OWN_TEST_SECTIONS:
            found.append((section, match["lang"], match["code"]))
    return found


def talks_to_the_server(lang: str, code: str) -> bool:
    """It dials the server (a comment naming the address, as beside ``make serve``, does not)."""
    return DEFAULT_ADDRESS in (code if lang == "python" else re.sub(r"#.*", "", code))


SERVER_SNIPPETS = [s for s in readme_snippets() if talks_to_the_server(s[1], s[2])]
OFFLINE_SNIPPETS = [s for s in readme_snippets() if "from kvrelay import LLM" in s[2]]


def _run(lang: str, code: str, timeout: float = SNIPPET_TIMEOUT_S) -> str:
    argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"did not finish in {timeout:.0f} s:\n{code}\n{exc.stdout or ''}")
    assert proc.returncode == 0, f"{code}\n{proc.stdout}\n{proc.stderr}"
    assert proc.stdout.strip(), code
    return proc.stdout


@pytest.fixture(scope="module")
def make_serve(tmp_path_factory):
    folder = tmp_path_factory.mktemp("readme")
    port, log = free_port(), folder / "serve.log"
    proc = start_serve(["--port", str(port), "--state-dir", str(folder / "state")], log,
                       dict(os.environ, PYTHONUNBUFFERED="1"))
    try:
        until_ready(proc, log, timeout=300)
        yield f"127.0.0.1:{port}"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


def test_the_readme_has_snippets_for_a_new_user():
    assert {lang for _, lang, _ in SERVER_SNIPPETS} == {"python", "bash"} and OFFLINE_SNIPPETS


@pytest.mark.parametrize("section,lang,code", SERVER_SNIPPETS, ids=[f"{s}-{lang}" for s, lang, _ in SERVER_SNIPPETS])
def test_server_snippet_answers_in_seconds(make_serve, section, lang, code):
    out = _run(lang, code.replace(DEFAULT_ADDRESS, make_serve))
    if "France" in code:
        assert "Paris" in out, out


@pytest.mark.parametrize("section,lang,code", OFFLINE_SNIPPETS, ids=[s for s, _, _ in OFFLINE_SNIPPETS])
def test_offline_snippet_runs(section, lang, code):
    out = _run(lang, code, timeout=3 * SNIPPET_TIMEOUT_S)  # it loads the model itself
    assert "Paris" in out, out
