"""A growable KV range on a GPU through the CUDA driver's virtual memory management (ctypes on libcuda).

One ``cuMemAddressReserve`` takes the pool's whole address range once; nothing backs it yet. Committing a
chunk creates physical memory for it (``cuMemCreate``), maps it at the chunk's address (``cuMemMap``)
and makes it readable and writable from this device (``cuMemSetAccess``); decommitting unmaps and
releases it, so the driver has those bytes again for model weights (PyTorch's caching allocator gets them
through cudaMalloc). The range's address never changes, so the torch tensor over it (made through
``__cuda_array_interface__``), the pool's per-model views and CUDA graphs captured over them stay valid.
Touching an address whose chunk is not committed is an illegal memory access that kills the CUDA context:
the pool only hands out blocks of committed chunks, and keeps the chunks of block 0 (which padding rows
read, shared/engine/step_inputs.py) committed for good.

Chunks are multiples of the allocation granularity (2 MiB on current GPUs), as cuMemCreate and cuMemMap
require. A freshly committed chunk is zeroed: new device memory holds arbitrary bits, which may read as
NaN, and a masked position of a torch-reference attention multiplies its value by zero (NaN * 0 is NaN).
"""

import ctypes
import logging

import torch

log = logging.getLogger(__name__)

CUDA_SUCCESS = 0
CUDA_ERROR_OUT_OF_MEMORY = 2
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102


class VMMUnavailable(RuntimeError):
    pass


class _Location(ctypes.Structure):  # CUmemLocation
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", _AllocFlags)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class _Driver:
    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise VMMUnavailable(f"cannot open libcuda.so.1: {exc}") from exc
        u64, size_t = ctypes.c_uint64, ctypes.c_size_t
        p = ctypes.POINTER
        self._sig("cuInit", ctypes.c_uint)
        self._sig("cuDeviceGet", p(ctypes.c_int), ctypes.c_int)
        self._sig("cuDeviceGetAttribute", p(ctypes.c_int), ctypes.c_int, ctypes.c_int)
        self._sig("cuDevicePrimaryCtxRetain", p(ctypes.c_void_p), ctypes.c_int)
        self._sig("cuCtxSetCurrent", ctypes.c_void_p)
        self._sig("cuMemGetAllocationGranularity", p(size_t), p(_AllocationProp), ctypes.c_int)
        self._sig("cuMemAddressReserve", p(u64), size_t, size_t, u64, ctypes.c_ulonglong)
        self._sig("cuMemAddressFree", u64, size_t)
        self._sig("cuMemCreate", p(u64), size_t, p(_AllocationProp), ctypes.c_ulonglong)
        self._sig("cuMemMap", u64, size_t, size_t, u64, ctypes.c_ulonglong)
        self._sig("cuMemSetAccess", u64, size_t, p(_AccessDesc), size_t)
        self._sig("cuMemUnmap", u64, size_t)
        self._sig("cuMemRelease", u64)
        self._sig("cuGetErrorString", ctypes.c_int, p(ctypes.c_char_p))

    def _sig(self, name: str, *args) -> None:
        try:
            fn = getattr(self.lib, name)
        except AttributeError as exc:  # a driver older than CUDA 10.2
            raise VMMUnavailable(f"libcuda has no {name}") from exc
        fn.argtypes, fn.restype = list(args), ctypes.c_int

    def check(self, result: int, what: str) -> None:
        if result == CUDA_SUCCESS:
            return
        msg = ctypes.c_char_p()
        self.lib.cuGetErrorString(result, ctypes.byref(msg))
        text = f"{what} failed: CUDA error {result} ({(msg.value or b'?').decode()})"
        raise MemoryError(text) if result == CUDA_ERROR_OUT_OF_MEMORY else RuntimeError(text)


class _RangeInterface:
    """What torch.as_tensor needs to view the reserved range without copying it."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 2}


class CudaMemory:
    growable = True
    why_fixed = ""

    def __init__(self, nbytes: int, device: torch.device, chunk_bytes: int):
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())
        torch.cuda.init()  # the runtime creates (and retains) the primary context the driver calls below share
        d = self.driver = _Driver()
        d.check(d.lib.cuInit(0), "cuInit")
        dev = ctypes.c_int()
        d.check(d.lib.cuDeviceGet(ctypes.byref(dev), self.device.index), "cuDeviceGet")
        supported = ctypes.c_int()
        d.check(d.lib.cuDeviceGetAttribute(ctypes.byref(supported),
                                           CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev),
                "cuDeviceGetAttribute")
        if not supported.value:
            raise VMMUnavailable(f"{self.device} does not support virtual memory management")
        self._ctx = ctypes.c_void_p()
        d.check(d.lib.cuDevicePrimaryCtxRetain(ctypes.byref(self._ctx), dev), "cuDevicePrimaryCtxRetain")
        self._prop = _AllocationProp(type=CU_MEM_ALLOCATION_TYPE_PINNED,
                                     location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, self.device.index))
        self._access = _AccessDesc(location=_Location(CU_MEM_LOCATION_TYPE_DEVICE, self.device.index),
                                   flags=CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        gran = ctypes.c_size_t()
        d.check(d.lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self._prop),
                                                    CU_MEM_ALLOC_GRANULARITY_MINIMUM), "cuMemGetAllocationGranularity")
        self.granularity = gran.value
        self.chunk_bytes = -(-chunk_bytes // gran.value) * gran.value
        self.nbytes = -(-nbytes // self.chunk_bytes) * self.chunk_bytes  # address space is free: whole chunks
        self.base = ctypes.c_uint64()
        self._current()
        d.check(d.lib.cuMemAddressReserve(ctypes.byref(self.base), self.nbytes, 0, 0, 0), "cuMemAddressReserve")
        self._handles: dict[int, int] = {}  # offset -> the physical allocation mapped there
        # torch asks the driver which device a pointer is on, which an unmapped address cannot answer: the
        # first chunk is backed before the tensor exists (and stays: block 0 lives there)
        self._map(0, self.chunk_bytes)
        self.committed_from_start = self.chunk_bytes
        self._interface = _RangeInterface(self.base.value, self.nbytes)  # kept: the tensor's memory is ours
        self.tensor = torch.as_tensor(self._interface, device=self.device)
        self.tensor[:self.chunk_bytes].zero_()

    def _current(self) -> None:
        # driver calls act on the calling thread's current context: the loading thread and the loop both commit
        self.driver.check(self.driver.lib.cuCtxSetCurrent(self._ctx), "cuCtxSetCurrent")

    def commit(self, offset: int, size: int) -> None:
        self._map(offset, size)
        self.tensor[offset:offset + size].zero_()
        # done before any kernel can be issued over it, whichever stream the engine writes KV on
        torch.cuda.current_stream(self.device).synchronize()

    def _map(self, offset: int, size: int) -> None:
        d, ptr = self.driver, self.base.value + offset
        self._current()
        handle = ctypes.c_uint64()
        try:
            d.check(d.lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self._prop), 0), "cuMemCreate")
        except MemoryError:
            torch.cuda.empty_cache()  # an unloaded model's weights may still sit in PyTorch's cache: free them
            d.check(d.lib.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(self._prop), 0), "cuMemCreate")
        try:
            d.check(d.lib.cuMemMap(ptr, size, 0, handle.value, 0), "cuMemMap")
            try:
                d.check(d.lib.cuMemSetAccess(ptr, size, ctypes.byref(self._access), 1), "cuMemSetAccess")
            except BaseException:
                d.lib.cuMemUnmap(ptr, size)
                raise
        except BaseException:
            d.lib.cuMemRelease(handle.value)
            raise
        self._handles[offset] = handle.value

    def decommit(self, offset: int, size: int) -> None:
        torch.cuda.synchronize(self.device)  # no kernel still queued may read the chunk once it is unmapped
        d = self.driver
        self._current()
        d.check(d.lib.cuMemUnmap(self.base.value + offset, size), "cuMemUnmap")
        d.check(d.lib.cuMemRelease(self._handles.pop(offset)), "cuMemRelease")
