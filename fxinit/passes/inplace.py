"""In-place chains: an element-wise op whose tensor input is a temporary that nothing else
reads runs in place on it.

``torch.randn(n, m) * 0.02 + 1`` allocates three tensors of the same size when replayed
as recorded; run in place, it allocates one. The in-place variant of a pointwise op runs
the same kernel on the same inputs, so the bits are the same; it is used only where the
result has exactly the input's shape, strides, dtype and device (no broadcasting into a
larger result, no type promotion) and the input is a fresh value with no other reader. Not
for empty tensors: their strides are each kernel's choice (``mul`` of a ``(0, 1)`` tensor on
the CPU gives strides ``(1, 0)``, ``add`` then ``(1, 1)``), which in place would keep.
"""

from __future__ import annotations

from typing import AbstractSet, Any, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.ops import allocates
from fxinit.passes.walk import users_of

aten = torch.ops.aten


def _pairs() -> dict[Any, Any]:
    pairs = {}
    for name, overloads in {
        "add": ("Tensor", "Scalar"), "sub": ("Tensor", "Scalar"), "mul": ("Tensor", "Scalar"),
        "div": ("Tensor", "Scalar", "Tensor_mode", "Scalar_mode"), "clamp": ("default", "Tensor"),
        "clamp_min": ("default",), "clamp_max": ("default",), "neg": ("default",), "reciprocal": ("default",),
        "exp": ("default",), "log": ("default",), "sqrt": ("default",), "rsqrt": ("default",), "abs": ("default",),
        "sin": ("default",), "cos": ("default",), "tanh": ("default",), "sigmoid": ("default",),
        "erfinv": ("default",), "fmod": ("Scalar", "Tensor"), "remainder": ("Scalar", "Tensor"),
        "masked_fill": ("Scalar", "Tensor"), "lerp": ("Scalar", "Tensor"), "addcmul": ("default",),
        "addcdiv": ("default",), "floor": ("default",), "ceil": ("default",), "round": ("default",),
        "trunc": ("default",), "sign": ("default",),
    }.items():
        for ov in overloads:
            pairs[getattr(getattr(aten, name), ov)] = getattr(getattr(aten, name + "_"), ov)
    pairs[aten.pow.Tensor_Scalar] = aten.pow_.Scalar
    pairs[aten.pow.Tensor_Tensor] = aten.pow_.Tensor
    return pairs


IN_PLACE = _pairs()


def in_place_chains(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node],
                    shared: Mapping[fx.Node, tuple[fx.Node, bool]] = {}) -> dict[fx.Node, Any]:
    """``{node: in-place op}`` for element-wise nodes of the slice ``nodes`` that can run in
    place on their first argument. ``shared`` is the CSE map: a value reused through it
    has readers the graph does not show, so it is never overwritten."""
    users = users_of(nodes)
    reused = {first for first, _ in shared.values()} | set(shared)
    out: dict[fx.Node, Any] = {}
    for n in nodes:
        op = IN_PLACE.get(n.target)
        x = n.args[0] if n.args else None
        if op is None or not isinstance(x, fx.Node) or x in keep or x in reused or users[x] != [n]:
            continue
        if x.op == "get_attr" or not allocates(x) or x.meta.get("spec") is None:
            continue
        if n.meta.get("spec") != x.meta["spec"] or n.meta.get("generators") or x.meta["spec"].numel == 0:
            continue  # (an empty result's strides are the kernel's choice: on CPU, not the meta kernel's)
        out[n] = op
    return out
