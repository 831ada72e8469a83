"""A frame of handed-off KV as it travels: equal-sized layers back to back, each with its CRC32, or the whole
frame with one MAC under its grant's key. Written by the senders (shared/handoff/frames.py, a sharded prefill
rank's kv_parts.py) and checked by every receiver (shared/handoff/assembler.py's, a decode rank's kv_share.py).

The MAC is HMAC-SHA256 (OpenSSL; SHA-NI makes it ~2 GB/s a core on AMD EPYC, against ~1.4 for keyed BLAKE2b,
and it releases the GIL as zlib does): frames sent on the decode worker's plain bulk sockets are not
encrypted, and the MAC is what tells the grant's holder from anyone else who reaches that socket."""

import hmac
import struct
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


def frame_mac(key: bytes, frame: memoryview, first: int, layer_nbytes: int) -> bytes:
    """The MAC of a frame of layers ``first`` on, of ``layer_nbytes`` each, under a grant's key: where the
    frame goes is covered with its bytes, so no frame passes for another layer's or another grant's."""
    mac = hmac.new(key, struct.pack("<QQQ", first, layer_nbytes, frame.nbytes), "sha256")
    mac.update(frame)
    return mac.digest()


def check_mac(key: bytes, frame: memoryview, first: int, layer_nbytes: int, mac: bytes) -> None:
    """ValueError unless ``mac`` is the frame's under ``key``."""
    if not hmac.compare_digest(frame_mac(key, frame, first, layer_nbytes), mac):
        raise ValueError(f"KV frame MAC mismatch at layer {first}: not sent by this grant's holder, or altered")


def frame_bytes(frame) -> torch.Tensor:
    """A received frame as a uint8 tensor over the same memory, without a copy."""
    with warnings.catch_warnings():  # read-only receive buffers: we only ever read from them
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(memoryview(frame), dtype=torch.uint8)
