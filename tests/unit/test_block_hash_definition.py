"""Block hashes (shared/wire/block_hash.py) against their definition, written out here: sha256 over the parent
(a flag byte, then its 8 bytes), the block's tokens as int64 and the namespace (a flag byte, then its UTF-8),
the digest's first 8 bytes little-endian. The gateway routes by these and the decode worker matches offered
chains against its own cache, so neither the chain nor the one-block hash may drift from it (tests/unit/test_block_hash.py checks that the
gateway and the block manager agree with each other)."""

import hashlib
import random
import struct

from kvrelay.shared.wire.block_hash import block_hash_chain, hash_block_tokens


def _by_definition(parent, tokens, salt):
    data = (b"\x00" if parent is None else b"\x01" + struct.pack("<Q", parent)) + struct.pack(f"<{len(tokens)}q", *tokens)
    data += b"\x00" if salt is None else b"\x01" + salt.encode()
    return struct.unpack("<Q", hashlib.sha256(data).digest()[:8])[0]


def test_chain_and_block_hash_follow_the_definition():
    rng = random.Random(0)
    tokens = [rng.randrange(-5, 200_000) for _ in range(8 * 9 + 5)]  # a partial block at the end: not hashed
    for salt in (None, "", "tenant-salt", "\x1ftenant:1:t=é"):
        want, parent = [], None
        for b in range(9):
            parent = _by_definition(parent, tokens[8 * b:8 * b + 8], salt)
            want.append(parent)
        assert block_hash_chain(tokens, 8, salt, 100) == want
        assert block_hash_chain(tokens, 8, salt, 4) == want[:4]
        assert block_hash_chain(tokens[:7], 8, salt, 100) == []
        assert [hash_block_tokens(p, tuple(tokens[8 * b:8 * b + 8]), salt)
                for b, p in enumerate([None] + want[:-1])] == want


def test_a_known_leading_chain_is_extended_not_recomputed():
    rng = random.Random(1)
    tokens = [rng.randrange(50_000) for _ in range(8 * 6)]  # ends on a block boundary
    whole = block_hash_chain(tokens, 8, "s", 100)
    assert block_hash_chain(tokens, 8, "s", 100, known=whole[:5]) == whole
    assert block_hash_chain(tokens, 8, "s", 4, known=whole) == whole[:4]  # never past max_blocks
    # the known hashes are taken as they are: only the blocks past them are hashed, chained to the last known one
    want, parent = [7, 8], 8
    for b in range(2, 6):
        parent = _by_definition(parent, tokens[8 * b:8 * b + 8], "s")
        want.append(parent)
    assert block_hash_chain(tokens, 8, "s", 100, known=[7, 8]) == want
