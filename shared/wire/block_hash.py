"""The identity of a full KV block: what the workers' block managers cache under and the gateway's
prefix-affinity routing predicts with. Both sides import it from here, so they cannot drift apart, and
it needs nothing beyond the standard library (the gateway imports no torch).

A block's hash chains its parent's hash, its tokens and the request's cache namespace (its
``cache_salt`` with its tenant folded in), so equal blocks in different contexts or different tenants
never match.
"""

import hashlib
from array import array
from collections.abc import Sequence

DEFAULT_TENANT = "default"  # the gateway's tenant when no API keys are configured, and the offline API's

_NS_MARK = "\x1f"


def hash_block_tokens(parent: int | None, tokens: tuple[int, ...], salt: str | None) -> int:
    """Stable 64-bit hash of one full block in its context.

    sha256 rather than ``hash()``: Python salts ``str`` hashes per process, and block hashes are
    meant to be comparable across processes (the gateway routes by them).
    """
    return _digest(_parent_bytes(parent), array("q", tokens).tobytes(), _salt_bytes(salt))


def _digest(parent: bytes, tokens: bytes, salt: bytes) -> int:
    # one sha256 call over the joined bytes: the same digest as three updates, a third of the calls
    return int.from_bytes(hashlib.sha256(parent + tokens + salt).digest()[:8], "little")


def _parent_bytes(parent: int | None) -> bytes:
    return b"\x00" if parent is None else b"\x01" + parent.to_bytes(8, "little")


def _salt_bytes(salt: str | None) -> bytes:
    return b"\x00" if salt is None else b"\x01" + salt.encode()


def cache_namespace(tenant: str, cache_salt: str | None) -> str | None:
    """The salt a request's blocks are hashed with. The gateway already gives each tenant its own salt;
    folding the tenant in here as well means a gateway that forgets (or a client-chosen salt that
    matches another tenant's) still cannot make two tenants share KV. The default tenant keeps its
    salt unchanged, so single-tenant and offline hashes are what they always were, unless that salt
    starts with the marker every folded namespace starts with; the tenant is length-prefixed, so no
    (tenant, salt) pair can spell another one."""
    if tenant == DEFAULT_TENANT and not (cache_salt or "").startswith(_NS_MARK):
        return cache_salt
    salt = "" if cache_salt is None else "=" + cache_salt
    return f"{_NS_MARK}tenant:{len(tenant)}:{tenant}{salt}"


def block_hash_chain(tokens: Sequence[int], block_size: int, salt: str | None, max_blocks: int,
                     known: Sequence[int] = ()) -> list[int]:
    """The hash chain of the leading full blocks of ``tokens`` (at most ``max_blocks``): ``hash_block_tokens``
    block after block, over one packing of the prompt's tokens sliced per block. ``known``: the chain's leading
    hashes, already computed (a prefill's prefix cache has all but, for a prompt that ends on a block boundary,
    the last): only the blocks past them are hashed."""
    n = min(len(tokens) // block_size, max_blocks)
    start = min(len(known), n)
    chain = list(known[:start])
    data = array("q", tokens[start * block_size:n * block_size]).tobytes()
    step, tail = 8 * block_size, _salt_bytes(salt)
    parent = chain[-1] if chain else None
    for off in range(0, len(data), step):
        parent = _digest(_parent_bytes(parent), data[off:off + step], tail)
        chain.append(parent)
    return chain
