"""Greedy requests served through a ModelHost's engine the way the worker loop drives it: the engine steps,
and the host ticks between steps (finishing loads and unloads, moving KV pool memory)."""

import time

from kvrelay import SamplingParams
from kvrelay.shared.worker.model_host import ModelHost


def serve_greedy(host: ModelHost, instance: str, n: int, prompt_len: int,
                 max_tokens: int) -> tuple[int, list[list[int]]]:
    """``n`` greedy requests at once on ``instance``, each a distinct prompt of ``prompt_len`` tokens: (the
    most running together, each one's tokens)."""
    core = host.slots[instance].core
    ids = [f"r{i}-{time.monotonic_ns()}" for i in range(n)]
    for i, rid in enumerate(ids):
        prompt = [(7 * i + t) % 500 + 1 for t in range(prompt_len)]
        core.add_request(core.make_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens)))
    out: dict[str, list[int]] = {rid: [] for rid in ids}
    peak = 0
    while core.has_unfinished():
        for o in core.step():
            out[o.request_id] += o.new_token_ids
        peak = max(peak, core.num_running)
        host.tick()
    return peak, [out[rid] for rid in ids]
