"""CUDA IPC: how a prefill worker reaches the KV cache of a decode worker on its own GPU, for direct
writes (direct.py): the fast path when prefill and decode share a device.

Between two processes on one H200 a device copy into an IPC-mapped tensor runs at ~2,000 GB/s; ZMQ
frames over loopback TCP move ~4 GB/s. Handles travel as the plain fields of torch's storage sharing
(``_share_cuda_()`` out, ``_new_shared_cuda()`` in) inside our msgpack ``KVIpcHandle``, never through
torch.multiprocessing's pickling reducers; the opener checks the device, the layout and the
reference-count name against its own cache first. Devices are named by UUID, which holds across
processes whatever their CUDA_VISIBLE_DEVICES.
"""

import re

import torch

from kvrelay.shared.handoff.blocks import DTYPE_NAMES
from kvrelay.shared.handoff.direct import DirectWrite, IpcError, Sharing, check_handle_layout
from kvrelay.shared.wire.handoff import KVIpcHandle

# torch names its ref-count file "/torch_<pid>_<n>_<n>" in /dev/shm: one flat shm name, nothing else
_REF_COUNTER_NAME = re.compile(rb"^/[A-Za-z0-9_.-]{1,200}$")


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
    check_handle_layout(h, like)
    if not _REF_COUNTER_NAME.match(h.ref_counter):
        raise IpcError("peer ref-counter name is not a plain shared-memory name")
    if h.event_handle is not None and len(h.event_handle) != 64:  # CUDA_IPC_HANDLE_SIZE
        raise IpcError("peer event handle has the wrong size")


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


class CudaIpc(Sharing):
    def locality(self, kv_cache: torch.Tensor) -> str:
        return device_uuid(kv_cache.device)

    def export(self, kv_cache: torch.Tensor) -> KVIpcHandle:
        return export_handle(kv_cache)

    def open(self, h: KVIpcHandle, like: torch.Tensor) -> torch.Tensor:
        return open_handle(h, like)


def cuda_ipc() -> DirectWrite:
    return DirectWrite(CudaIpc())
