"""Moving paged KV blocks between two caches through host memory: the portable handoff path.

A layer's bytes are its blocks, ``kv_cache[layer][:, block_ids]`` made contiguous:
``[2, n_blocks, block_size, Hkv, D]``. Two wire forms, validated alike (layout, dtype, layer count and
sizes, CRC32, destination block range) before a byte lands in the receiver's cache:

- "layers", what the prefill worker sends: a KVHeader, then KVLayers messages, each one frame of a few
  consecutive layers (~4 MB) with a CRC per layer, sent as soon as it is staged. Staging (device
  gather + copy into pinned host memory), the CRC, the wire and the receiver's CRC + write of earlier
  layers then overlap instead of running back to back.
- "frames": header and every frame in one multipart message (``pack_blocks``/``check_frames``/
  ``unpack_blocks``), the original form; still accepted.

Frames reach ZMQ zero-copy (memoryviews over the staging buffer); the receiver is bounded by ZMQ's
MAXMSGSIZE (``max_message_bytes``). Gathers, CRCs and writes run on a small thread pool (numpy, torch
and zlib release the GIL), so a 268 MB transfer does not stall either worker's main loop; the main
loops only hand messages to and from the sockets.
"""

import os
import warnings
import zlib
from concurrent.futures import Future, ThreadPoolExecutor, wait

import numpy as np
import torch
from kvrelay.shared.wire.protocol import KVHeader, KVLayers, kv_checksum

DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}
# enough threads to keep CRC (~3.5 GB/s per core) off the critical path, few enough to leave the
# engine's own threads alone
_POOL = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1), thread_name_prefix="kv-transfer")
MESSAGE_TARGET = 4 << 20  # bytes of KV per "layers" message (whole layers)
# below this a transfer is staged / checked and written on the calling thread: a pool round trip
# (two thread wake-ups) costs more than the ~0.3 ms of work, and there is nothing to overlap
INLINE_BYTES = 1 << 20
_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


class Waker:
    """Lets pool threads wake a main loop blocked in ``zmq.Poller.poll``: a pipe whose read end it polls,
    so a staged layer or a finished write is acted on at once rather than at the next poll timeout."""

    def __init__(self):
        self.fd, self._w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._w, False)

    def wake(self, *_args) -> None:
        try:
            os.write(self._w, b"\0")
        except (BlockingIOError, OSError):  # full: a wake-up is already pending; closed: shutting down
            pass

    def drain(self) -> None:
        try:
            while os.read(self.fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        os.close(self.fd)
        os.close(self._w)


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """One copy stream per device, so handoff copies never queue behind (or block) engine kernels."""
    device = torch.device(device)
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def layout_of(kv_cache: torch.Tensor) -> dict:
    # kv_cache: [L, 2, N, bs, Hkv, D]
    num_layers, _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return dict(num_layers=num_layers, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                dtype=DTYPE_NAMES[kv_cache.dtype])


def frame_nbytes(kv_cache: torch.Tensor, num_blocks: int) -> int:
    _, two, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return two * num_blocks * block_size * num_kv_heads * head_dim * kv_cache.element_size()


def max_message_bytes(kv_cache: torch.Tensor, max_blocks: int) -> int:
    """The receive bound (ZMQ MAXMSGSIZE, which applies per frame) for KV from a peer with this layout
    and prompts of up to ``max_blocks`` blocks: a "layers" frame is whole layers of up to MESSAGE_TARGET
    bytes, or one layer when a layer alone is bigger; a "frames" frame is one layer. Control messages
    fit the extra MiB. A peer sending more is disconnected by ZMQ before anything is buffered."""
    return max(MESSAGE_TARGET, frame_nbytes(kv_cache, max_blocks)) + (1 << 20)


def check_layout(kv_cache: torch.Tensor, header: KVHeader) -> None:
    """Raise ValueError unless ``header`` describes this cache's layout and blocks that exist here."""
    mine = layout_of(kv_cache)
    theirs = dict(num_layers=header.num_layers, block_size=header.block_size, num_kv_heads=header.num_kv_heads,
                  head_dim=header.head_dim, dtype=header.dtype)
    if mine != theirs:
        diff = {k: (theirs[k], mine[k]) for k in mine if mine[k] != theirs[k]}
        raise ValueError(f"KV layout mismatch (sent, expected): {diff}")
    if any(not 0 <= b < kv_cache.shape[2] for b in header.block_ids):
        raise ValueError("KV destination block id out of range")
    if header.nbytes != header.num_layers * frame_nbytes(kv_cache, header.num_blocks):
        raise ValueError(f"KV header promises {header.nbytes} bytes, {header.num_blocks} blocks are "
                         f"{header.num_layers * frame_nbytes(kv_cache, header.num_blocks)}")
    if header.transport != "ipc" and header.num_frames != header.num_layers:
        raise ValueError(f"expected {header.num_layers} frames, header says {header.num_frames}")


def gather_blocks(kv_cache: torch.Tensor, layers: range, index: torch.Tensor,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """``kv_cache[layers][:, :, index]`` -> ``[len(layers), 2, n, bs, Hkv, D]``, into ``out`` if given, in
    one call per group of layers: per-call overhead, not bytes, dominated layer-at-a-time copies. On
    CPU through numpy: single-threaded and free of the GIL, where torch's index ops fan out to OpenMP
    and were measured stalling ~30 ms a call when the cores are busy."""
    src = kv_cache[layers.start:layers.stop]
    if out is None:
        out = src.new_empty(src.shape[:2] + (len(index),) + src.shape[3:])
    if src.is_cuda:
        torch.index_select(wide(src), 2, index, out=wide(out))
        return out
    # fancy indexing, not np.take: take first makes a C-contiguous copy of a strided source, which for
    # a pooled (block-major) cache is the whole pool on every transfer
    _rows(out)[...] = _rows(src)[:, :, index.numpy()]
    return out


def scatter_blocks(kv_cache: torch.Tensor, first: int, index: torch.Tensor, blocks: torch.Tensor) -> None:
    """``kv_cache[first:first + len(blocks)][:, :, index] = blocks`` (numpy on CPU, as ``gather_blocks``)."""
    dst = kv_cache[first:first + blocks.shape[0]]
    if dst.is_cuda:
        wide(dst).index_copy_(2, index, wide(blocks))
        return
    _rows(dst)[:, :, index.numpy()] = _rows(blocks)


def wide(t: torch.Tensor) -> torch.Tensor:
    """The same bytes as 8-byte elements where the last dimension allows: strided copies and index
    kernels cost per element, so bf16 moved as int64 is 4x fewer elements for the same bytes."""
    if t.element_size() < 8 and t.shape[-1] * t.element_size() % 8 == 0 and t.stride(-1) == 1:
        return t.view(torch.int64)
    return t


def _rows(t: torch.Tensor) -> np.ndarray:
    """A CPU ``[layers, 2, n, ...]`` tensor as uint8 block rows: ``[layers, 2, n, block bytes]``. Each
    block is contiguous, its blocks need not be (a pooled cache is block-major, shared/engine/kv_pool.py);
    copy=False: scatter writes through this view, so a silent copy would lose them."""
    return t.view(torch.uint8).numpy().reshape(t.shape[0], t.shape[1], t.shape[2], -1, copy=False)


def _as_bytes(frame: torch.Tensor) -> memoryview:
    return memoryview(frame.view(torch.uint8).reshape(-1).numpy())


def _frame_tensor(kv_cache: torch.Tensor, num_blocks: int, frame, num_layers: int = 1) -> torch.Tensor:
    """``frame`` as ``[num_layers, 2, num_blocks, bs, Hkv, D]`` of the cache's dtype, without a copy."""
    with warnings.catch_warnings():  # read-only receive buffers: we only ever read from them
        warnings.simplefilter("ignore", UserWarning)
        data = torch.frombuffer(memoryview(frame), dtype=torch.uint8)
    return data.view(kv_cache.dtype).view((num_layers, 2, num_blocks) + tuple(kv_cache.shape[3:]))


# -- "frames": everything in one message --------------------------------------------------------------
def pack_blocks(kv_cache: torch.Tensor, block_ids: list[int]) -> list[memoryview]:
    """Copy the blocks out (host memory), one frame per layer; the caller may free the blocks after."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    return [_as_bytes(gather_blocks(kv_cache, range(layer, layer + 1), index).to("cpu"))
            for layer in range(kv_cache.shape[0])]


def check_frames(kv_cache: torch.Tensor, header: KVHeader, frames: list) -> None:
    """Raise ValueError unless ``frames`` are exactly what ``header`` promised and fit this cache."""
    check_layout(kv_cache, header)
    if len(frames) != header.num_frames:
        raise ValueError(f"expected {header.num_frames} frames, got {len(frames)}")
    size = frame_nbytes(kv_cache, header.num_blocks)
    sizes = [memoryview(f).nbytes for f in frames]
    if any(s != size for s in sizes):
        raise ValueError(f"KV frame sizes {sizes[:3]}... do not match {size} bytes per layer")
    if kv_checksum(frames) != header.checksum:
        raise ValueError("KV checksum mismatch")


def unpack_blocks(kv_cache: torch.Tensor, block_ids: list[int], frames: list) -> None:
    """Write checked frames into ``block_ids`` of this cache."""
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
    for layer, frame in enumerate(frames):
        scatter_blocks(kv_cache, layer, index, _frame_tensor(kv_cache, len(block_ids), frame).to(kv_cache.device))


# -- "layers": sender ---------------------------------------------------------------------------------
def layers_per_message(num_layers: int, layer_nbytes: int) -> int:
    """Consecutive layers sent in one message: whole layers of ~MESSAGE_TARGET bytes. Per-message costs
    (a send, a receive, a decode, a pool task, a wake-up) would swamp small transfers one layer at a time;
    big ones still go out in pieces that overlap with staging and writing."""
    return max(1, min(num_layers, MESSAGE_TARGET // max(layer_nbytes, 1)))


class StagedKV:
    """One transfer's layers staged out of the sender's cache into host memory, in the background, in
    groups of ``layers_per_message`` (group ``g`` = layers ``g * per .. g * per + per - 1``).

    On CUDA a group's gather and device-to-host copy is queued on the side stream (after the compute
    stream, which wrote the KV), into one pinned buffer, with an event per group; pool threads wait for
    a group's event and CRC its layers. On CPU the pool threads gather and CRC.
    All groups are staged at once, or with ``deferred`` group by group as ``stage_through(layer)`` says
    the prefill has written that layer (the layer-by-layer overlap with the prompt's last chunk).
    Group ``g`` can be sent once ``ready(g)``; the source blocks may be reused once ``source_free()``."""

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], on_ready=None, deferred: bool = False):
        self.kv_cache = kv_cache
        self.num_layers = kv_cache.shape[0]
        self.layer_nbytes = frame_nbytes(kv_cache, len(block_ids))
        self.per_message = layers_per_message(self.num_layers, self.layer_nbytes)
        self.groups = [range(g, min(g + self.per_message, self.num_layers))
                       for g in range(0, self.num_layers, self.per_message)]
        self.inline = self.layer_nbytes * self.num_layers <= INLINE_BYTES
        self.on_ready = on_ready
        self._events: list = []
        self._futures: list[Future] = []  # one per staged group, in order
        self._host = None
        if kv_cache.is_cuda:
            self._host = torch.empty((self.num_layers, 2, len(block_ids)) + tuple(kv_cache.shape[3:]),
                                     dtype=kv_cache.dtype, pin_memory=True)
            with torch.cuda.stream(side_stream(kv_cache.device)):
                self.index = torch.tensor(block_ids, dtype=torch.long).to(kv_cache.device, non_blocking=True)
        else:
            self.index = torch.tensor(block_ids, dtype=torch.long)
        if not deferred:
            self.stage_through(self.num_layers - 1)

    def stage_through(self, layer: int) -> None:
        """Stage every group whose layers are all at or below ``layer`` (written by the compute stream
        as of now)."""
        while len(self._futures) < len(self.groups) and self.groups[len(self._futures)].stop - 1 <= layer:
            g = self.groups[len(self._futures)]
            if self._host is not None:
                stream = side_stream(self.kv_cache.device)
                stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
                with torch.cuda.stream(stream):
                    self._host[g.start:g.stop].copy_(gather_blocks(self.kv_cache, g, self.index), non_blocking=True)
                    self._events.append(torch.cuda.Event())
                    self._events[-1].record(stream)
                future = _submit(self.inline, _crc_after, self._host[g.start:g.stop], self._events[-1])
            else:
                future = _submit(self.inline, _gather_crc, self.kv_cache, self.index, g)
            self._futures.append(future)
            if self.on_ready is not None:
                future.add_done_callback(self.on_ready)

    @property
    def num_messages(self) -> int:
        return len(self.groups)

    def ready(self, group: int) -> bool:
        return group < len(self._futures) and self._futures[group].done()

    def result(self, group: int) -> tuple[memoryview, list[int]]:
        """(frame, CRC32 of each layer in it) of a staged group of layers; blocks until it is staged."""
        return self._futures[group].result()

    def source_free(self) -> bool:
        if len(self._futures) < len(self.groups):
            return False
        if self._events:
            return all(ev.query() for ev in self._events)
        return all(f.done() for f in self._futures)

    def wait_source(self) -> None:
        """Block until nothing reads the source blocks any more (before freeing them on a failure);
        groups never staged never read them."""
        for ev in self._events:
            ev.synchronize()
        wait(self._futures)


def _submit(inline: bool, fn, *args) -> Future:
    if not inline:
        return _POOL.submit(fn, *args)
    future: Future = Future()
    try:
        future.set_result(fn(*args))
    except Exception as exc:  # delivered through the future, exactly as from the pool
        future.set_exception(exc)
    return future


def _crc_after(layers: torch.Tensor, event) -> tuple[memoryview, list[int]]:
    event.synchronize()
    return _crcs(_as_bytes(layers), len(layers))


def _gather_crc(kv_cache: torch.Tensor, index: torch.Tensor, layers: range) -> tuple[memoryview, list[int]]:
    return _crcs(_as_bytes(gather_blocks(kv_cache, layers, index)), len(layers))


def _crcs(frame: memoryview, num_layers: int) -> tuple[memoryview, list[int]]:
    size = frame.nbytes // num_layers
    return frame, [zlib.crc32(frame[i * size:(i + 1) * size]) for i in range(num_layers)]


# -- "layers": receiver -------------------------------------------------------------------------------
class LayerAssembler:
    """One incoming "layers" transfer: each KVLayers message's frames are counted and sized on arrival,
    then CRC-checked and written into the granted blocks by a pool thread. Only granted blocks are
    written, and nobody reads them before ``finish()``, so a transfer that fails half-way harms nothing
    once ``abandon()`` has waited out its writes and the blocks are freed."""

    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], on_done=None):
        """Layers may come before the header (streamed while the sender's prefill runs), so the layout is
        this cache's; the header, whenever it comes, must match it (``check_layout``)."""
        self.kv_cache = kv_cache
        self.num_layers = kv_cache.shape[0]
        self.num_blocks = len(block_ids)
        self.layer_nbytes = frame_nbytes(kv_cache, len(block_ids))
        self.stream = side_stream(kv_cache.device) if kv_cache.is_cuda else None
        self.index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        self.futures: list[Future] = []
        self.arrived = 0  # layers
        self.on_done = on_done

    def add(self, msg: KVLayers, frames: list) -> None:
        count = len(msg.checksums)
        if msg.first != self.arrived or self.arrived + count > self.num_layers:
            raise ValueError(f"KV layers {msg.first}..{msg.first + count - 1} arrived where layer {self.arrived} "
                             f"of {self.num_layers} was due")
        if len(frames) != 1:
            raise ValueError(f"a KV layers message has {len(frames)} frames, not 1")
        size = memoryview(frames[0]).nbytes
        if msg.nbytes != self.layer_nbytes or size != count * self.layer_nbytes:
            raise ValueError(f"KV layers frame of {size} bytes for {count} layers of {msg.nbytes}, expected "
                             f"{count} x {self.layer_nbytes}")
        inline = self.layer_nbytes * self.num_layers <= INLINE_BYTES
        self.futures.append(_submit(inline, self._check_and_write, msg.first, msg.checksums, frames[0]))
        self.arrived += count
        if self.on_done is not None:
            self.futures[-1].add_done_callback(self.on_done)

    def _check_and_write(self, first: int, checksums: list[int], frame) -> None:
        data, size = memoryview(frame), self.layer_nbytes
        for i, checksum in enumerate(checksums):
            if zlib.crc32(data[i * size:(i + 1) * size]) != checksum:
                raise ValueError(f"KV checksum mismatch in layer {first + i}")
        layers = _frame_tensor(self.kv_cache, self.num_blocks, data, len(checksums))
        if self.stream is None:
            scatter_blocks(self.kv_cache, first, self.index, layers)
            return
        with torch.cuda.stream(self.stream):
            scatter_blocks(self.kv_cache, first, self.index, layers.to(self.kv_cache.device))

    def error(self) -> Exception | None:
        """The first failure among the layers processed so far."""
        for f in self.futures:
            if f.done() and f.exception() is not None:
                return f.exception()
        return None

    @property
    def complete(self) -> bool:
        return self.arrived == self.num_layers and all(f.done() for f in self.futures)

    def finish(self) -> None:
        """Call once complete and error-free: every write has landed before anyone reads the blocks."""
        if self.stream is not None:
            self.stream.synchronize()

    def abandon(self) -> None:
        """Wait for in-flight writes so the blocks can be freed safely."""
        wait(self.futures)
        if self.stream is not None:
            self.stream.synchronize()
