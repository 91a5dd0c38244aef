"""Batched fills: small exact fills that run together, in one call to fxinit's fill kernels.

A model initializes hundreds of small tensors, each an allocation and a fill (``empty``
then ``normal_``). Where the tensors are small, running one node at a time costs more in
Python than the kernel takes to fill them (issue 32: a 32-layer Llama of hidden size 64
spends ~25 us a fill around ~4 us of sampling). A fill here is *batched*: the interpreter
queues it when its turn comes and runs the queue in one call to ``rng.fills`` before any
node that reads or writes the tensors queued (``Batches.flushes``), and at the end.

A fill is batched when exact mode's compiled copy of torch's sampler would run it whole
anyway (``native_kind``: ``normal_`` or ``uniform_`` with plain numbers, from one explicit
generator), into a whole allocation of the slice on the CPU, of a supported floating dtype,
small enough to run as one job (``rng.fills.batchable``: fewer than ``BATCH_BELOW``
elements, a normal fill a multiple of 16 long, as torch redraws a shorter last block), and no other pass decided how it runs (pieces,
chunks, a fused cast, CSE, a kernel). The flush points are the nodes that use the fill or
its allocation, and every later node that reads or writes its storage (by the capture's
storage ids: through a view taken before the fill as well).

>>> import torch, fxinit
>>> m = fxinit.trace_init(torch.nn.Linear, 64, 64)
>>> print(fxinit.init_graph(m).plan())  # doctest: +SKIP
plan: ... normal_... batched (one kernel call with the fills beside it)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import AbstractSet, Mapping, NamedTuple

import torch
import torch.fx as fx

from fxinit.ops import allocates, is_random
from fxinit.passes.fills import fill_call, native_kind
from fxinit.rng.fills import batchable


class BatchedFill(NamedTuple):
    """One queued fill: ``kind`` (``"normal"``, ``"uniform"``) with ``params``, into argument
    ``index`` of its node, drawing from the generator snapshot ``key``."""

    kind: str
    params: tuple[float, float]
    index: int
    key: str


@dataclass(frozen=True)
class Batches:
    """The fills that run batched, and the nodes before which the queue must have run."""

    fills: Mapping[fx.Node, BatchedFill]
    flushes: frozenset[fx.Node]


NO_BATCHES = Batches({}, frozenset())


def batched_fills(nodes: list[fx.Node], rng: str, decided: AbstractSet[fx.Node],
                  shared: AbstractSet[fx.Node], device_map: Mapping[torch.device, torch.device]) -> Batches:
    """The batches of the slice ``nodes`` (program order). ``decided``: nodes another pass
    decided how to run; ``shared``: storage roots that may share storage with another
    (``passes.roots.shared_roots``); ``device_map``: where an absent device's nodes run."""
    if rng != "exact":
        return NO_BATCHES
    members = set(nodes)
    fills: dict[fx.Node, BatchedFill] = {}
    touching: set[fx.Node] = set()
    for n in nodes:
        if not is_random(n) or n in decided:
            continue
        call = fill_call(n)
        native = native_kind(call) if call is not None and call.bounds is None else None
        target = n.args[call.index] if native is not None else None
        if not isinstance(target, fx.Node) or not allocates(target) or target in shared or target not in members:
            continue
        spec = target.meta.get("spec")
        if spec is None or not _small_cpu_tensor(spec, native[0], device_map):
            continue
        fills[n] = BatchedFill(native[0], native[1], call.index, call.key)
        touching |= {target, n}
    flushes = {u for t in touching for u in t.users if u in members and u not in fills}
    # and whatever reads or writes those storages after their fill, through views taken
    # before it too (``w[:k]``, ``unbind``): the capture's storage ids say which nodes do
    filled: set[int] = set()
    for n in nodes:
        if n in fills:
            filled.update(n.meta.get("mutates", ()))
        elif filled:
            reads, writes = n.meta.get("reads"), n.meta.get("mutates")
            if (reads and not filled.isdisjoint(reads)) or (writes and not filled.isdisjoint(writes)):
                flushes.add(n)
    return Batches(fills, frozenset(flushes))


def _small_cpu_tensor(spec, kind: str, device_map: Mapping[torch.device, torch.device]) -> bool:  # noqa: ANN001
    device = device_map.get(spec.device, spec.device)
    return device.type == "cpu" and spec.is_contiguous() and batchable(kind, spec.dtype, spec.numel)
