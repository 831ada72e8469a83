"""One copy of a model's weights per device, shared by every worker process on it that hosts the model.

The first worker process on a device to load a model version EXPORTS its weights: it loads them into one
arena (shared/engine/weight_arena.py) that lives in shared memory, and records it in the host's registry
(weight_registry.py). Every other worker process on that device loading the same version MAPS the arena
read-only instead of loading a copy (``--no-share-weights`` turns this off for a worker).

Design decisions:
* Key: the model's files (resolved path plus each file's size and mtime, so a folder rewritten in place
  is a new model), or for dummy weights the preset and seed; the dtype; and the device, a GPU named by
  its UUID (indices differ under different CUDA_VISIBLE_DEVICES). Versions in the repository never
  change, so equal keys mean equal bytes; the importer also checks the arena's layout digest.
* CPU: the arena is a file in the shared-weights directory (default /dev/shm/kvrelay-weights-<uid>),
  reserved with posix_fallocate (a full /dev/shm fails the export at once, not with SIGBUS later) and
  mapped MAP_SHARED; importers map it PROT_READ, so no process can change another's weights.
  No pickle: the registry is JSON, tensors are views over the mapping.
* CUDA: the arena is one device allocation, exported as torch's ``_share_cuda_()`` fields (one IPC handle
  for the whole model) and opened with ``UntypedStorage._new_shared_cuda``, as our KV handoff does
  (shared/handoff/cuda_ipc.py).
* Lifetime: a model stays while any process maps it. Each process's unload removes it from the users;
  the last one's removal unlinks the segment (CPU) or frees the allocation (CUDA: the exporting process
  keeps its tensor while the registry lists any user, even after unloading the model itself, and uses it
  directly if it loads the model again, since a process cannot open its own IPC handle).
* Crashes (``kill -9``): liveness is the kernel's (pid and start time, weight_registry.py); every registry
  access drops the dead. CPU: the segment file outlives its exporter, the survivors keep serving from
  their mapping, and the last live user (or, after every user crashed, the next access) unlinks it.
  CUDA: device memory dies with the process that allocated it, so an importer whose exporter died cannot
  keep serving from it; ``lost()`` names such models and the worker exits for its supervisor to restart
  it (a restart reloads: the first process back exports anew, the next maps that). An in-place reload
  would invalidate the addresses baked into CUDA graphs, so a restart is the one correct recovery.
* Accounting: placement, ``--weights-memory`` and eviction count a shared model once per device. A
  worker's ``weights_used`` is what the registry says this device's shared models take (every model once,
  whichever process loaded it) plus its own unshared ones, so ``--weights-memory`` is the device's budget
  for the workers that share it; a load of a model already on the device costs nothing. Evicting a
  shared model counts its bytes as freed: the memory goes once its other users evict it too, which is
  what placement asks of the other role (``prefer_evict``); until then the device may hold one model
  more than the budget. Workers started with ``--no-share-weights`` are not in the registry and count
  only their own models, as before.
* Anything that keeps sharing from working (a layout mismatch, a full /dev/shm, an export that does not
  finish in time) loads a private copy and says so in the log: sharing never fails a load.
"""

import contextlib
import hashlib
import logging
import mmap
import os
import time
import warnings
from itertools import count
from pathlib import Path

import torch

from kvrelay.shared.config.engine import EngineConfig
from kvrelay.shared.engine.loader import load_model
from kvrelay.shared.worker.weight_registry import Entry, Proc, WeightRegistry, default_dir

log = logging.getLogger(__name__)

EXPORT_WAIT_S = 600.0  # how long an importer waits for another process's export before loading its own
_POLL_S = 0.1
_segments = count()


def device_name(device: str | torch.device) -> str:
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return f"cuda:{torch.cuda.get_device_properties(index).uuid}"


def share_key(engine: EngineConfig, device: str) -> str:
    m = engine.model
    dtype = m.torch_dtype(torch.device(engine.device).type)
    if m.model.startswith("dummy:") or m.load_format == "dummy":
        source = f"dummy|{m.model}|seed={m.seed}"
    else:
        path = Path(m.model).resolve()
        files = sorted(path.iterdir()) if path.is_dir() else [path]
        stats = [(f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.is_file()]
        source = f"{path}|{stats}"
    # quantized and full-precision loads of one checkpoint are different weights
    return hashlib.sha256(f"{source}|{dtype}|{m.quantization}|{device}".encode()).hexdigest()[:40]


class SharedArena:
    """One load's arena (an ``ArenaSource``): exported by this process, mapped from another, or private."""

    def __init__(self, owner: "SharedWeights", key: str, instance: str):
        self.owner, self.key, self.instance = owner, key, instance
        self.filled = False
        self.how = ""  # exported | mapped | private
        self.exporter: Proc | None = None

    def allocate(self, nbytes: int, digest: str) -> torch.Tensor:
        return self.owner._allocate(self, nbytes, digest)


class SharedWeights:
    def __init__(self, device: str, directory: Path | None = None):
        self.device = torch.device(device)
        self.name = device_name(device)
        self.registry = WeightRegistry(directory or default_dir())
        self.me = Proc.me()
        self.held: dict[str, SharedArena] = {}  # instance -> its arena, while loaded here
        # CUDA arenas this process allocated, kept while any process uses them: a process cannot open its
        # own IPC handle, and a peer's mapping must not outlive the allocation (``check_exporters``)
        self._own: dict[str, torch.Tensor] = {}
        for orphan in self.registry.orphan_segments():  # a crash between creating and registering one
            with contextlib.suppress(FileNotFoundError):
                orphan.unlink()

    def key(self, engine: EngineConfig) -> str:
        return share_key(engine, self.name)

    def arena(self, key: str, instance: str) -> SharedArena:
        return SharedArena(self, key, instance)

    def load(self, engine: EngineConfig, instance: str, root: Path | None) -> tuple[tuple[torch.nn.Module, dict], str]:
        """(what ``load_model`` gives, how: "mapped" | "loaded and exported" | "loaded (private copy)")."""
        arena = self.arena(self.key(engine), instance)
        try:
            loaded = load_model(engine.model, engine.device, root=root, arena=arena)
        except BaseException:
            self.failed(arena)
            raise
        self.loaded(arena)
        return loaded, {"mapped": "mapped", "exported": "loaded and exported"}.get(arena.how, "loaded (private copy)")

    # -- loading ------------------------------------------------------------------------------------------
    def _allocate(self, arena: SharedArena, nbytes: int, digest: str) -> torch.Tensor:
        deadline = time.monotonic() + EXPORT_WAIT_S
        while True:
            with self.registry.locked() as entries:
                e = entries.get(arena.key)
                if e is None:
                    try:
                        tensor, e = self._export(arena.key, arena.instance, nbytes, digest)
                    except OSError as exc:  # e.g. /dev/shm too small for this model
                        log.warning("%s: cannot export its weights on %s (%s): loading a private copy",
                                    arena.instance, self.name, exc)
                        return self._private(arena, nbytes)
                    entries[arena.key] = e
                    arena.how, arena.exporter = "exported", self.me
                    return tensor
                if e.nbytes != nbytes or e.digest != digest:
                    log.warning("%s: the shared copy on %s has another layout: loading a private copy",
                                arena.instance, self.name)
                    return self._private(arena, nbytes)
                if e.ready:
                    try:
                        tensor = self._map(e)
                    except OSError as exc:  # its segment removed from under the registry
                        log.warning("%s: cannot map %s's weights (%s): loading a private copy", arena.instance,
                                    e.exporter.pid, exc)
                        return self._private(arena, nbytes)
                    e.users.append(self.me)
                    arena.how, arena.exporter, arena.filled = "mapped", e.exporter, True
                    return tensor
            if time.monotonic() > deadline:  # another process is still exporting it
                log.warning("%s: pid %d has not finished exporting it in %.0fs: loading a private copy",
                            arena.instance, e.exporter.pid, EXPORT_WAIT_S)
                return self._private(arena, nbytes)
            time.sleep(_POLL_S)

    def _private(self, arena: SharedArena, nbytes: int) -> torch.Tensor:
        arena.how = "private"
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def _export(self, key: str, instance: str, nbytes: int, digest: str) -> tuple[torch.Tensor, Entry]:
        e = Entry(key=key, model=instance, device=self.name, kind=self.device.type, nbytes=nbytes, digest=digest,
                  exporter=self.me, users=[self.me])
        if self.device.type == "cuda":
            tensor = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            (_dev, handle, size, offset, ref, ref_offset, event, event_sync) = tensor.untyped_storage()._share_cuda_()
            e.ipc = {"handle": bytes(handle).hex(), "size": int(size), "offset": int(offset),
                     "ref": bytes(ref).hex(), "ref_offset": int(ref_offset),
                     "event": None if event is None else bytes(event).hex(), "event_sync": bool(event_sync),
                     "tensor_offset": tensor.storage_offset()}
            self._own[key] = tensor
            return tensor, e
        e.segment = f"seg-{self.me.pid}-{self.me.start}-{next(_segments)}"
        path = self.registry.dir / e.segment
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, nbytes)  # ENOSPC now rather than SIGBUS on a page later
            mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(fd)
            path.unlink()
            raise
        os.close(fd)  # the mapping keeps the file's pages
        return torch.frombuffer(mapping, dtype=torch.uint8), e

    def _map(self, e: Entry) -> torch.Tensor:
        if e.kind == "cuda" and e.exporter == self.me:
            return self._own[e.key]
        if e.kind == "cuda":
            ipc = e.ipc
            storage = torch.UntypedStorage._new_shared_cuda(
                self.device.index if self.device.index is not None else torch.cuda.current_device(),
                bytes.fromhex(ipc["handle"]), ipc["size"], ipc["offset"], bytes.fromhex(ipc["ref"]),
                ipc["ref_offset"], None if ipc["event"] is None else bytes.fromhex(ipc["event"]), ipc["event_sync"])
            return torch.empty((0,), dtype=torch.uint8, device=self.device).set_(
                storage, ipc["tensor_offset"], (e.nbytes,), (1,))
        fd = os.open(self.registry.dir / e.segment, os.O_RDONLY)
        try:
            mapping = mmap.mmap(fd, e.nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        with warnings.catch_warnings():  # read-only on purpose: a write faults instead of changing a peer's model
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            return torch.frombuffer(mapping, dtype=torch.uint8)

    def loaded(self, arena: SharedArena) -> None:
        """The load succeeded: an export becomes visible to the other processes."""
        if arena.how == "private":
            return
        self.held[arena.instance] = arena
        if arena.how == "exported":
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # every write landed before anyone reads
            with self.registry.locked() as entries:
                if arena.key in entries:
                    entries[arena.key].ready = True

    def failed(self, arena: SharedArena) -> None:
        """The load failed: drop this process's part (an unfinished export is removed with its segment)."""
        if arena.how in ("exported", "mapped"):
            self._leave(arena.key)

    def release(self, instance: str) -> None:
        """``instance`` was unloaded here, its tensors already dropped."""
        arena = self.held.pop(instance, None)
        if arena is not None:
            self._leave(arena.key)

    def close(self) -> None:
        """The process is exiting: leave every model, so the last one out frees it now (a crash leaves it
        to the next registry access)."""
        for instance in list(self.held):
            with contextlib.suppress(OSError):  # never what keeps a worker from exiting
                self.release(instance)

    def _leave(self, key: str) -> None:
        with self.registry.locked() as entries:
            e = entries.get(key)
            if e is None:
                return
            with contextlib.suppress(ValueError):
                e.users.remove(self.me)
            if not e.users:
                del entries[key]
                self.registry.unlink_segment(e)
                self._own.pop(key, None)
                log.info("%s: last user on %s gone: shared weights freed", e.model, self.name)

    # -- accounting and health ----------------------------------------------------------------------------
    def device_bytes(self) -> int:
        """Weights of the shared models on this device, each counted once."""
        return sum(e.nbytes for e in self.registry.snapshot().values() if e.device == self.name)

    def on_device(self, key: str) -> bool:
        return key in self.registry.snapshot()

    def how(self, instance: str) -> str:
        arena = self.held.get(instance)
        return "" if arena is None else arena.how

    def check_exporters(self) -> None:
        """Raise when a model mapped here lost its memory: the worker exits and its restart reloads it.
        Also frees this process's CUDA exports that nobody uses any more."""
        if self._own:
            entries = self.registry.snapshot()
            for key in [k for k in self._own if k not in entries]:
                del self._own[key]
        lost = self.lost()
        if lost:
            raise RuntimeError(f"the process that exported the weights of {', '.join(lost)} on {self.name} died: "
                               "exiting so that a restart reloads them")

    def lost(self) -> list[str]:
        """Instances mapped from a CUDA export whose exporter died: their device memory is gone."""
        mapped = [a for a in self.held.values() if a.how == "mapped" and self.device.type == "cuda"]
        if not mapped:
            return []
        entries = self.registry.snapshot()
        return [a.instance for a in mapped
                if (e := entries.get(a.key)) is None or e.exporter != a.exporter]
