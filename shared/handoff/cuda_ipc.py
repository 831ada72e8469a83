"""Same-GPU KV handoff through CUDA IPC: the fast path when prefill and decode share a device.

Between two processes on one H200 a device copy into an IPC-mapped tensor runs at ~2,000 GB/s; ZMQ
frames over loopback TCP move ~4 GB/s. So when the decode worker and the asking prefill worker sit on
the same GPU (same device UUID), the decode worker shares its whole KV cache once per prefill worker
(``IpcExporter``), the grant carries that handle, the prefill worker maps it once and keeps the mapping
per decode worker (``IpcPeers``), and copies its blocks straight into the granted ones (``DeviceCopy``).
ZMQ carries only the control messages: grant, a header saying "written via IPC", ack.

Handles travel as the plain fields of torch's storage sharing (``_share_cuda_()`` out,
``_new_shared_cuda()`` in) inside our msgpack ``KVIpcHandle``, never through torch.multiprocessing's
pickling reducers; the opener checks dtype, shape, strides and extent against its own cache first.
One export per prefill worker because torch counts one consumer per ``_share_cuda_()`` call: that count
is what keeps the decode worker from reusing the memory while a peer still maps it.

Synchronisation: the copy is queued on a side stream after the prefill's compute stream (which wrote
the KV); the header goes out only once the copy's event has completed, and the decode worker reads the
blocks only after the header arrived. Any failure to map falls back to the host-staged frame path.
Trust: mapping lets a peer write the decode worker's cache, so it is only offered to a worker on the
same GPU, and the prefill side only ever writes blocks the grant named.
"""

import logging
import math
import re

import torch
from kvrelay.shared.handoff.frames import DTYPE_NAMES, side_stream, wide
from kvrelay.shared.wire.protocol import KVIpcHandle

log = logging.getLogger(__name__)

MAX_PEERS = 64  # exports per decode worker: one per prefill worker that ever asked
# torch names its ref-count file "/torch_<pid>_<n>_<n>" in /dev/shm: one flat shm name, nothing else
_REF_COUNTER_NAME = re.compile(rb"^/[A-Za-z0-9_.-]{1,200}$")
_RUNS_AS_SLICES = 8  # up to this many contiguous runs, plain strided copies beat a gather + scatter
_CHUNK_BYTES = 64 << 20  # bound on the gather's temporary when blocks are scattered


class IpcError(RuntimeError):
    pass


def device_uuid(device: torch.device | str) -> str:
    """The GPU's UUID (stable across processes, unlike an index under CUDA_VISIBLE_DEVICES); "" off CUDA."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return ""
    try:
        return str(torch.cuda.get_device_properties(device).uuid)
    except (AttributeError, RuntimeError):
        return ""


def export_handle(kv_cache: torch.Tensor) -> KVIpcHandle:
    """Share ``kv_cache`` (a CUDA tensor) for one consumer."""
    (_device, handle, size, offset, ref_counter, ref_offset, event_handle,
     event_sync) = kv_cache.untyped_storage()._share_cuda_()
    return KVIpcHandle(device_uuid=device_uuid(kv_cache.device), handle=bytes(handle), storage_size=int(size),
                       storage_offset=int(offset), ref_counter=bytes(ref_counter), ref_counter_offset=int(ref_offset),
                       event_handle=None if event_handle is None else bytes(event_handle),
                       event_sync_required=bool(event_sync), tensor_offset=kv_cache.storage_offset(),
                       shape=list(kv_cache.shape), stride=list(kv_cache.stride()),
                       dtype=DTYPE_NAMES[kv_cache.dtype])


def check_handle(h: KVIpcHandle, like: torch.Tensor) -> None:
    """Raise IpcError unless ``h`` is a KV cache of ``like``'s layout (any block count) on its GPU."""
    if not like.is_cuda or h.device_uuid != device_uuid(like.device):
        raise IpcError(f"KV cache is on GPU {h.device_uuid!r}, not this worker's")
    if h.dtype != DTYPE_NAMES[like.dtype]:
        raise IpcError(f"peer KV dtype {h.dtype} != {DTYPE_NAMES[like.dtype]}")
    if h.shape[:2] != list(like.shape[:2]) or h.shape[3:] != list(like.shape[3:]):
        raise IpcError(f"peer KV shape {h.shape} does not match {list(like.shape)} outside the block dimension")
    if h.stride not in (kv_strides(h.shape, block_major=False), kv_strides(h.shape, block_major=True)):
        raise IpcError(f"peer KV strides {h.stride} are neither layer- nor block-major for shape {h.shape}")
    if (h.tensor_offset + math.prod(h.shape)) * like.element_size() > h.storage_size:
        raise IpcError("peer KV tensor extends past its shared storage")
    if not _REF_COUNTER_NAME.match(h.ref_counter):
        raise IpcError("peer ref-counter name is not a plain shared-memory name")
    if h.event_handle is not None and len(h.event_handle) != 64:  # CUDA_IPC_HANDLE_SIZE
        raise IpcError("peer event handle has the wrong size")


def kv_strides(shape: list[int], block_major: bool) -> list[int]:
    """Strides of a dense ``[L, 2, N, bs, Hkv, D]`` cache: layer-major (a plain tensor) or block-major
    (a view of a KV pool, shared/engine/kv_pool.py: ``[N, L, 2, ...]`` in memory)."""
    order = [2, 0, 1, 3, 4, 5] if block_major else list(range(6))  # dims from outermost to innermost
    strides = [0] * 6
    step = 1
    for d in reversed(order):
        strides[d] = step
        step *= shape[d]
    return strides


def open_handle(h: KVIpcHandle, like: torch.Tensor) -> torch.Tensor:
    """Map a peer's KV cache on ``like``'s device, after ``check_handle``."""
    check_handle(h, like)
    try:
        # our device index, not the exporter's: indices differ under different CUDA_VISIBLE_DEVICES
        storage = torch.UntypedStorage._new_shared_cuda(
            like.get_device(), h.handle, h.storage_size, h.storage_offset, h.ref_counter, h.ref_counter_offset,
            h.event_handle, h.event_sync_required)
        mapped = torch.empty((0,), dtype=like.dtype, device=like.device)
        return mapped.set_(storage, h.tensor_offset, h.shape, h.stride)
    except (RuntimeError, TypeError) as exc:
        raise IpcError(f"could not map the peer's KV cache: {exc}") from exc


class IpcExporter:
    """Decode side: the handle to put in a grant, if the asker can use one."""

    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache = kv_cache
        self.uuid = device_uuid(kv_cache.device)
        self.handles: dict[str, KVIpcHandle] = {}
        self.broken = False

    def offer(self, requester: str, asker_uuid: str) -> KVIpcHandle | None:
        if self.broken or not self.uuid or asker_uuid != self.uuid or not requester:
            return None
        h = self.handles.get(requester)
        if h is None:
            if len(self.handles) >= MAX_PEERS:
                return None
            try:
                h = self.handles[requester] = export_handle(self.kv_cache)
            except (RuntimeError, AttributeError) as exc:  # e.g. an allocator without IPC support
                log.warning("CUDA IPC export failed, using frames from now on: %s", exc)
                self.broken = True
                return None
        return h


class IpcPeers:
    """Prefill side: one mapping per decode worker, opened on first use and kept."""

    def __init__(self, kv_cache: torch.Tensor):
        self.kv_cache = kv_cache
        self.uuid = device_uuid(kv_cache.device)
        self.mapped: dict[str, tuple[bytes, torch.Tensor]] = {}
        # handles that failed to map, or that we unmapped: torch's count allows one open per export
        self.spent: set[bytes] = set()

    def open(self, peer: str, h: KVIpcHandle) -> torch.Tensor:
        key = h.handle + h.ref_counter + h.ref_counter_offset.to_bytes(8, "little")
        entry = self.mapped.get(peer)
        if entry is not None and entry[0] == key:
            return entry[1]
        if key in self.spent:
            raise IpcError("this handle failed to map before, or was already unmapped")
        if entry is not None:  # a new export (the peer restarted or re-shared): drop the old view
            self.spent.add(self.mapped.pop(peer)[0])
        try:
            tensor = open_handle(h, self.kv_cache)
        except IpcError:
            self.spent.add(key)
            raise
        self.mapped[peer] = (key, tensor)
        log.info("mapped the KV cache of %s through CUDA IPC (%s blocks)", peer, h.shape[2])
        return tensor

    def retain(self, live_peers: set[str]) -> None:
        """Unmap the caches of decode workers that are gone."""
        for peer in [p for p in self.mapped if p not in live_peers]:
            self.spent.add(self.mapped.pop(peer)[0])


class DeviceCopy:
    """Prefill side: one transfer's blocks copied into a mapped peer cache on the side stream, all
    layers at once, or with ``deferred`` layer range by layer range as ``stage_through(layer)`` says
    the prefill has written them (each range's copy waits for the compute stream as of that call)."""

    def __init__(self, src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                 deferred: bool = False):
        if len(src_blocks) != len(dst_blocks):
            raise IpcError(f"{len(src_blocks)} source blocks for {len(dst_blocks)} destination blocks")
        if any(not 0 <= b < dst.shape[2] for b in dst_blocks):
            raise IpcError("destination block id out of the peer's range")
        self.src, self.src_blocks, self.dst, self.dst_blocks = src, src_blocks, dst, dst_blocks
        self.nbytes = src[:, :, :1].numel() * src.element_size() * len(src_blocks)
        self.num_layers = src.shape[0]
        self.copied = 0  # layers queued so far
        self.event = None
        if not deferred:
            self.stage_through(self.num_layers - 1)

    def stage_through(self, layer: int) -> None:
        if layer < self.copied:
            return
        stream = side_stream(self.src.device)
        stream.wait_stream(torch.cuda.current_stream(self.src.device))  # the compute stream wrote this KV
        with torch.cuda.stream(stream):
            copy_blocks(self.src, self.src_blocks, self.dst, self.dst_blocks, range(self.copied, layer + 1))
            self.event = torch.cuda.Event()
            self.event.record(stream)
        self.copied = layer + 1

    def done(self) -> bool:
        """Every layer copied (the side stream runs in order, so the last event covers them all)."""
        return self.copied == self.num_layers and self.event.query()

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()


def copy_blocks(src: torch.Tensor, src_blocks: list[int], dst: torch.Tensor, dst_blocks: list[int],
                layers: range | None = None) -> None:
    """``dst[layers][:, dst_blocks] = src[layers][:, src_blocks]`` on the current stream (all layers by
    default)."""
    layers = range(src.shape[0]) if layers is None else layers
    src, dst = wide(src), wide(dst)
    runs = block_runs(src_blocks, dst_blocks)
    if len(runs) <= _RUNS_AS_SLICES:
        for s, d, n in runs:
            dst[layers.start:layers.stop, :, d:d + n].copy_(src[layers.start:layers.stop, :, s:s + n],
                                                            non_blocking=True)
        return
    # scattered blocks: a row gather + scatter over the caches' memory viewed as rows of one (layer, K/V,
    # block) each, the access pattern torch's index kernels do best (whole contiguous rows), a few
    # layers at a time so the temporary stays small
    src_rows, dst_rows = _as_rows(src), _as_rows(dst)
    planes = range(layers.start * src.shape[1], layers.stop * src.shape[1])
    step = max(1, _CHUNK_BYTES // (len(src_blocks) * src[0, 0, 0].numel() * src.element_size()))
    for p0 in range(planes.start, planes.stop, step):
        p = range(p0, min(p0 + step, planes.stop))
        si = _rows(src, src_blocks, p).to(src.device, non_blocking=True)
        di = _rows(dst, dst_blocks, p).to(dst.device, non_blocking=True)
        dst_rows.index_copy_(0, di, src_rows.index_select(0, si))


def _as_rows(kv: torch.Tensor) -> torch.Tensor:
    """A dense cache of either layout (``kv_strides``) as its memory's rows: ``[L * 2 * N, row]``."""
    row = kv[0, 0, 0].numel()
    return kv.as_strided((kv.numel() // row, row), (row, 1))


def _rows(kv: torch.Tensor, blocks: list[int], planes: range) -> torch.Tensor:
    """Row ids (in ``_as_rows``) of ``blocks`` in each (layer, K/V) plane, whichever the cache's layout."""
    row = kv[0, 0, 0].numel()
    plane = torch.tensor([(p // kv.shape[1]) * kv.stride(0) + (p % kv.shape[1]) * kv.stride(1) for p in planes])
    return ((plane[:, None] + torch.tensor(blocks)[None, :] * kv.stride(2)) // row).reshape(-1)


def block_runs(src_blocks: list[int], dst_blocks: list[int]) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the maximal runs where both sides are consecutive."""
    runs: list[tuple[int, int, int]] = []
    for s, d in zip(src_blocks, dst_blocks, strict=True):
        if runs and runs[-1][0] + runs[-1][2] == s and runs[-1][1] + runs[-1][2] == d:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((s, d, 1))
    return runs
