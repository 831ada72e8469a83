"""``kvrelay bench chat-handoff`` as CI runs it: two tiny chats of three turns through real stacks on the CPU, and
its table adds up. Per turn, with reuse off every prompt block is sent; with reuse on the blocks the decode worker
reports reusing are exactly the ones not sent, none on turn 1 and some on every later turn. No speed is asserted."""

import os
import re
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CHATS, TURNS, USER, REPLY, BLOCK = 2, 3, 24, 8, 8


def test_bench_chat_handoff_sends_only_what_the_decode_worker_does_not_hold():
    argv = ["bench", "chat-handoff", "--model", "dummy:tiny-llama", "--conversations", str(CHATS), "--turns",
            str(TURNS), "--user-len", str(USER), "--reply-len", str(REPLY), "--",
            "--max-model-len", "256", "--block-size", str(BLOCK), "--kv-cache-memory", str(16 << 20)]
    proc = subprocess.run([sys.executable, "-m", "kvrelay.cli", "--log-level", "WARNING", *argv],
                          capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    out = proc.stdout
    assert proc.returncode == 0, f"{out[-3000:]}\n{proc.stderr[-3000:]}"
    rows = re.findall(r"^\| (\d+) \| (\d+) \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \| (\d+) \| (\d+) \|$", out, re.M)
    assert [int(r[0]) for r in rows] == list(range(1, TURNS + 1)), out
    turns = [(int(p), int(off.replace(",", "")), int(on.replace(",", "")), float(ratio), int(roff), int(ron))
             for _, p, off, on, ratio, roff, ron in rows]
    # each turn's prompt: the one before, its reply and a new user message
    assert [t[0] for t in turns] == [USER + i * (REPLY + USER) for i in range(TURNS)]
    per_block = turns[0][1] / (CHATS * -(-USER // BLOCK))
    for i, (prompt, off, on, ratio, reused_off, reused_on) in enumerate(turns):
        assert off == CHATS * -(-prompt // BLOCK) * per_block and reused_off == 0  # off: every block, every turn
        assert on == off - reused_on * per_block and ratio == pytest.approx(on / off, abs=1e-3)
        assert (reused_on == 0) if i == 0 else (0 < reused_on and on < off), turns
    total = re.search(r"^\| all \| \| ([\d,]+) \| ([\d,]+) \| ([\d.]+) \| 0 \| (\d+) \|$", out, re.M)
    assert total and int(total[1].replace(",", "")) == sum(t[1] for t in turns), out
    assert int(total[2].replace(",", "")) == sum(t[2] for t in turns) and int(total[4]) == sum(t[5] for t in turns)
