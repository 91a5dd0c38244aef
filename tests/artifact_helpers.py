"""Building valid and deliberately broken init-graph files for the artifact tests."""

from __future__ import annotations

import copy
import hashlib
import io
import struct
import zipfile
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn

import fxinit
from fxinit.archive import HEADER_MAGIC, pack

#: A file the release before issue 19 wrote (the header layout: ``FXINIT-GRAPH``, a sha256
#: line, a torch.save archive), traced from ``Small`` with seed 0 at commit b5f76c0.
HEADER_LAYOUT_FILE = Path(__file__).resolve().parent / "data" / "small_header_layout.fxg"


class Small(nn.Module):
    """Random, opaque, constant, computed and tied tensors in a few hundred bytes.

    HEADER_LAYOUT_FILE was traced from this class: changing it breaks that file's test."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)
        self.fc = nn.Linear(4, 6)
        nn.init.trunc_normal_(self.fc.weight, std=0.02)
        self.q = nn.Linear(4, 4, bias=False)
        nn.init.orthogonal_(self.q.weight)
        self.register_buffer("table", torch.tensor([1.0, 2.5, -3.0]))
        self.register_buffer("pos", torch.arange(5).float() / 5, persistent=False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.emb.weight


def small_graph() -> fxinit.InitGraph:
    torch.manual_seed(0)
    return fxinit.init_graph(fxinit.trace_init(Small))


def dumps(payload: Any) -> bytes:
    """An init-graph file holding ``payload``, with a correct checksum."""
    return pack(payload)


def header_layout(payload: Any) -> bytes:
    """A file in the older header layout holding ``payload``, with a correct checksum."""
    buf = io.BytesIO()
    torch.save(payload, buf)
    body = buf.getvalue()
    return HEADER_MAGIC + b"sha256:" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def payload_of(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=True)


def record_data_at(data: bytes, info: zipfile.ZipInfo) -> int:
    """Offset in ``data`` of the first byte of a zip record's data (after its local header)."""
    name_len, extra_len = struct.unpack_from("<HH", data, info.header_offset + 26)
    return info.header_offset + 30 + name_len + extra_len


def valid_bytes(tmp_path) -> bytes:
    path = tmp_path / "ok.pt"
    small_graph().save(path)
    return path.read_bytes()


class _Evil:
    """Pickles to a call of os.system: a loader that runs pickled code would execute it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple]:
        import os

        return os.system, (f"touch {self.marker}",)


def hostile_payload(marker: str) -> dict:
    """A payload whose pickle calls os.system (``touch marker``)."""
    return {"format": "fxinit-init-graph", "x": _Evil(marker)}


def hostile(marker: str) -> bytes:
    """An init-graph file whose pickle calls os.system, with a correct checksum."""
    return pack(hostile_payload(marker))


def mutated(data: bytes, edit: Callable[[dict], None]) -> bytes:
    p = copy.deepcopy(payload_of(data))
    edit(p)
    return dumps(p)
