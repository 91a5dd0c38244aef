"""Building valid and deliberately broken init-graph files for the artifact tests."""

from __future__ import annotations

import copy
import hashlib
import io
import pickle
from typing import Any, Callable

import torch
import torch.nn as nn

import fxinit
from fxinit.artifact import MAGIC


class Small(nn.Module):
    """Random, opaque, constant, computed and tied tensors in a few hundred bytes."""

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


def signed(body: bytes) -> bytes:
    return MAGIC + b"sha256:" + hashlib.sha256(body).hexdigest().encode() + b"\n" + body


def dumps(payload: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(payload, buf)
    return signed(buf.getvalue())


def payload_of(data: bytes) -> dict:
    body = data[data.index(b"\n", len(MAGIC)) + 1:]
    return torch.load(io.BytesIO(body), weights_only=True)


def valid_bytes(tmp_path) -> bytes:
    path = tmp_path / "ok.fxg"
    small_graph().save(path)
    return path.read_bytes()


class _Evil:
    """Pickles to a call of os.system: a loader that runs pickled code would execute it."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple]:
        import os

        return os.system, (f"touch {self.marker}",)


def hostile(marker: str) -> bytes:
    """A torch.save zip whose pickle calls os.system, correctly signed."""
    buf = io.BytesIO()
    torch.save({"format": "fxinit-init-graph", "x": _Evil(marker)}, buf, pickle_module=pickle)
    return signed(buf.getvalue())


def mutated(data: bytes, edit: Callable[[dict], None]) -> bytes:
    p = copy.deepcopy(payload_of(data))
    edit(p)
    return dumps(p)
