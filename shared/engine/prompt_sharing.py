"""Requests with the same prompt compute it once: the first one admitted leads, the others wait until the
leader's full prompt blocks are computed (and so in the prefix cache), then start from those blocks.

Why: ``n > 1`` fans out above the engine (llm_engine.py, or the gateway as separate jobs), so n requests
with one prompt reach the waiting queue together. Admitted in the same step, each misses the cache (the
blocks are not computed yet) and computes the whole prompt: n times the work. Held back one prefill, they
compute only the partial last block, which cannot be shared (a request writes into it).

The match is by content (tenant, cache salt, prompt tokens), not by a parent id: the gateway's fan-out
reaches a worker as unrelated jobs, and identical prompts from different requests gain the same way.
Nothing waits for a leader that is not computing: once the leader has its full blocks, or is preempted,
aborted or finished, the others are free, and the next of them admitted leads if the prompt is still to
compute. A held request is skipped, not a barrier: requests queued behind it may be admitted past it.
Without prefix caching, or for a request that must compute every prompt token (prompt logprobs), there is
nothing to share and nothing is held.
"""

from kvrelay.shared.engine.request import Request, RequestStatus


class SharedPrompts:
    def __init__(self, block_size: int, enabled: bool):
        self.block_size = block_size
        self.enabled = enabled
        self._leaders: dict[int, Request] = {}  # prompt key -> the request computing that prompt
        self._keys: dict[str, int] = {}  # request id -> its prompt key (hashing a long prompt once)

    def _shareable(self, req: Request) -> bool:
        return (self.enabled and req.num_prompt_tokens >= self.block_size and req.swapped_blocks is None
                and req.sampling_params.prompt_logprobs is None)

    def _key(self, req: Request) -> int:
        key = self._keys.get(req.request_id)
        if key is None:
            key = self._keys[req.request_id] = hash((req.tenant, req.cache_salt, tuple(req.prompt_token_ids)))
        return key

    def _full_prompt(self, req: Request) -> int:
        return req.num_prompt_tokens // self.block_size * self.block_size

    def _computing(self, leader: Request | None) -> bool:
        return (leader is not None and leader.status is RequestStatus.RUNNING
                and leader.num_computed_tokens < self._full_prompt(leader))

    def must_wait(self, req: Request) -> bool:
        """Whether waiting ``req`` should stay waiting this step: another request is computing its prompt."""
        if not self._shareable(req):
            return False
        leader = self._leaders.get(self._key(req))
        return (leader is not req and self._computing(leader) and leader.prompt_token_ids == req.prompt_token_ids
                and (leader.tenant, leader.cache_salt) == (req.tenant, req.cache_salt))

    def admitted(self, req: Request) -> None:
        """``req`` got its first blocks (prefix hits counted): it leads if it computes the prompt's blocks
        and nobody else is."""
        if not self._shareable(req) or not self._computing(req):
            return
        key = self._key(req)
        if not self._computing(self._leaders.get(key)):
            self._leaders[key] = req

    def ended(self, req: Request) -> None:
        key = self._keys.pop(req.request_id, None)
        if key is not None and self._leaders.get(key) is req:
            del self._leaders[key]
