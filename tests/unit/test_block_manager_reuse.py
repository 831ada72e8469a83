"""A decode worker's reservation for handed-off KV that reuses the prompt's leading blocks it caches already
(BlockManager.allocate_with_prefix, matched by the sender's hash chain; holds_prefix checks the tokens)."""

from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.request import Request
from kvrelay.shared.wire.block_hash import block_hash_chain, cache_namespace
from kvrelay.shared.wire.sampling_params import SamplingParams

BS = 4


def cached_prompt(bm: BlockManager, rid: str, tokens: list[int], tenant: str = "default",
                  salt: str | None = None) -> list[int]:
    """``tokens`` computed and cached under ``rid``, then freed: its full blocks stay cached, evictable."""
    r = Request(rid, list(tokens), SamplingParams(), cache_salt=salt, tenant=tenant)
    assert bm.allocate_slots(r, len(tokens))
    r.num_computed_tokens = len(tokens)
    bm.cache_blocks(r, len(tokens))
    blocks = bm.block_ids(rid)
    bm.free(rid)
    return blocks


def chain(tokens: list[int], tenant: str = "default", salt: str | None = None) -> list[int]:
    """The sender's hashes (shared/handoff/outbound.py): every full block of the prompt."""
    return block_hash_chain(tokens, BS, cache_namespace(tenant, salt), 1 << 20)


def test_the_cached_leading_blocks_are_reused_and_referenced_before_fresh_ones():
    bm = BlockManager(16, BS)
    prompt = list(range(20))  # five full blocks
    old = cached_prompt(bm, "old", prompt)
    free_before = bm.num_free_blocks
    longer = prompt[:12] + [99] * 9  # three blocks in common, then another turn
    blocks, cached = bm.allocate_with_prefix("new", len(longer), chain(longer))
    assert cached == 3 and blocks[:3] == old[:3] and len(blocks) == 6
    assert not set(blocks[3:]) & set(old[:3])
    assert bm.block_ids("new") == blocks
    assert all(bm.ref_cnt[b] == 1 for b in blocks)
    # the reused blocks left the free queue: no allocation can evict them before the KV arrives
    assert not set(old[:3]) & set(bm.free_queue) and bm.num_free_blocks == free_before - 6
    assert bm.holds_prefix(blocks[:3], longer, "default", None)
    bm.free("new")
    assert bm.num_free_blocks == free_before and all(bm.cached.get(h) == b for h, b in zip(chain(prompt), old, strict=True))


def test_at_least_one_block_is_always_fresh():
    bm = BlockManager(16, BS)
    prompt = list(range(16))  # exactly four full blocks, all cached
    old = cached_prompt(bm, "old", prompt)
    blocks, cached = bm.allocate_with_prefix("same", len(prompt), chain(prompt))
    assert cached == 3 and blocks[:3] == old[:3] and blocks[3] != old[3] and len(blocks) == 4


def test_a_block_in_use_by_a_running_request_is_shared():
    bm = BlockManager(16, BS)
    prompt = list(range(12))
    r = Request("running", prompt, SamplingParams())
    assert bm.allocate_slots(r, len(prompt))
    r.num_computed_tokens = len(prompt)
    bm.cache_blocks(r, len(prompt))
    blocks, cached = bm.allocate_with_prefix("sibling", len(prompt) + 1, chain(prompt))
    assert cached == 3 and blocks[:3] == bm.block_ids("running") and all(bm.ref_cnt[b] == 2 for b in blocks[:3])


def test_the_longest_leading_run_only_and_other_namespaces_miss():
    bm = BlockManager(16, BS)
    prompt = list(range(20))
    cached_prompt(bm, "old", prompt)
    other = [7] * 4 + prompt[4:]  # its first block differs, so every later hash differs too
    for rid, tokens, hashes in [("other", other, chain(other)), ("tenant", prompt, chain(prompt, tenant="acme")),
                                ("salt", prompt, chain(prompt, salt="s")), ("none", prompt, [])]:
        assert bm.allocate_with_prefix(rid, len(tokens), hashes)[1] == 0, rid
        bm.free(rid)


def test_prefix_caching_off_allocates_as_for_tokens():
    bm = BlockManager(16, BS, enable_prefix_caching=False)
    r = Request("old", list(range(20)), SamplingParams())
    assert bm.allocate_slots(r, 20)
    bm.cached[chain(list(range(20)))[0]] = bm.block_ids("old")[0]  # even a registered block is not taken
    blocks, cached = bm.allocate_with_prefix("new", 20, chain(list(range(20))))
    assert cached == 0 and not set(blocks) & set(bm.block_ids("old"))


def test_too_few_free_blocks_changes_nothing():
    bm = BlockManager(6, BS)
    prompt = list(range(20))
    cached_prompt(bm, "old", prompt)  # five blocks cached, evictable: one plain free block besides
    state = (dict(bm.cached), list(bm.free_queue), list(bm.ref_cnt))
    longer = prompt[:8] + [1] * 20  # two reused, five fresh: the two reused ones are not free to take
    assert bm.allocate_with_prefix("new", len(longer), chain(longer)) is None
    assert (dict(bm.cached), list(bm.free_queue), list(bm.ref_cnt)) == state and "new" not in bm.req_blocks
    blocks, cached = bm.allocate_with_prefix("fits", 24, chain(prompt[:8] + [1] * 16))  # two reused, four fresh
    assert cached == 2 and len(blocks) == 6 and bm.num_free_blocks == 0


def test_holds_prefix_compares_tokens_and_namespace_not_only_hashes():
    bm = BlockManager(16, BS)
    prompt = list(range(12))
    old = cached_prompt(bm, "old", prompt, tenant="acme", salt="s")
    assert bm.holds_prefix(old[:3], prompt, "acme", "s")
    assert not bm.holds_prefix(old[:3], prompt[:8] + [0, 0, 0, 0], "acme", "s")  # the last block's tokens
    assert not bm.holds_prefix(old[:3], prompt, "default", "s")
    assert not bm.holds_prefix(old[:3], prompt, "acme", None)
    assert not bm.holds_prefix([old[1], old[0]], prompt, "acme", "s")  # the chain's order (parent hashes)
    assert not bm.holds_prefix(old[:3], prompt[:10], "acme", "s")  # not a full block of this prompt


def test_a_handed_off_prompt_is_reusable_from_its_admission_not_its_first_step():
    """An n > 1 sibling's (or a later turn's) ask granted between a handed-off request's admission and its first
    decode step here already finds the prompt's blocks: admission caches them, the KV having landed."""
    from kvrelay.shared.config.engine import SchedulerConfig
    from kvrelay.shared.engine.scheduler import Scheduler

    s = Scheduler(SchedulerConfig(), BlockManager(32, BS), max_model_len=64)
    tokens = list(range(10, 31))  # 21 tokens: 5 full blocks and one partial
    first = Request("first", tokens, SamplingParams(), max_tokens=4)
    assert s.block_manager.allocate_with_prefix("first", len(tokens), chain(tokens)) is not None
    first.output_token_ids, first.num_computed_tokens = [7], len(tokens)
    s.add_prefilled_request(first)
    blocks, reused = s.block_manager.allocate_with_prefix("sibling", len(tokens), chain(tokens))
    assert reused == 5 and blocks[:5] == s.block_manager.block_ids("first")[:5]
