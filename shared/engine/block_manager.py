"""Paged KV block manager with ref-counted, hash-chained prefix caching (vLLM V1 style).

The scheduler deals in block ids only; the runner turns them into tensors. A block is in exactly one
of three states:

* referenced: ``ref_cnt > 0``, owned by one or more live requests (shared prefixes share blocks);
* cached and evictable: ``ref_cnt == 0`` but still registered under its hash, so a later request
  with the same prefix can pick it up without recomputing; it sits in the free queue;
* plain free: ``ref_cnt == 0``, no hash; also in the free queue.

The free queue is an LRU: allocation pops the head and evicts that block's cache entry if it has one.
A block's hash (shared/wire/block_hash.py, shared with the gateway's routing) chains its parent's hash,
its tokens and the request's cache namespace (its ``cache_salt`` with its tenant folded in), so equal
blocks in different contexts or different tenants never match; a hit is also checked token by token, so
a hash collision degrades to a miss instead of serving another sequence's KV.

A block manager may own only some ids of ``[0, num_blocks)``: models sharing one KV pool
(shared/engine/kv_pool.py) each view the whole pool as blocks and own those the pool granted them. It then
has a ``grow`` hook: an allocation short of free blocks asks the pool for the shortfall before failing,
so the scheduler preempts only when the pool is out; and the pool takes free blocks back through
``release_free_blocks`` when another model needs them.
"""

from collections import OrderedDict
from collections.abc import Callable, Iterable

from kvrelay.shared.engine.request import Request
from kvrelay.shared.wire.block_hash import cache_namespace, hash_block_tokens

# (parent hash, tokens, salt): what a cached block was computed from, compared on every hit.
BlockKey = tuple[int | None, tuple[int, ...], str | None]


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 owned: Iterable[int] | None = None, grow: Callable[[int], list[int]] | None = None,
                 capacity: Callable[[], int] | None = None):
        """``num_blocks``: the block id space. ``owned``: the ids usable now (default all of them);
        ``grow(n)``: more ids, up to about ``n`` (possibly none); ``capacity()``: the most blocks this
        manager could ever own (default: those it owns)."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.id_space = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.grow = grow
        self._capacity = capacity
        self.cached: dict[int, int] = {}  # hash -> block id
        ids = range(num_blocks) if owned is None else sorted(set(owned))
        if ids and not 0 <= ids[0] <= ids[-1] < num_blocks:
            raise ValueError(f"owned block ids must lie in [0, {num_blocks})")
        # per-block state up to the highest id owned, extended as blocks are added: a growable pool's id
        # space spans all the memory it may ever grow into (millions of a small model's blocks)
        size = ids[-1] + 1 if ids else 0
        self.ref_cnt = [0] * size
        self.block_hash: list[int | None] = [None] * size
        self.block_key: list[BlockKey | None] = [None] * size
        self.owned: set[int] = set(ids)
        # Ref-0 blocks, head = next to be reused. OrderedDict: O(1) removal when a cached block is hit.
        self.free_queue: OrderedDict[int, None] = OrderedDict.fromkeys(ids)
        self.num_used = 0
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # hash chain of a request's full blocks, grown lazily
        # leading blocks of a request cache_blocks has dealt with: each step looks at the new ones only,
        # not at the whole sequence (O(blocks) per request per step was ~0.3 ms a step at batch 128 x 2k)
        self.req_cache_done: dict[str, int] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_blocks(self) -> int:
        """Blocks owned now (all of the id space unless a pool shares it)."""
        return len(self.owned)

    @property
    def capacity(self) -> int:
        """The most blocks this manager could own: what a request may need before it can never fit."""
        return self.num_blocks if self._capacity is None else max(self.num_blocks, self._capacity())

    @property
    def usage(self) -> float:
        return self.num_used / self.num_blocks if self.owned else 0.0

    # -- ownership (a shared KV pool moves blocks between models) -------------------------------
    def add_blocks(self, ids: Iterable[int]) -> None:
        """Own these ids too, as plain free blocks at the head of the free queue (reused before any
        cached block is evicted)."""
        for b in ids:
            if not 0 <= b < self.id_space:
                raise ValueError(f"block {b} is outside the id space [0, {self.id_space})")
            if b in self.owned:
                raise ValueError(f"block {b} is already owned")
            if b >= len(self.ref_cnt):
                more = b + 1 - len(self.ref_cnt)
                self.ref_cnt += [0] * more
                self.block_hash += [None] * more
                self.block_key += [None] * more
            self.owned.add(b)
            self.free_queue[b] = None
            self.free_queue.move_to_end(b, last=False)

    def blocks_free(self, ids: Iterable[int]) -> bool:
        """Whether no owned block among ``ids`` is referenced (ids not owned are ignored)."""
        return all(self.ref_cnt[b] == 0 for b in ids if b in self.owned)

    def release_free_blocks(self, ids: Iterable[int]) -> bool:
        """Give up owned, unreferenced blocks, evicting their prefix-cache entries. All or nothing:
        False (and nothing changed) if any is referenced or not owned."""
        ids = list(ids)
        if any(b not in self.free_queue for b in ids):
            return False
        for b in ids:
            self._evict(b)
            del self.free_queue[b]
            self.owned.discard(b)
        return True

    def _grow(self, short: int) -> None:
        if self.grow is not None and short > 0:
            self.add_blocks(self.grow(short))

    def block_ids(self, request_id: str) -> list[int]:
        return list(self.req_blocks.get(request_id, ()))

    def _hashes(self, req: Request, num_full_blocks: int) -> list[int]:
        """The request's block-hash chain, extended to ``num_full_blocks`` (tokens only ever append)."""
        chain = self.req_hashes.setdefault(req.request_id, [])
        if len(chain) < num_full_blocks:
            salt = cache_namespace(req.tenant, req.cache_salt)
            for i in range(len(chain), num_full_blocks):
                parent = chain[-1] if chain else None
                chain.append(hash_block_tokens(parent, self._block_tokens(req, i), salt))
        return chain

    def _key(self, req: Request, chain: list[int], i: int) -> BlockKey:
        return (chain[i - 1] if i else None, self._block_tokens(req, i),
                cache_namespace(req.tenant, req.cache_salt))

    def _block_tokens(self, req: Request, i: int) -> tuple[int, ...]:
        """Block ``i``'s tokens, without concatenating prompt and output (all_token_ids copies both)."""
        start, end = i * self.block_size, (i + 1) * self.block_size
        prompt, output = req.prompt_token_ids, req.output_token_ids
        p = len(prompt)
        if end <= p:
            return tuple(prompt[start:end])
        if start >= p:
            return tuple(output[start - p:end - p])
        return tuple(prompt[start:]) + tuple(output[:end - p])

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of full blocks, leaving at least one token to compute (the runner needs
        a query to sample from). Takes no references: allocate_slots does, atomically."""
        if not self.enable_prefix_caching:
            return [], 0
        max_blocks = (req.num_tokens - 1) // self.block_size
        chain = self._hashes(req, max_blocks)
        hits: list[int] = []
        for i in range(max_blocks):
            block = self.cached.get(chain[i])
            if block is None or self.block_key[block] != self._key(req, chain, i):
                break
            hits.append(block)
        self.prefix_queries += req.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
            self.block_hash[block] = None
            self.block_key[block] = None

    def _take_free(self, n: int) -> list[int]:
        """``n`` blocks off the free queue's head, each referenced once and out of the prefix cache (about to
        be overwritten). One loop over locals: a long prompt takes hundreds of blocks at once."""
        pop, ref_cnt, block_hash = self.free_queue.popitem, self.ref_cnt, self.block_hash
        blocks = []
        for _ in range(n):
            block = pop(last=False)[0]
            if block_hash[block] is not None:
                self._evict(block)
            ref_cnt[block] = 1
            blocks.append(block)
        self.num_used += len(blocks)
        return blocks

    def _ref(self, block: int) -> None:
        if self.ref_cnt[block] == 0:
            del self.free_queue[block]
            self.num_used += 1
        self.ref_cnt[block] += 1

    def allocate_slots(self, req: Request, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool:
        """Make the request own blocks for ``num_computed_tokens + num_new_tokens`` tokens.

        All-or-nothing: on False nothing changed, so the scheduler can try a preemption and retry.
        """
        rid = req.request_id
        blocks = self.req_blocks.get(rid)
        if blocks is not None and not computed_blocks:
            need = -(-(req.num_computed_tokens + num_new_tokens) // self.block_size) - len(blocks)
            if need <= 0:
                return True  # most decode steps: the last block still has room
        computed = computed_blocks or []
        if blocks and computed:
            raise ValueError(f"request {rid} already owns blocks; computed_blocks are for its first allocation")
        have = len(blocks or ()) + len(computed)
        need = cdiv(req.num_computed_tokens + num_new_tokens, self.block_size) - have
        # Hit blocks that sit in the free queue stop being allocatable once we reference them.
        reclaimed = sum(1 for b in computed if self.ref_cnt[b] == 0)
        self._grow(need - (self.num_free_blocks - reclaimed))
        if need > self.num_free_blocks - reclaimed:
            return False
        if blocks is None:
            blocks = self.req_blocks[rid] = []
        for b in computed:
            self._ref(b)
        blocks.extend(computed)
        blocks.extend(self._take_free(max(need, 0)))
        return True

    def allocate_for_tokens(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Fresh blocks for KV that arrives from elsewhere (disaggregated decode pre-allocates)."""
        if request_id in self.req_blocks:
            raise ValueError(f"request {request_id} already owns blocks")
        need = cdiv(num_tokens, self.block_size)
        self._grow(need - self.num_free_blocks)
        if need > self.num_free_blocks:
            return None
        blocks = self.req_blocks[request_id] = self._take_free(need)
        return list(blocks)

    def allocate_with_prefix(self, request_id: str, num_tokens: int,
                             block_hashes: list[int]) -> tuple[list[int], int] | None:
        """``allocate_for_tokens`` for KV arriving from elsewhere whose leading full blocks hash (in the request's
        namespace) to ``block_hashes``: the longest run of them cached here is reused, referenced at once so
        nothing evicts it before the rest arrives, and fresh blocks follow for the rest. At least one block stays
        fresh (a transfer always moves some KV, and its header proves which prompt it is). Returns (the request's
        blocks in order, how many lead reused), or None when too few are free. A hit is matched by hash only: the
        caller compares ``holds_prefix`` against the tokens before using it."""
        if request_id in self.req_blocks:
            raise ValueError(f"request {request_id} already owns blocks")
        hits = self._prefix_hits(num_tokens, block_hashes)
        need = cdiv(num_tokens, self.block_size) - len(hits)
        reclaimed = sum(1 for b in hits if self.ref_cnt[b] == 0)  # as allocate_slots: a hit in the free queue
        self._grow(need - (self.num_free_blocks - reclaimed))
        if need > self.num_free_blocks - reclaimed:
            return None
        for b in hits:
            self._ref(b)
        blocks = self.req_blocks[request_id] = hits + self._take_free(need)
        return list(blocks), len(hits)

    def cached_prefix(self, num_tokens: int, block_hashes: list[int]) -> int:
        """How many blocks ``allocate_with_prefix`` would reuse now for the same arguments (nothing is taken)."""
        return len(self._prefix_hits(num_tokens, block_hashes))

    def _prefix_hits(self, num_tokens: int, block_hashes: list[int]) -> list[int]:
        """The cached blocks of the longest leading run of ``block_hashes``, leaving the prompt's last token's
        block fresh (see ``allocate_with_prefix``)."""
        hits: list[int] = []
        if self.enable_prefix_caching:
            for h in block_hashes[:(num_tokens - 1) // self.block_size]:
                block = self.cached.get(h)
                if block is None:
                    break
                hits.append(block)
        return hits

    def holds_prefix(self, blocks: list[int], tokens: list[int], tenant: str, cache_salt: str | None) -> bool:
        """Whether ``blocks`` are cached as the leading full blocks of ``tokens`` in that tenant's namespace, key by
        key (parent hash, tokens, namespace), as ``get_computed_blocks`` checks a hit."""
        salt, parent = cache_namespace(tenant, cache_salt), None
        for i, block in enumerate(blocks):
            block_tokens = tuple(tokens[i * self.block_size:(i + 1) * self.block_size])
            if len(block_tokens) < self.block_size or self.block_key[block] != (parent, block_tokens, salt):
                return False
            parent = self.block_hash[block]
        return True

    def cache_blocks(self, req: Request, num_computed_tokens: int) -> None:
        """Register the request's full, computed blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        blocks = self.req_blocks.get(req.request_id, [])
        num_full = min(num_computed_tokens // self.block_size, len(blocks))
        done = self.req_cache_done.get(req.request_id, 0)
        if num_full <= done:
            return
        chain = self._hashes(req, num_full)
        self.req_cache_done[req.request_id] = num_full
        for i in range(done, num_full):
            block = blocks[i]
            if self.block_hash[block] is not None:
                continue  # a prefix hit, or registered on an earlier step
            h = chain[i]
            if h in self.cached:
                continue  # same content computed twice concurrently, or a collision: keep the first
            self.cached[h] = block
            self.block_hash[block] = h
            self.block_key[block] = self._key(req, chain, i)

    def reassign(self, request_id: str, owner: str) -> None:
        """Hold ``request_id``'s blocks under ``owner`` instead (freed with ``free(owner)``), so the request
        id is free to allocate again; the blocks are no request's prefix any more."""
        self.req_hashes.pop(request_id, None)
        self.req_cache_done.pop(request_id, None)
        self.req_blocks[owner] = self.req_blocks.pop(request_id, [])

    def free(self, request_id: str) -> None:
        """Drop a request's references. Freed blocks enter the free queue last-block-first, so a
        sequence's tail is evicted before its (more shareable) head. Uncached blocks hold nothing
        worth keeping and go to the head, to be reused before any cached block is evicted."""
        self.req_hashes.pop(request_id, None)
        self.req_cache_done.pop(request_id, None)
        ref_cnt, block_hash, free_queue = self.ref_cnt, self.block_hash, self.free_queue
        for block in reversed(self.req_blocks.pop(request_id, [])):
            ref_cnt[block] -= 1
            if ref_cnt[block] == 0:
                self.num_used -= 1
                free_queue[block] = None
                if block_hash[block] is None:
                    free_queue.move_to_end(block, last=False)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block (e.g. after a weight swap). Refused while any block is in use,
        since live requests' blocks could not be un-shared safely."""
        if self.num_used:
            return False
        self.cached.clear()
        self.block_hash = [None] * len(self.ref_cnt)
        self.block_key = [None] * len(self.ref_cnt)
        return True
