"""The README's "Many models" walkthrough runs as written: its bash and python blocks, in order, in one
shell, in a folder holding a copy of examples/ (where the walkthrough's `./model_repo` then goes), with the
real SmolLM2 and `kvrelay serve` on its default port 8000. The one liberty taken: the `kvrelay serve`
line, which a reader runs in a terminal of its own, runs in the background until it prints its ready
line. The shell gets a network namespace of its own where it can, so port 8000 is free for it."""

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SECTION = "### Walkthrough"
BLOCK = re.compile(r"^```(bash|python)\n(.*?)^```", re.S | re.M)
SERVE_LINE = re.compile(r"^kvrelay serve .*$", re.M)


def walkthrough_blocks() -> list[tuple[str, str]]:
    text = (ROOT / "README.md").read_text()
    start = text.index(SECTION)
    end = text.find("\n#", start + len(SECTION))
    return BLOCK.findall(text[start:end])


def script(blocks: list[tuple[str, str]], network_setup: str) -> str:
    out = ["set -euo pipefail", network_setup, "SERVE_PID=",
           'trap \'[ -z "$SERVE_PID" ] || { kill -TERM $SERVE_PID; wait $SERVE_PID; }\' EXIT']
    for i, (lang, body) in enumerate(blocks):
        out.append(f"printf '\\n=== block {i}\\n'")  # on a line of its own: curl's output ends without one
        if lang == "python":
            out.append(f"python - <<'PYTHON'\n{body}PYTHON")
            continue
        # the server's terminal: in the background, until it says it is ready
        out.append(SERVE_LINE.sub(lambda m: (
            f"{m.group(0)} > serve.log 2>&1 &\nSERVE_PID=$!\n"
            "for _ in $(seq 3000); do grep -q 'kvrelay ready' serve.log && break; kill -0 $SERVE_PID; sleep 0.2; done\n"
            "grep 'kvrelay ready' serve.log"), body))
    return "\n".join(out) + "\n"


def network() -> tuple[list[str], str]:
    """(a prefix that runs the shell in a network namespace of its own, the line that brings its loopback
    up), or no namespace where none can be made and port 8000 is free here."""
    if shutil.which("unshare") and shutil.which("ip") and subprocess.run(
            ["unshare", "-rn", "ip", "link", "set", "lo", "up"], capture_output=True).returncode == 0:
        return ["unshare", "-rn"], "ip link set lo up"
    with socket.socket() as s:
        if s.connect_ex(("127.0.0.1", 8000)) == 0:
            pytest.skip("port 8000 is taken and no network namespace can be made for the walkthrough")
    return [], ""


def test_the_walkthrough_runs_as_written(tmp_path):
    blocks = walkthrough_blocks()
    assert [lang for lang, _ in blocks] == ["bash", "bash", "bash", "python", "bash", "bash", "bash"]
    assert len(SERVE_LINE.findall(blocks[1][1])) == 1
    shutil.copytree(ROOT / "examples", tmp_path / "examples")
    prefix, setup = network()
    (tmp_path / "walkthrough.sh").write_text(script(blocks, setup))
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}", PYTHONUNBUFFERED="1")
    for var in ("KVRELAY_MODEL_REPO", "KVRELAY_ADMIN_KEY", "OPENAI_API_KEY", "OPENAI_BASE_URL"):
        env.pop(var, None)
    proc = subprocess.run([*prefix, "bash", "walkthrough.sh"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    log = (tmp_path / "serve.log").read_text(errors="replace") if (tmp_path / "serve.log").exists() else ""
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\nserve.log:\n{log[-3000:]}"
    out = dict(re.findall(r"^=== block (\d+)\n(.*?)(?=^=== block |\Z)", proc.stdout, re.S | re.M))
    assert "imported chat version 1" in out["0"] and "imported summarizer version 1" in out["0"]
    assert re.search(r"^chat +1 ", out["0"], re.M) and re.search(r"^summarizer +1 ", out["0"], re.M)
    assert "kvrelay ready" in out["1"]
    assert '"name": "me"' in out["2"]
    assert out["3"].startswith("['chat', 'summarizer']\n")
    replies = re.findall(r"^(chat|summarizer) -> ", out["3"], re.M)
    assert replies == ["chat", "summarizer"] and out["3"].count("Paris") >= 2, out["3"]
    assert '"name": "chat"' in out["4"] and '"name": "summarizer"' in out["4"]
    assert "imported chat version 2" in out["5"] and '"swapped": true' in out["5"]
    assert '"object": "model_unload"' in out["6"] and "summarizer@1" in out["6"]
