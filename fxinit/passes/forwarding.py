"""Forwarding: copies that draw what they write, instead of reading it from their source.

A rank's shard reaches its buffer through a chain of copies (``passes.origins``). Where the
elements a copy writes are, all along the chain, unchanged draws of one fill, the copy draws
them itself from the fill's snapshot (exact mode) or stream (portable mode), straight into
its output; the read demand (``passes.demand``) then carries nothing for them back up the
chain, so the fill, the TP chunk's ``clone`` and the scatter's ``copy_`` do nothing for them,
and the bytes of the shard are written once.

The decision is ``forwarded_demand``'s: a copy draws where at least part of its demanded
elements have an origin, in runs long enough to be worth drawing (``demand.FORWARD_RUN_MIN``), unless
its fill writes those elements anyway for another reader (a kept full tensor): copying them
then costs less than drawing them again. The plan shows it as ``plan.forwards``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Any, Callable, Mapping, Sequence

import numpy as np
import torch.fx as fx

from fxinit.passes import intervals
from fxinit.passes.demand import Demand, only_whole, read_demand
from fxinit.passes.origins import Origins, Runs, copied_views, copy_origins
from fxinit.passes.ranges import Extent
from fxinit.passes.roots import filled, storage_root

#: Rounds of ``forwarded_demand`` giving copies back to copying: each moves up one copy of a chain.
ROUNDS = 8


@dataclass(frozen=True)
class Forward:
    """Elements a copy draws straight into its output instead of copying them: ``runs[i]``
    = ``(lo, hi, at)``, positions ``lo .. hi`` of ``fill``'s draws go to the output's
    storage elements ``at .. at + hi - lo`` (sorted by ``lo``)."""

    fill: fx.Node
    runs: Any  # int64 numpy array [k, 3]

    @property
    def elements(self) -> int:
        return int((self.runs[:, 1] - self.runs[:, 0]).sum())


def forwarded_demand(nodes: Sequence[fx.Node], keep: AbstractSet[fx.Node], exposed: Mapping[fx.Node, Extent],
                     sources: Callable[[fx.Node], bool], excluded: AbstractSet[fx.Node],
                     entangled: AbstractSet[fx.Node]) -> tuple[Demand, dict[fx.Node, list[Forward]]]:
    """The read demand of the slice ``nodes`` (``demand.read_demand``'s arguments) with the
    copies that draw what they write, and what they draw. ``sources(fill)``: whether a fill
    can draw any piece alone; ``excluded``: copies that must run as they are (CSE values,
    fused or compiled members, in-place chains); ``entangled``: ``roots.shared_roots``."""
    if only_whole(nodes, keep, exposed):  # nothing left out, nothing drawn by copies (whole unsharded models)
        return Demand(), {}
    if not _copies_read_fills(nodes):  # no copy can draw: the demand alone
        return read_demand(nodes, keep, exposed, None, entangled), {}
    read = read_demand(nodes, keep, exposed, None, entangled).copies  # what copies must write at most
    origins = copy_origins(nodes, sources, entangled, read)
    origins.at = {n: r for n, r in origins.at.items() if n not in excluded}
    demand = read_demand(nodes, keep, exposed, origins, entangled)
    for _ in range(ROUNDS):  # giving a copy back may let one up its chain draw the same elements
        copied = copied_anyway(demand, origins)
        if not copied:
            break
        origins.at = {n: r for n, r in origins.at.items() if n not in copied}
        demand = read_demand(nodes, keep, exposed, origins, entangled)
    return demand, {n: _by_fill(runs, origins.fills) for n, runs in demand.forwards.items()}


def _copies_read_fills(nodes: Sequence[fx.Node]) -> bool:
    """Whether a copy of the slice reads a storage a random fill writes in place: origins
    start only there (``origins.copy_origins``), so without one no copy draws anything."""
    filled_roots = {storage_root(t) for n in nodes if n.op == "call_function" and n.meta.get("generators")
                    and (t := filled(n)) is not None}
    return bool(filled_roots) and any(storage_root(c.src) in filled_roots for n in nodes if n.op == "call_function"
                                      and (c := copied_views(n)) is not None)


def copied_anyway(demand: Demand, origins: Origins) -> set[fx.Node]:
    """Copies that would draw mostly elements their fill writes for other readers anyway (a
    kept full tensor and its copied shard): copying those costs less than drawing them again."""
    out = set()
    for n, runs in demand.forwards.items():
        again = sum(intervals.size(intervals.intersect(intervals.of(f.runs[:, :2]),
                                                       demand.fills.get(f.fill, intervals.EMPTY)))
                    for f in _by_fill(runs, origins.fills))
        if 2 * again >= intervals.size(runs[:, :2]):
            out.add(n)
    return out


def _by_fill(runs: Runs, fills: Sequence[fx.Node]) -> list[Forward]:
    """``origins.Runs`` of a copy's output as one ``Forward`` per fill."""
    out = []
    for number in sorted(set(runs[:, 2].tolist())):
        mine = runs[runs[:, 2] == number]
        drawn = np.stack([mine[:, 0] + mine[:, 3], mine[:, 1] + mine[:, 3], mine[:, 0]], axis=1)
        out.append(Forward(fills[number], drawn[np.argsort(drawn[:, 0], kind="stable")]))
    return out
