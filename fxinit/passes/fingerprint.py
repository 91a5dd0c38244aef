"""A digest of what a slice of an init graph computes.

Two slices with the same digest compute the same values: the same ops with the same
arguments in the same order, the same constants and the same generator states. Ranks of a
distributed job compare digests before fxinit replays a collective locally (a scatter of
a tensor every rank recorded alike is a copy of each rank's own slice of it).
"""

from __future__ import annotations

import hashlib
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx


def fingerprint(nodes: Sequence[fx.Node], constants: Mapping[str, torch.Tensor], rng: Mapping[str, Any]) -> str:
    """Hex digest of ``nodes`` (a slice in program order), their constants and snapshots.
    Device indices are left out: ranks hold the same values on ``cuda:0`` and ``cuda:1``."""
    h = hashlib.sha256()
    index = {n: i for i, n in enumerate(nodes)}

    def enc(x: Any) -> Any:
        if isinstance(x, fx.Node):
            return ("node", index.get(x, x.name))
        if isinstance(x, torch.device):
            return ("device", x.type)
        if isinstance(x, (list, tuple)):
            return (type(x).__name__, tuple(enc(v) for v in x))
        if isinstance(x, dict):
            return ("dict", tuple((k, enc(v)) for k, v in sorted(x.items())))
        return repr(x)

    for n in nodes:
        h.update(repr((n.op, _target_name(n.target), enc(n.args), enc(dict(n.kwargs)))).encode())
        if "default_dtype" in n.meta or "numerics" in n.meta:  # settings changed inside the constructor
            h.update(repr((n.meta.get("default_dtype"), n.meta.get("numerics"))).encode())
        if n.op == "get_attr":
            value = constants[n.target]
            h.update(repr((value.dtype, tuple(value.shape))).encode())
            h.update(value.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        for key in sorted((n.meta.get("generators") or {}).items()):
            h.update(key[0].split(":")[0].encode())
            h.update(rng[key[1]].state.cpu().numpy().tobytes())
    return h.hexdigest()


def _target_name(target: Any) -> str:
    """The same on every process (a function's repr holds its address)."""
    if isinstance(target, (str, torch._ops.OpOverload)):
        return str(target)
    return f"{getattr(target, '__module__', '')}.{getattr(target, '__qualname__', type(target).__name__)}"
