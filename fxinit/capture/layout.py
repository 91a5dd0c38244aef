"""Which elements of a DTensor's global tensor a rank holds.

A DTensor's local tensor is its global tensor split by its placements, one mesh dimension
after the other (what ``distribute_tensor`` does, and what ``full_tensor`` undoes). Every
shard-like placement acts on one tensor dimension, so a local tensor is the global tensor
indexed by one list of positions per dimension. The positions are found by running each
placement's own split (``Shard``, ``_StridedShard``: torch's code, not a copy of it) on
the positions themselves, so uneven shards and the strided shards FSDP2 makes over tensor
parallelism come out as torch lays them out.

    >>> import torch
    >>> from torch.distributed.tensor import Shard
    >>> local_runs((10, 4), [Shard(0)], mesh_sizes=(4,), coordinate=(3,))
    [[(9, 10)], [(0, 4)]]
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit.errors import DeferredInitError

Runs = list[tuple[int, int]]  # half-open ranges of positions along one dimension, in order


def local_runs(shape: Sequence[int], placements: Sequence[Any], mesh_sizes: Sequence[int],
               coordinate: Sequence[int]) -> list[Runs]:
    """Per tensor dimension, the runs of global positions the rank at ``coordinate`` holds,
    in the order its local tensor holds them."""
    positions = [FACTORIES.arange(n) for n in shape]
    for mesh_dim, placement in enumerate(placements):
        if placement.is_replicate():
            continue
        if not hasattr(placement, "dim") or not hasattr(placement, "_split_tensor"):  # Shard, _StridedShard
            raise DeferredInitError(
                f"fxinit cannot lay out a deferred DTensor with placement {placement}",
                hint="only Shard, _StridedShard and Replicate placements describe a slice of the global tensor; "
                     "materialize before making a Partial DTensor")
        dim = placement.dim % len(shape)
        along = positions[dim].view([-1 if d == dim else 1 for d in range(len(shape))])
        pieces, _ = placement._split_tensor(along, mesh_sizes[mesh_dim], with_padding=False, contiguous=False)
        positions[dim] = pieces[coordinate[mesh_dim]].reshape(-1) if coordinate[mesh_dim] < len(pieces) \
            else positions[dim][:0]
    return [_runs(p.tolist()) for p in positions]


def _runs(positions: list[int]) -> Runs:
    runs: Runs = []
    for p in positions:
        if runs and runs[-1][1] == p:
            runs[-1] = (runs[-1][0], p + 1)
        else:
            runs.append((p, p + 1))
    return runs


def local_shape(runs: list[Runs]) -> tuple[int, ...]:
    return tuple(sum(hi - lo for lo, hi in r) for r in runs)


def take(global_: torch.Tensor, runs: list[Runs]) -> torch.Tensor:
    """``global_`` indexed by ``runs``: views (``narrow``) where a dimension is one run,
    ``cat`` of views where it is several."""
    out = global_
    for dim, r in enumerate(runs):
        if r == [(0, out.size(dim))]:
            continue
        if len(r) == 1:
            out = out.narrow(dim, r[0][0], r[0][1] - r[0][0])
        elif not r:
            out = out.narrow(dim, 0, 0)
        else:
            out = torch.cat([out.narrow(dim, lo, hi - lo) for lo, hi in r], dim=dim)
    return out
