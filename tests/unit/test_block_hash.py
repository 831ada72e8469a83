"""The gateway's prefix-affinity routing and the workers' block managers hash blocks through one module
(shared/wire/block_hash.py): the chain the gateway predicts is the chain a block manager caches under,
for every tenant and salt."""

import random

import pytest

from kvrelay.gateway.control.routing import block_chain
from kvrelay.shared.engine.block_manager import BlockManager
from kvrelay.shared.engine.request import Request
from kvrelay.shared.wire.block_hash import DEFAULT_TENANT
from kvrelay.shared.wire.sampling_params import SamplingParams

BS = 4


@pytest.mark.parametrize("tenant,salt", [(DEFAULT_TENANT, None), (DEFAULT_TENANT, "s"), ("acme", None),
                                         ("acme", "s"), ("a:1", ""), (DEFAULT_TENANT, "\x1ftenant:1:a")])
def test_gateway_chain_is_what_the_block_manager_caches(tenant, salt):
    rng = random.Random(7)
    prompt = [rng.randrange(1000) for _ in range(9 * BS + 3)]  # 9 full blocks and a partial one
    bm = BlockManager(32, BS)
    req = Request("r", prompt, SamplingParams(), tenant=tenant, cache_salt=salt)
    assert bm.allocate_slots(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    bm.cache_blocks(req, len(prompt))
    cached = [bm.block_hash[b] for b in bm.block_ids("r")[:9]]
    assert None not in cached and bm.block_hash[bm.block_ids("r")[9]] is None  # the partial block is not cached
    assert block_chain(BS, prompt, tenant, salt, max_blocks=100) == cached
    assert block_chain(BS, prompt, tenant, salt, max_blocks=4) == cached[:4]


def test_namespaces_change_every_hash():
    prompt = list(range(4 * BS))
    chains = [block_chain(BS, prompt, t, s, 4) for t, s in [(DEFAULT_TENANT, None), (DEFAULT_TENANT, "s"),
                                                            ("acme", None), ("acme", "s")]]
    assert len({h for chain in chains for h in chain}) == 16
