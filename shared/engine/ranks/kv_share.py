"""A decode rank's share of a handed-off prompt's KV, arriving in parts (shared/engine/ranks/kv_inlet.py): each
KVLayers part names the model's layers (``first``) and KV heads (``heads``) it holds; this places it into the
rank's own cache, whose (0, 0) is the model's ``origin`` (its stage's first layer, its first head). The state
is the (layer, head) grid of the share: a part outside it, overlapping one already taken, of the wrong size or
failing a layer's CRC32 is refused; the share is complete once every (layer, head) is in. The decode side's
rank 0 does the same with shared/handoff/rank_parts.py ``PartAssembler``; this one writes synchronously, on
the inlet's own thread, so nothing is still landing once it returns."""


import torch

from kvrelay.kernels.kv_quant import FP8_KV_DTYPE
from kvrelay.shared.engine.kv_frame import check_crcs, frame_bytes
from kvrelay.shared.wire.handoff import KVLayers


class ShareAssembler:
    def __init__(self, kv_cache: torch.Tensor, block_ids: list[int], origin: tuple[int, int]) -> None:
        self.cache = kv_cache.view(torch.uint8) if kv_cache.dtype == FP8_KV_DTYPE else kv_cache
        self.num_layers, self.num_heads = kv_cache.shape[0], kv_cache.shape[4]
        self.origin = origin
        self.index = torch.tensor(block_ids, dtype=torch.long, device=kv_cache.device)
        _, two, _, block_size, _, head_dim = kv_cache.shape
        self.head_nbytes = two * len(block_ids) * block_size * head_dim * kv_cache.element_size()  # a layer's head
        self.missing = torch.ones(self.num_layers, self.num_heads, dtype=torch.bool)
        self.nbytes = 0  # of KV taken

    @property
    def complete(self) -> bool:
        return not bool(self.missing.any())

    def add(self, msg: KVLayers, frames: list) -> None:
        (first_head, count_heads), count = msg.heads, len(msg.checksums)
        layer, head = msg.first - self.origin[0], first_head - self.origin[1]
        if min(layer, head) < 0 or layer + count > self.num_layers or head + count_heads > self.num_heads:
            raise ValueError(f"a KV part of layers {msg.first}..{msg.first + count - 1}, heads {first_head}.."
                             f"{first_head + count_heads - 1} outside this rank's {self.num_layers} x "
                             f"{self.num_heads} from layer {self.origin[0]}, head {self.origin[1]}")
        cells = self.missing[layer:layer + count, head:head + count_heads]
        if not bool(cells.all()):
            raise ValueError(f"a KV part of layers {msg.first}.., heads {first_head}.. overlaps one already taken")
        if len(frames) != 1:
            raise ValueError(f"a KV layers message has {len(frames)} frames, not 1")
        data = memoryview(frames[0])
        want = count_heads * self.head_nbytes
        if msg.nbytes != want or data.nbytes != count * want:
            raise ValueError(f"KV part frame of {data.nbytes} bytes for {count} layers of {msg.nbytes}, expected "
                             f"{count} x {want}")
        check_crcs(data, msg.first, msg.checksums)
        shape = (count, self.cache.shape[1], len(self.index), self.cache.shape[3], count_heads, self.cache.shape[5])
        part = frame_bytes(data).view(self.cache.dtype).view(shape)
        # the rank's cache is made under inference mode, which is per thread: this thread re-enters it
        with torch.inference_mode(self.cache.is_inference()):
            dst = self.cache.narrow(0, layer, count).narrow(4, head, count_heads)
            dst.index_copy_(2, self.index, part.to(self.cache.device))
            if self.cache.is_cuda:  # reported done only once written, whatever stream the steps run on
                torch.cuda.current_stream(self.cache.device).synchronize()
            cells.fill_(False)  # made with the cache, on the step loop's thread
        self.nbytes += data.nbytes
