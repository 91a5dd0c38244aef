"""The safetensors file layout, for writing a file tensor by tensor.

``safetensors.torch.save_file`` needs every tensor in memory at once. The format itself
does not: an 8-byte little-endian header length, a JSON header giving each tensor's dtype,
shape and byte range, then the tensors' bytes back to back. Knowing every shape and dtype
in advance, the header is written first and the bytes are streamed after it.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Mapping, Sequence

import torch

from fxinit.errors import DeferredInitError

# safetensors' dtype codes (the Rust crate's Dtype names)
DTYPE_CODES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
for _name, _code in (("uint16", "U16"), ("uint32", "U32"), ("uint64", "U64")):
    if hasattr(torch, _name):
        DTYPE_CODES[getattr(torch, _name)] = _code

_ALIGN = 8  # the header is padded with spaces so that the data starts 8-byte aligned, as safetensors does


def header(tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]], metadata: Mapping[str, str]) -> bytes:
    """The header bytes (length prefix included) of a file holding ``tensors`` (name,
    shape, dtype) back to back in this order."""
    entries: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, shape, dtype in tensors:
        code = DTYPE_CODES.get(dtype)
        if code is None:
            raise DeferredInitError(f"safetensors cannot store {name!r}: it has no code for {dtype}",
                                    hint="export with --format dcp, or cast with --dtype")
        n = 1
        for s in shape:
            n *= s
        entries[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + n * dtype.itemsize]}
        offset += n * dtype.itemsize
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % _ALIGN)
    return struct.pack("<Q", len(text)) + text


def data_size(tensors: Sequence[tuple[str, tuple[int, ...], torch.dtype]]) -> int:
    total = 0
    for _, shape, dtype in tensors:
        n = 1
        for s in shape:
            n *= s
        total += n * dtype.itemsize
    return total


def read_header(path: Path) -> bytes | None:
    """The header bytes (length prefix included) of the file at ``path``, or None when it
    is too short to hold the header it announces."""
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            return None
        (length,) = struct.unpack("<Q", prefix)
        if length > 100 << 20:
            return None
        text = f.read(length)
    return prefix + text if len(text) == length else None
