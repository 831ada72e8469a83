"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

Eager PyTorch launches ~11 kernels per layer from Python; for an 8B model at batch 1 that host work
takes longer than the ~4 ms the GPU needs to stream the weights. A decode step (one new token per
sequence) has the same shapes every time up to its batch size, so each bucket's forward pass plus its
logits are captured once and replayed with one launch.

Static inputs: one int32 device buffer with the layout of shared/engine/step_inputs.py sized to the largest
bucket (block tables ``ceil(max_model_len / block_size)`` wide). Each step writes its rows (padded up
to the bucket) into a pinned host buffer and copies it over in one non-blocking transfer, then replays
the smallest bucket >= its batch. Padding rows write no KV (slot -1) and their logits are not read.

The Triton decode kernel fixes its split count at capture from the metadata's ``max_seq_len`` and
takes each sequence's real length from ``seq_lens`` on the device, so a graph captured for lengths up
to ``max_model_len`` serves every step. Each bucket also has a graph for short contexts (all lengths
<= SHORT_CONTEXT): there a batch of one splits a 200-token context 4 ways instead of 64, which saves a
merge pass over 64 partials per layer. Graphs are captured at start-up, largest first, into one shared
memory pool (intermediates of one graph are reused by the next; replays never overlap). Their logits
land in one shared buffer, valid until the next replay.

A model loaded into a worker beside others is captured while they serve: each graph is recorded holding
the load's hold (``graphs_held``: the worker's step lock) on its own, so the others step between graphs,
and ``record`` below says why nothing else of a capture may stall them.

The graphs hold the KV cache's address: write into that tensor, never replace it.
"""

import bisect
import contextlib
import logging
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
from torch import nn

from kvrelay.kernels import AttentionMetadata
from kvrelay.shared.engine.step_inputs import Layout, StepBatch, host_buffer, views, write

log = logging.getLogger(__name__)

SHORT_CONTEXT = 512  # tokens: the length class of the second graph of each bucket


def capture_sizes(max_batch: int) -> list[int]:
    """Buckets: 1, 2, 4, then every 8 to 64, every 16 to 256, every 32 beyond, and max_batch itself.

    Padding a batch into its bucket costs at most one step of 16 (or 32) rows past 64, where a step is
    already bound by reading the weights; small batches, where latency matters most, pad by little."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [1, 2, 4, *range(8, 65, 8), *range(80, 257, 16), *range(288, max_batch + 1, 32)]
    return sorted({s for s in sizes if s <= max_batch} | {max_batch})


def bucket_for(sizes: list[int], batch: int) -> int | None:
    """Smallest captured size >= batch; None when the batch is larger than every bucket."""
    i = bisect.bisect_left(sizes, batch)
    return sizes[i] if i < len(sizes) else None


@contextmanager
def syncs_raise(on: bool = True) -> Iterator[None]:
    # a kernel that syncs with the host (data-dependent shapes, .item()) cannot be captured; this
    # makes such an op raise in an ordinary run instead of corrupting a capture. The setting is the
    # process's: entered under the load's hold, so no other model's step (which may sync) runs meanwhile
    if not on:
        yield
        return
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(previous)


def capturable(forward: Callable[[], None], record: bool, fallback: str, example: str = "") -> bool:
    """Run ``forward`` once, under the load's hold, with host syncs raising: False (and a warning opening with
    ``fallback``) when one of its kernels syncs with the host, which a CUDA graph cannot hold."""
    try:
        with capture_hold():
            if record:
                # a capture cannot take memory the ordinary pool caches (the caching allocator frees none while
                # one runs): given back once here, not per graph
                torch.cuda.empty_cache()
            with syncs_raise(record):
                forward()
    except RuntimeError as e:
        if "synchroniz" not in str(e):
            raise
        log.warning("%s: a kernel of this model syncs with the host (%s), which a CUDA graph cannot hold%s",
                    fallback, e, example)
        return False
    return True


_held = threading.local()


@contextmanager
def graphs_held(hold: AbstractContextManager | None) -> Iterator[None]:
    """Graphs this thread captures meanwhile (decode and piecewise) each take ``hold`` on their own, where
    an engine's build (shared/engine/warmup.py ``build_engine``) holds it throughout otherwise: a worker's
    step lock, so its other models step between one graph and the next."""
    previous = getattr(_held, "hold", None)
    _held.hold = hold
    try:
        yield
    finally:
        _held.hold = previous


def capture_hold() -> AbstractContextManager:
    """What each graph capture of this thread holds (``graphs_held``); nothing by default."""
    return getattr(_held, "hold", None) or nullcontext()


_side_streams: dict[int, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """Where a capture records: the thread's current stream (a worker's compute stream, shared/worker/
    gpu_share.py, so the graphs are its kernels), or where that is the default stream, which cannot capture,
    one side stream of the device's for every capture of the process, as torch.cuda.graph keeps one (library
    state kept per stream, cuBLAS workspaces, is then made once)."""
    current = torch.cuda.current_stream(device)
    if current != torch.cuda.default_stream(device):
        return current
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _side_streams:
        _side_streams[index] = torch.cuda.Stream(index)
    return _side_streams[index]


def record(run: Callable[[], None], pool, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """``run`` recorded into a new graph on ``stream``, its memory from the graph pool ``pool``.

    Not through ``torch.cuda.graph``, whose entry synchronizes the device and empties the caching allocators,
    device and pinned host, every time: per graph a wait for every stream's work and the next step of every
    co-resident model allocating its buffers afresh (cudaMalloc, cudaHostAlloc). Recording executes nothing,
    so work in flight on any stream, this one included, is no hazard to it.

    ``thread_local`` capture mode: only this thread's CUDA calls are checked against the capture. In the
    default ``global`` mode a call that may sync or allocate (cudaMalloc, an event query) from ANY thread
    during the capture fails and invalidates it, so every other thread would have to stop its CUDA work
    while a model loads: the threads that never take the step lock (another model's weights being read,
    a KV transfer) could not be stopped at all. Their work is safe to overlap: it goes to their own
    streams, not to the one recorded (torch's side streams do not synchronize with the legacy default
    stream). The one stream others also launch on is a worker's compute stream, the engine loop's: the
    capture holds the step lock (``capture_hold``), so no step launches onto it mid-capture."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            run()
        except BaseException:
            with contextlib.suppress(RuntimeError):  # the capture's own failure; ``run``'s is the one to tell
                graph.capture_end()
            raise
        graph.capture_end()
    return graph


class DecodeGraphs:
    """Static-buffer decode for one model and KV cache.

    ``record=False`` runs the very same static-buffer path (padding, buckets, shared logits buffer)
    without recording graphs: how the CPU tests exercise everything here except the replay itself.
    """

    def __init__(self, model: nn.Module, kv_cache: torch.Tensor, max_batch: int, max_model_len: int,
                 block_size: int, record: bool = True, short_context: int = SHORT_CONTEXT) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.device = kv_cache.device
        self.max_model_len = max_model_len
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.record = record
        self.layout = Layout(tokens=self.max_batch, seqs=self.max_batch,
                             width=math.ceil(max_model_len / block_size))
        self.buffer = torch.zeros(self.layout.size, dtype=torch.int32, device=self.device)
        o = self.layout
        self._sample_rows = self.buffer[o.sample_rows:o.sample_rows + self.max_batch]  # sliced per step
        vocab = model.vocab_size
        self.logits = torch.empty(self.max_batch, vocab, dtype=torch.float32, device=self.device)  # [B, V]
        # max_seq_len classes; the short one is only taken when every sequence fits it, which keeps the
        # torch reference decode (it reads max_seq_len columns of each table) exact as well
        self.len_classes = sorted({min(short_context, max_model_len), max_model_len})
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._metas = {(b, c): self._metadata(b, c) for b in self.sizes for c in self.len_classes}
        self.num_replays = 0  # decode steps served here (tests check the path is really taken)
        self.replays_by_len: Counter[int] = Counter()  # the same, per length class
        self.last_replayed: tuple[int, int] | None = None  # (bucket, length class) of the latest step

    def _metadata(self, batch: int, max_len: int) -> AttentionMetadata:
        t = views(self.buffer, self.layout, batch, batch, 0)
        return AttentionMetadata(
            slot_mapping=t.slot_mapping, query_start_loc=t.query_start_loc, seq_lens=t.seq_lens,
            block_tables=t.block_tables,
            # host copies are upper bounds, not this step's values: only prefill paths read them, and
            # a graph step is decode-only
            query_start_loc_cpu=list(range(batch + 1)), seq_lens_cpu=[max_len] * batch,
            max_query_len=1, max_seq_len=max_len,
        )

    def _forward(self, batch: int, max_len: int) -> None:
        meta = self._metas[batch, max_len]
        t = views(self.buffer, self.layout, batch, batch, 0)
        hidden = self.model(t.input_ids, t.positions, self.kv_cache, meta)  # [b, hidden]
        self.logits[:batch].copy_(self.model.compute_logits(hidden))

    def _write_idle_inputs(self) -> None:
        # capture-time inputs: every row a padding row, so warm-up and capture write no KV
        host = host_buffer(self.layout.size, self.device)
        idle = StepBatch([], [], [], [0], [], [], [])
        write(host.numpy(), self.layout, idle, padded_seqs=self.max_batch)
        self.buffer.copy_(host)

    @torch.inference_mode()
    def capture(self) -> bool:
        """Record every bucket, each graph under the load's hold on its own (``graphs_held``); False (and a
        warning) when the model's kernels cannot be captured. ``record=False`` walks the same sequence, each
        graph's forward run eagerly where it would be recorded."""
        hold = capture_hold()  # each graph's own hold, below
        self._write_idle_inputs()
        if not capturable(lambda: self._forward(self.max_batch, self.max_model_len), self.record,
                          "decode runs eagerly", " (the torch reference write_kv, for one)"):
            return False
        pool = torch.cuda.graph_pool_handle() if self.record else None
        stream = capture_stream(self.device) if self.record else None
        for batch in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
            for max_len in self.len_classes:
                def forward(batch=batch, max_len=max_len) -> None:
                    self._forward(batch, max_len)

                forward()  # compiles any Triton specialisation outside the capture, and outside the hold
                with hold:
                    if self.record:
                        self._graphs[batch, max_len] = record(forward, pool, stream)
                    else:
                        forward()
        if self.record:  # this thread's work alone: a device-wide sync would wait for the other models' steps too
            torch.cuda.current_stream(self.device).synchronize()
            log.info("captured %d decode CUDA graphs (batch sizes %s, max lengths %s)", len(self._graphs),
                     self.sizes, self.len_classes)
        return True

    def fits(self, batch: StepBatch) -> bool:
        return batch.num_tokens == batch.num_seqs and batch.num_seqs <= self.max_batch

    def run(self, batch: StepBatch, fill: tuple[torch.Tensor, torch.Tensor] | None = None
            ) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay for a decode batch; returns (logits [S, V] of its real rows, sample_rows [R] on the
        device). Both are views into shared buffers, valid until the next call. ``fill``: (rows, int32
        ids) on the device, written over those rows' input ids after the host's copy (async scheduling
        feeds the previous step's sampled ids this way, without the host reading them)."""
        n = batch.num_seqs
        bucket = bucket_for(self.sizes, n)
        if bucket is None or not self.fits(batch):
            raise ValueError(f"not a decode batch this runner can replay: {n} sequences, {batch.num_tokens} tokens")
        size = self.layout.size_through_row(bucket)
        host = host_buffer(size, self.device)
        write(host.numpy(), self.layout, batch, padded_seqs=bucket)
        self.buffer[:size].copy_(host, non_blocking=True)
        if fill is not None:
            self.buffer[self.layout.ids:self.layout.ids + n].index_copy_(0, fill[0], fill[1])
        longest = max(batch.seq_lens)
        max_len = next(c for c in self.len_classes if c >= longest)
        if self.record:
            self._graphs[bucket, max_len].replay()
        else:
            self._forward(bucket, max_len)
        self.num_replays += 1
        self.replays_by_len[max_len] += 1
        self.last_replayed = (bucket, max_len)
        return self.logits[:n], self._sample_rows[:len(batch.sample_rows)]

    def graph(self, batch: int, max_len: int) -> torch.cuda.CUDAGraph:
        """The recorded graph of a bucket and length class (benchmarks time bare replays with it)."""
        return self._graphs[batch, max_len]
