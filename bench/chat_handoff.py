"""``kvrelay bench chat-handoff``: the KV a multi-turn chat load hands off, with the decode worker's reuse of prompt
blocks it already holds on and off, in the same call.

``--conversations`` N chats of ``--turns`` T turns. Turn 1's prompt is a system prompt (``--system-len`` tokens,
the same in every chat; 0: none) and a user message (``--user-len`` random tokens); turn t's is turn t-1's prompt,
its reply (``--reply-len`` tokens, greedy, read back as token ids) and a new user message. The N chats of a turn are
sent together; the next turn starts once all have answered.

Each mode gets a fresh stack on a flushed Redis: a gateway, a prefill and a decode worker, each its own process
(kvrelay/local_cluster.py), every worker with the engine flags given after ``--``. Reuse **on** is the decode worker
as deployed: prefix caching on, so a turn's ask is granted past the prompt blocks it holds from the turn before, and
only the rest is sent. Reuse **off** is the same decode worker with ``--no-enable-prefix-caching``, the switch that
turns that reuse off: every prompt block is sent. Per turn it prints, for both modes, the KV bytes the decode worker
received (``kvrelay_handoff_received_bytes_total``) and the prompt blocks it reused
(``kvrelay_handoff_reused_blocks_total``), read from its /metrics once every chat of the turn answered (it counts a
handoff as it admits it), and the bytes on / off. Replies are greedy, so both modes send the same prompts.
"""

import argparse
import random
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import openai

from kvrelay.local_cluster import LocalCluster
from kvrelay.shared.wire.loopback_ports import free_port
from kvrelay.shared.wire.redis_conn import EmbeddedRedis, sync_client

RECEIVED, REUSED = "kvrelay_handoff_received_bytes_total", "kvrelay_handoff_reused_blocks_total"
MODES = {"off": ["--no-enable-prefix-caching"], "on": []}  # the decode worker's flags past the engine's


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2", help="the model both workers serve (a folder, smollm2, dummy:<preset>)")
    p.add_argument("--conversations", type=int, default=8, help="chats, each sent its turns in order")
    p.add_argument("--turns", type=int, default=4, help="turns per chat")
    p.add_argument("--system-len", type=int, default=0, help="tokens of a system prompt every chat starts with")
    p.add_argument("--user-len", type=int, default=64, help="tokens of each user message")
    p.add_argument("--reply-len", type=int, default=32, help="tokens of each reply")
    p.add_argument("--vocab", type=int, default=256, help="user and system tokens are drawn from [100, 100 + vocab)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("engine_args", nargs="*", help="after --: engine flags for both workers")


def counters(port: int) -> tuple[float, float]:
    """(KV bytes received, prompt blocks reused) so far, from the decode worker's /metrics at ``port``."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    got = {RECEIVED: 0.0, REUSED: 0.0}
    for line in text.splitlines():
        name = line.split("{", 1)[0]
        if name in got:
            got[name] += float(line.rsplit(" ", 1)[1])
    return got[RECEIVED], got[REUSED]


def chats(args: argparse.Namespace, base_url: str, port: int) -> list[dict]:
    """Every turn of every chat against the stack at ``base_url``: per turn, the mean prompt length, the KV bytes
    the decode worker received and the blocks it reused."""
    rng = random.Random(args.seed)
    system = [rng.randrange(100, 100 + args.vocab) for _ in range(args.system_len)]
    prompts = [list(system) for _ in range(args.conversations)]
    client = openai.OpenAI(base_url=base_url, api_key="none", max_retries=0, timeout=600)
    model = client.models.list().data[0].id

    def reply(prompt: list[int]) -> list[int]:
        out = client.completions.create(model=model, prompt=prompt, max_tokens=args.reply_len, temperature=0.0,
                                        logprobs=0, extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        return [int(tok.removeprefix("token_id:")) for tok in out.choices[0].logprobs.tokens]

    rows, before = [], counters(port)
    with ThreadPoolExecutor(args.conversations) as pool:
        for _ in range(args.turns):
            for p in prompts:
                p += [rng.randrange(100, 100 + args.vocab) for _ in range(args.user_len)]
            replies = list(pool.map(reply, prompts))
            after = counters(port)
            rows.append({"prompt": sum(map(len, prompts)) / len(prompts), "bytes": after[0] - before[0],
                         "reused": after[1] - before[1]})
            before = after
            for p, r in zip(prompts, replies, strict=True):
                p += r
    return rows


def run_mode(args: argparse.Namespace, mode: str, redis_url: str, log_dir: Path) -> list[dict]:
    sync_client(redis_url).flushall()
    cluster = LocalCluster(redis_url, log_dir, cli_flags=["--log-level", "WARNING"])
    port = free_port()
    try:
        cluster.start_gateway()
        cluster.start_worker("prefill", "p1", args.model, args.engine_args)
        cluster.start_worker("decode", "d1", args.model, [*args.engine_args, *MODES[mode], "--monitoring-port", str(port)])
        cluster.wait_ready(timeout=600)
        return chats(args, cluster.base_url(), port)
    finally:
        cluster.stop()


def run(args: argparse.Namespace) -> int:
    with EmbeddedRedis() as redis_url, tempfile.TemporaryDirectory() as logs:
        by_mode = {mode: run_mode(args, mode, redis_url, Path(logs)) for mode in MODES}
    off, on = by_mode["off"], by_mode["on"]
    print(f"\nKV handoff bytes, {args.conversations} chats x {args.turns} turns (model {args.model}; system prompt "
          f"{args.system_len}, user {args.user_len}, reply {args.reply_len} tokens); decode-side reuse off vs on\n"
          "| turn | prompt tokens (mean) | off: bytes received | on: bytes received | on / off | off: blocks reused "
          "| on: blocks reused |\n| --- | --- | --- | --- | --- | --- | --- |")
    for turn, (a, b) in enumerate(zip(off, on, strict=True), 1):
        print(f"| {turn} | {b['prompt']:.0f} | {a['bytes']:,.0f} | {b['bytes']:,.0f} | {_ratio(b['bytes'], a['bytes'])} | "
              f"{a['reused']:.0f} | {b['reused']:.0f} |")
    total_off, total_on = sum(r["bytes"] for r in off), sum(r["bytes"] for r in on)
    print(f"| all | | {total_off:,.0f} | {total_on:,.0f} | {_ratio(total_on, total_off)} | "
          f"{sum(r['reused'] for r in off):.0f} | {sum(r['reused'] for r in on):.0f} |", flush=True)
    return 0


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.3f}" if b else "n/a"
