"""What the receivers of host-staged frames share (frames.py's whole layers, rank_parts.py's parts by layer
and head): each frame, sized and placed on arrival by the subclass, is CRC-checked and written into the
granted blocks by a pool thread (pool.py); on CUDA the writes queue on the side stream.

Nothing here blocks the host on the device by a call torch's sync-debug mode counts (a blocking copy, a
stream synchronize): a model load's capture check turns that mode to "error" for the whole process while
it runs, and these threads do not take the step lock that check holds. Copies up are asynchronous (from
pageable memory CUDA returns once the source was read) and the end waits on an event."""

from abc import abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, wait

import torch

from kvrelay.shared.handoff.base import KVReceiver
from kvrelay.shared.handoff.blocks import side_stream
from kvrelay.shared.handoff.pool import INLINE_BYTES, submit


class FrameAssembler(KVReceiver):
    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], nbytes: int, on_done=None):
        """``nbytes``: the whole transfer's, which decides whether its writes run inline; ``on_done``: called
        with each write's future once it finished."""
        self.kv_cache = kv_cache
        self.num_blocks = len(block_ids)
        self.inline = nbytes <= INLINE_BYTES
        self.stream = side_stream(kv_cache.device) if kv_cache.is_cuda else None
        self.index = torch.tensor(block_ids, dtype=torch.long)
        if self.stream is not None:  # on the stream the writes that index with it queue on
            with torch.cuda.stream(self.stream):
                self.index = self.index.to(kv_cache.device, non_blocking=True)
        self.futures: list[Future] = []
        self.on_done = on_done

    @property
    @abstractmethod
    def all_arrived(self) -> bool:
        """Every frame of the transfer was taken (its write may still be running)."""

    def _write(self, fn: Callable[..., None], *args) -> None:
        """Check and write a frame with ``fn(*args)``, off this thread unless the transfer is small."""
        self.futures.append(submit(self.inline, fn, *args))
        if self.on_done is not None:
            self.futures[-1].add_done_callback(self.on_done)

    def _to_device(self, write: Callable[[torch.Tensor], None], frame: torch.Tensor) -> None:
        """``write(frame)``, on the cache's device: there, copied up and written on the side stream."""
        if self.stream is None:
            write(frame)
            return
        with torch.cuda.stream(self.stream):
            write(frame.to(self.kv_cache.device, non_blocking=True))

    def error(self) -> Exception | None:
        for f in self.futures:
            if f.done() and f.exception() is not None:
                return f.exception()
        return None

    @property
    def complete(self) -> bool:
        return self.all_arrived and all(f.done() for f in self.futures)

    def finish(self) -> None:
        if self.stream is not None:
            done = torch.cuda.Event()
            done.record(self.stream)
            done.synchronize()

    def abandon(self) -> None:
        wait(self.futures)
        self.finish()

