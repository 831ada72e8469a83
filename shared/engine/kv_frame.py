"""A frame of handed-off KV as it travels: equal-sized layers back to back, each with its CRC32. Written by
the senders (shared/handoff/frames.py, a sharded prefill rank's kv_parts.py) and checked by every receiver
(shared/handoff/assembler.py's, a decode rank's kv_share.py)."""

import warnings
import zlib

import torch


def layer_crcs(frame: memoryview, num_layers: int) -> list[int]:
    """The CRC32 of each of the frame's ``num_layers`` equal-sized layers."""
    size = frame.nbytes // num_layers
    return [zlib.crc32(frame[i * size:(i + 1) * size]) for i in range(num_layers)]


def check_crcs(frame: memoryview, first: int, checksums: list[int]) -> None:
    """ValueError unless each of the frame's equal-sized layers (layer ``first`` on) has its checksum."""
    for i, (got, want) in enumerate(zip(layer_crcs(frame, len(checksums)), checksums, strict=True)):
        if got != want:
            raise ValueError(f"KV checksum mismatch in layer {first + i}")


def frame_bytes(frame) -> torch.Tensor:
    """A received frame as a uint8 tensor over the same memory, without a copy."""
    with warnings.catch_warnings():  # read-only receive buffers: we only ever read from them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(frame), dtype=torch.uint8)
