"""Structured outputs for one engine core: what the core and the model runner call.

- ``attach`` (make_request): starts the request's compile and gives it its ``SequenceGrammar``;
- the core keeps such a request out of the scheduler until its compile is done, and fails it with the
  compile's message (``structured_outputs.<kind> ...``) when it does not compile;
- a request with ``allowed_token_ids`` as well samples from what both allow (its mask row ANDed with the
  allowed ids' bits); when nothing is both, the sequence ends there with its stop token rather than
  sampling from an all -inf row;
- tokens that would make the output invalid UTF-8 (which xgrammar lets through: utf8.py) are masked out
  too, given the sequence's last partial character; where that leaves nothing, the sequence ends likewise;
- ``bitmask`` (each step, after the forward is launched and before sampling): catches each constrained
  sampling row's matcher up with its tokens and fills the rows' masks in one batch call, on the host while
  the device computes. One thread fills: at batch 64 over a 49k vocabulary xgrammar's own thread pool made
  the fill 3-5x slower on the H200's 16-core host (bench/mask_fill.py), its hand-off costing more than the
  ~6 us a row takes.

The tokenizer is the engine's (``--tokenizer``, else the model directory's). A dummy model's synthetic
word-level tokenizer cannot spell JSON, so such a model needs ``--tokenizer`` to serve constraints.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.request import Request
from kvrelay.shared.engine.structured.backend import GrammarBackend
from kvrelay.shared.engine.structured.bitmask import new_bitmask
from kvrelay.shared.engine.structured.compile_cache import GrammarCache
from kvrelay.shared.engine.structured.matcher import GrammarViolation, SequenceGrammar
from kvrelay.shared.text.tokenizer import has_tokenizer

log = logging.getLogger(__name__)


class StructuredOutputManager:
    def __init__(self, tokenizer_dir: str | None, no_tokenizer: str = "") -> None:
        """``tokenizer_dir`` None: every constraint fails with ``no_tokenizer`` as the reason."""
        self.tokenizer_dir = tokenizer_dir
        self.no_tokenizer = no_tokenizer or "the model has no tokenizer"
        self._batch_matcher = None  # made with the first mask (xgrammar is imported with the backend)
        self.cache = GrammarCache(self._make_backend)

    def _make_backend(self) -> GrammarBackend:
        if self.tokenizer_dir is None:
            raise ValueError(self.no_tokenizer)
        return GrammarBackend(self.tokenizer_dir, [])

    def attach(self, req: Request) -> None:
        """Start compiling the request's constraint (if it has one)."""
        so = req.sampling_params.structured_outputs
        if so is not None:
            req.grammar = SequenceGrammar(so, self.cache.submit(so))

    def bitmask(self, reqs: list[Request]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(row indices [R] int64, mask [R, W] int32), both on the host, for the constrained ones among a
        step's sampling rows ``reqs``; None when none is. Every such row's compile has succeeded (the core
        admits no other) and its tokens are on the host (async scheduling reads them first)."""
        # a request that ended since it was scheduled (async scheduling) samples a token that is discarded
        rows = [i for i, r in enumerate(reqs) if r.grammar is not None and not r.finished]
        if not rows:
            return None
        backend = self.cache.backend()
        mask = new_bitmask(len(rows), backend.mask_words)
        matchers, filled = [], []
        narrowed: list[int] = []  # rows a mask other than xgrammar's took tokens from: they may allow none
        for j, i in enumerate(rows):
            req = reqs[i]
            if req.num_pending:
                raise RuntimeError(f"request {req.request_id}: its last token is not on the host; a constrained "
                                   "row's mask needs it")
            req.grammar.compiled.result()  # done already (the core admits no request before)
            try:
                req.grammar.catch_up(backend, req.output_token_ids, _stop_ids(req))
            except GrammarViolation as exc:  # never the step loop's end: this sequence alone ends here
                log.error("request %s: %s; ending it", req.request_id, exc)
                _allow_stop_only(mask, j, req)
                continue
            matchers.append(req.grammar.matcher)
            filled.append(j)
        if matchers:
            if self._batch_matcher is None:
                self._batch_matcher = backend.batch_matcher(threads=1)
            self._batch_matcher.batch_fill_next_token_bitmask(matchers, mask, filled)
            narrowed += backend.utf8.restrict(mask, filled, [reqs[rows[j]].grammar.utf8_state for j in filled])
        for j in filled:
            req = reqs[rows[j]]
            if req.sampling_params.allowed_token_ids:
                mask[j] &= req.grammar.allowed_mask(req.sampling_params.allowed_token_ids, backend.mask_words)
                narrowed.append(j)
        for j in _empty_rows(mask, sorted(set(narrowed))):
            req = reqs[rows[j]]  # nothing is allowed, grammatical and valid UTF-8: the sequence ends here
            why = ("none of its allowed_token_ids continues" if req.sampling_params.allowed_token_ids
                   else "no token keeps valid UTF-8 under")
            log.warning("request %s: %s its %s constraint; ending it", req.request_id, why, req.grammar.constraint.kind)
            _allow_stop_only(mask, j, req)
        return torch.tensor(rows, dtype=torch.int64), mask

    def close(self) -> None:
        self.cache.close()


def _empty_rows(mask: torch.Tensor, rows: list[int]) -> list[int]:
    """Those of ``rows`` whose mask allows no token."""
    if not rows:
        return []
    return [rows[i] for i in np.flatnonzero(~mask.numpy()[rows].any(axis=1))]


def _allow_stop_only(mask: torch.Tensor, row: int, req: Request) -> None:
    """Make ``mask[row]`` allow only the request's first stop id (token 0 when it has none)."""
    stop = (_stop_ids(req)[:1] or [0])[0]
    mask[row] = 0
    mask[row, stop // 32] = 1 << (stop % 32) if stop % 32 < 31 else -(2**31)


def _stop_ids(req: Request) -> list[int]:
    """What may end a constrained output once its grammar is complete: the model's EOS ids (the engine's
    own plus those among the stop ids) and the request's stop ids."""
    params = req.sampling_params
    first = [] if req.eos_token_id is None or params.ignore_eos else [req.eos_token_id]
    return first + list(params.stop_token_ids)


def structured_tokenizer(config: EngineConfig) -> tuple[str | None, str]:
    """(tokenizer directory the grammars compile against, or None; why there is none)."""
    model = config.model
    if model.tokenizer:
        return str(model.tokenizer), ""
    if model.load_format == "dummy" or model.model.startswith("dummy:"):
        return None, ("a dummy model's synthetic tokenizer cannot spell the constraint; start it with --tokenizer "
                      "<a real tokenizer's directory>")
    if has_tokenizer(model.model):
        return model.model, ""
    return None, f"the model {model.model} has no tokenizer files (pass --tokenizer)"
