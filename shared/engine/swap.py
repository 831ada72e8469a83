"""Host (CPU) swap space for preempted requests' KV, as a free list of host block ids.

The scheduler decides which device block goes to which host block; the runner does the copies.
"""


class HostBlockPool:
    def __init__(self, num_blocks: int):
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be non-negative, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # popped from the end: low ids first
        self._is_free = [True] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` host blocks, or None (and nothing taken) if fewer are free."""
        if n > len(self._free):
            return None
        blocks = [self._free.pop() for _ in range(n)]
        for b in blocks:
            self._is_free[b] = False
        return blocks

    def free(self, blocks: list[int]) -> None:
        # A double free would hand one host block to two requests: fail loudly instead.
        if len(set(blocks)) != len(blocks):
            raise ValueError(f"host blocks freed twice in one call: {blocks}")
        for b in blocks:
            if not 0 <= b < self.num_blocks or self._is_free[b]:
                raise ValueError(f"host block {b} is out of range or already free")
        for b in reversed(blocks):
            self._is_free[b] = True
            self._free.append(b)
