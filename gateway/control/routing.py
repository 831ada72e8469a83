"""Which stream a job goes to: a prefill worker's private stream when its prompt's prefix is likely
cached there (prefix affinity), else the model's shared stream, which the first free worker takes from.

Prefix caching only hits on the worker that computed the prefix, so prompts sharing one should meet
there. The affinity key is the model, the request's cache namespace and the hash chain of the prompt's
leading full KV blocks (shared/wire/block_hash.py, which the workers' block managers hash with);
rendezvous (highest-random-weight) hashing maps it onto the live prefill workers of the model, so a key
keeps its worker while workers come and go, and only the keys of a departed worker move. Affinity yields
to load: a preferred worker more than ``slack`` requests busier than the least-loaded candidate, or
without free KV blocks for the prompt (a draining worker advertises none), gets nothing routed; the
shared stream then balances.
Each gateway also remembers where it routed every prefix block (shared/wire/prefix_affinity.py): a prompt
whose leading blocks it has seen goes where the longest of them went, even when the rest of its key differs.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from aiohttp import web

from kvrelay.shared.wire.block_hash import block_hash_chain, cache_namespace
from kvrelay.shared.wire.prefix_affinity import MAX_PREFIX_BLOCKS, PrefixAffinity
from kvrelay.shared.wire.protocol import WorkerInfo


@dataclass(frozen=True)
class Policy:
    enabled: bool = True
    slack: int = 8  # requests
    prefix_tokens: int = 256  # leading prompt tokens (whole blocks of them) that make the key


def candidates(workers: list[WorkerInfo], model: str) -> list[WorkerInfo]:
    """Live workers that can prefill ``model``, in a stable order."""
    return sorted((w for w in workers if w.can_prefill and model in w.models), key=lambda w: w.worker_id)


def block_chain(block_size: int, prompt: Sequence[int], tenant: str, cache_salt: str | None,
                max_blocks: int) -> list[int]:
    """The hash chain of the prompt's leading full blocks (at most ``max_blocks``) in its cache namespace,
    exactly as the workers' block managers hash them."""
    return block_hash_chain(prompt, block_size, cache_namespace(tenant, cache_salt), max_blocks)


def affinity_key(model: str, block_size: int, prompt: Sequence[int], tenant: str, cache_salt: str | None,
                 prefix_tokens: int, chain: list[int] | None = None) -> bytes | None:
    """The hash of the prompt's leading full blocks (up to ``prefix_tokens``) in its cache namespace; None
    below one full block (nothing a worker could have cached)."""
    blocks = min(len(prompt), max(prefix_tokens, block_size)) // block_size
    if blocks == 0:
        return None
    if chain is None or len(chain) < blocks:
        chain = block_chain(block_size, prompt, tenant, cache_salt, blocks)
    return model.encode() + b"\0" + chain[blocks - 1].to_bytes(8, "little")


def _weight(key: bytes, worker_id: str) -> bytes:
    return hashlib.blake2b(key + b"\0" + worker_id.encode(), digest_size=8).digest()


def load(worker: WorkerInfo, backlog: dict[str, int]) -> int:
    """Requests ahead of a new one there: routed to it and not fetched yet, plus its engine's queue."""
    return backlog.get(worker.worker_id, 0) + worker.running + worker.waiting


def pick_worker(key: bytes | None, workers: list[WorkerInfo], backlog: dict[str, int], policy: Policy,
                blocks_needed: int = 1, known: str | None = None, siblings: int = 1) -> str | None:
    """The worker whose private stream should get the job, or None for the shared stream. ``known``: the
    worker this gateway last sent the prompt's longest already-seen prefix to (PrefixAffinity), which beats
    the rendezvous choice when it is still a candidate. ``siblings`` > 1: the job is one of that many
    choices of one prompt (``n``), which must meet on one worker to compute the prompt once (its scheduler
    holds the others until the first has cached it), so where affinity yields they go to the least-loaded
    worker with room rather than to the shared stream, whose first free workers would each compute it."""
    if not policy.enabled or key is None or len(workers) < 2:
        return None  # one worker takes everything from the shared stream anyway
    preferred = next((w for w in workers if w.worker_id == known), None) or max(
        workers, key=lambda w: _weight(key, w.worker_id))
    roomy = [w for w in workers if w.free_blocks >= max(blocks_needed, 1)]
    if preferred in roomy:  # else draining, or it would have to wait for KV: let whoever has room take it
        least = min(load(w, backlog) for w in workers if w.free_blocks > 0)
        if load(preferred, backlog) - least <= policy.slack:
            return preferred.worker_id
    if siblings > 1 and roomy:
        return min(roomy, key=lambda w: (load(w, backlog), w.worker_id)).worker_id
    return None


def route(prompt: Sequence[int], model: str, block_size: int, tenant: str, cache_salt: str | None,
          workers: list[WorkerInfo], backlog: dict[str, int], policy: Policy,
          index: PrefixAffinity | None = None, siblings: int = 1) -> str | None:
    """``pick_worker`` for one prompt; ``workers`` are the model's ``candidates``. With an ``index``, a
    prompt whose leading blocks this gateway already routed goes where the longest of them went (a
    shared document or system prompt shorter than ``prefix_tokens`` followed by different questions
    meets its cache), and every private routing is remembered."""
    if not policy.enabled or len(workers) < 2:
        return None
    limit = max(policy.prefix_tokens // block_size, MAX_PREFIX_BLOCKS if index is not None else 0)
    chain = block_chain(block_size, prompt, tenant, cache_salt, limit)
    key = affinity_key(model, block_size, prompt, tenant, cache_salt, policy.prefix_tokens, chain)
    known = index.lookup(model, chain, {w.worker_id for w in workers}) if index is not None else None
    worker = pick_worker(key, workers, backlog, policy, blocks_needed=-(-len(prompt) // block_size), known=known,
                         siblings=siblings)
    if worker is not None and index is not None:
        index.record(model, chain, worker)
    return worker


INDEX_CAPACITY = 200_000  # (model, block hash) entries a gateway remembers


class Router:
    """The gateway's routing: its policy, built once from the config, and where it sent each prefix."""

    def __init__(self, policy: Policy, index: PrefixAffinity | None = None):
        self.policy = policy
        self.index = index if index is not None else PrefixAffinity(INDEX_CAPACITY)

    def route(self, prompt: Sequence[int], model: str, block_size: int, tenant: str, cache_salt: str | None,
              workers: list[WorkerInfo], backlog: dict[str, int]) -> str | None:
        return route(prompt, model, block_size, tenant, cache_salt, workers, backlog, self.policy, self.index)

    def route_choices(self, prompts: Sequence[Sequence[int]], n: int, model: str, block_size: int, tenant: str,
                      cache_salt: str | None, workers: list[WorkerInfo], backlog: dict[str, int]) -> list[str | None]:
        """Each choice's worker (None: the shared stream), prompt-major with ``n`` choices per prompt as the
        request numbers them. A prompt's ``n`` choices go together and count once in ``backlog`` (updated
        in place, so the next prompt sees them): their worker computes the prompt once."""
        routed: list[str | None] = []
        for prompt in prompts:
            worker = route(prompt, model, block_size, tenant, cache_salt, workers, backlog, self.policy, self.index,
                           siblings=n)
            if worker is not None:
                backlog[worker] = backlog.get(worker, 0) + 1
            routed += [worker] * n
        return routed


ROUTER = web.AppKey("router", Router)
