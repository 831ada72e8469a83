"""The in-process fake of CUDA IPC (as SGLang keeps ``fake/conn.py`` for its tests): a decode side
and a prefill side in one process share KV caches through a process-local table instead of the CUDA
driver, on any device. Everything else about direct writes (offers, mappings per peer, layout checks,
streamed copies, the fallback to frames, the decode side's quarantine) runs unchanged, so CPU tests
cover it. Never in a worker: two processes never match (the locality names the process).
"""

import os
import secrets
import weakref

import torch

from kvrelay.shared.handoff.blocks import DTYPE_NAMES
from kvrelay.shared.handoff.direct import DirectWrite, IpcError, Sharing
from kvrelay.shared.wire.handoff import KVIpcHandle

_SHARED: "weakref.WeakValueDictionary[bytes, torch.Tensor]" = weakref.WeakValueDictionary()


class InProcess(Sharing):
    def locality(self, kv_cache: torch.Tensor) -> str:
        return f"inproc-{os.getpid()}"

    def export(self, kv_cache: torch.Tensor) -> KVIpcHandle:
        key = secrets.token_bytes(16)
        _SHARED[key] = kv_cache
        return KVIpcHandle(device_uuid=self.locality(kv_cache), handle=key,
                           storage_size=kv_cache.untyped_storage().nbytes(), storage_offset=0,
                           ref_counter=b"/inproc", ref_counter_offset=0, event_handle=None, event_sync_required=False,
                           tensor_offset=kv_cache.storage_offset(), shape=list(kv_cache.shape),
                           stride=list(kv_cache.stride()), dtype=DTYPE_NAMES[kv_cache.dtype])

    def open(self, h: KVIpcHandle, like: torch.Tensor) -> torch.Tensor:
        if h.device_uuid != self.locality(like):
            raise IpcError(f"KV cache is in {h.device_uuid!r}, not this process")
        cache = _SHARED.get(h.handle)
        if cache is None or cache.device != like.device:
            raise IpcError("no KV cache of this device is shared under that handle")
        return cache


def in_process() -> DirectWrite:
    return DirectWrite(InProcess())
