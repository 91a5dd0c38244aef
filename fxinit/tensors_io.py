"""Writing materialized tensors to a safetensors file, ties stored once."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from fxinit.errors import DeferredInitError
from fxinit.graph import InitGraph


def save_safetensors(values: dict[str, torch.Tensor], graph: InitGraph, path: Path) -> None:
    """Write ``values`` (name -> tensor) to ``path``.

    A tied group is stored once, under its first name; the file's metadata key
    ``fxinit.ties`` lists the groups (JSON) so the other names can be restored, as
    transformers does with ``tie_weights()``. Views of a shared storage that are not
    tied are stored as separate copies.
    """
    try:
        from safetensors.torch import save_file
    except ImportError as exc:
        raise DeferredInitError("writing safetensors needs the safetensors package",
                                hint="pip install safetensors") from exc
    tied_to = {n: g[0] for g in graph.ties for n in g}
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, list[str]] = {}
    seen_storage: set[int] = set()
    for name, value in values.items():
        rep = tied_to.get(name, name)
        if rep in groups:
            groups[rep].append(name)
            continue
        groups[rep] = [name]
        t = value.detach().to("cpu").contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen_storage:
            t = t.clone()
        seen_storage.add(t.untyped_storage().data_ptr())
        out[name] = t
    ties = [g for g in groups.values() if len(g) > 1]
    save_file(out, str(path), metadata={"fxinit.ties": json.dumps(ties), "format": "pt"})
