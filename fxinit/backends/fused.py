"""Running the fill-then-cast chains that ``passes.cast_fusion`` found, chunk by chunk."""

from __future__ import annotations

from typing import Callable, Mapping

import torch
import torch.fx as fx

from fxinit.backends.partial import CHUNK, fill_in_chunks_exact
from fxinit.backends.portable import fill_in_chunks_portable
from fxinit.passes.cast_fusion import FusedCast
from fxinit.rng import Snapshot


def runnable(plans: Mapping[fx.Node, FusedCast], rng: Mapping[str, Snapshot],
             streams: Mapping[fx.Node, int] | None) -> dict[fx.Node, FusedCast]:
    """The plans whose fill can be split exactly in this run (decided before any member runs)."""
    return {fill: p for fill, p in plans.items() if _fill_chunks(p, rng, streams, None)}


def run_fused(plan: FusedCast, rng: Mapping[str, Snapshot], streams: Mapping[fx.Node, int] | None) -> torch.Tensor:
    """The cast tensor of ``plan``, produced without the full-precision tensor ever existing."""
    spec = plan.alloc.meta["spec"]
    out = torch.empty_strided(spec.shape, spec.stride, dtype=plan.dtype, device=spec.device)
    flat = out.view(-1)

    def sink(lo: int, hi: int, piece: torch.Tensor) -> None:
        flat[lo:hi].copy_(piece)

    if not _fill_chunks(plan, rng, streams, sink):
        raise AssertionError("fxinit: a fused fill planned as splittable could not be split")
    return out


def _fill_chunks(plan: FusedCast, rng: Mapping[str, Snapshot], streams: Mapping[fx.Node, int] | None,
                 sink: Callable[[int, int, torch.Tensor], None] | None) -> bool:
    spec = plan.alloc.meta["spec"]
    n = spec.numel
    if n < 2 * CHUNK:
        return False  # small: the unfused run costs no more
    fill = plan.fill
    rest, kwargs = tuple(fill.args[1:]), dict(fill.kwargs)
    if streams is not None:
        return fill_in_chunks_portable(fill, rest, kwargs, streams[fill], spec.dtype, n, sink)
    return fill_in_chunks_exact(fill, rest, kwargs, rng, spec.dtype, n, sink)
