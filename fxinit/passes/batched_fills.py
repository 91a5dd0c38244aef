"""Batched fills: small fills that run together, in one call to a fill kernel.

A model initializes hundreds of tensors, each an allocation and a fill (``empty`` then
``normal_``). Where the tensors are small, running one node at a time costs more in Python
than the kernel takes to fill them (issue 32: a 32-layer Llama of hidden size 64 spends ~25 us
a fill around ~4 us of sampling); on a GPU every fill is a launch. A fill here is *batched*:
the interpreter queues it when its turn comes and runs the queue in one call before any node
that reads or writes the tensors queued (``Batches.flushes``), and at the end.

A fill is batched when it is ``normal_`` or ``uniform_`` with plain numbers into a whole,
contiguous allocation of the slice, no other pass decided how it runs (pieces, chunks, a
fused cast, CSE, a chain in a kernel), and a kernel takes it whole:

* exact mode: exact mode's compiled copy of torch's CPU sampler (``rng.fills``), drawing from
  one explicit generator, for fills small enough to run as one job (``rng.fills.batchable``:
  fewer than ``BATCH_BELOW`` elements, a normal fill a multiple of 16 long, as torch redraws
  a shorter last block);
* portable mode: fxinit's own GPU kernels where the plan runs the fill with one of them
  (``plan.kernels``: Triton's on CUDA by default, or the CUDA kernel NVRTC builds), any size,
  one launch per kind and dtype over a table of fills (``rng.portable.fill_table``); on the
  CPU fxinit's C kernel, for fills of one chunk at most (``rng.portable.batchable``).

The flush points are the nodes that use the fill or its allocation, and every later node
that reads or writes its storage (by the capture's storage ids: through a view taken before
the fill as well).

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
from fxinit.passes.fills import FillCall, NATIVE_FILLS, fill_call, native_kind
from fxinit.passes.kernels import TABLE_BACKENDS, Kernel
from fxinit.rng import portable
from fxinit.rng.fills import batchable
from fxinit.spec import TensorSpec


class BatchedFill(NamedTuple):
    """One queued fill: ``kind`` (``"normal"``, ``"uniform"``) with ``params`` (torch's: mean
    and std, or from and to), into argument ``index`` of its node, drawing from the generator
    snapshot ``key`` (exact mode; portable mode draws from the node's stream: None)."""

    kind: str
    params: tuple[float, float]
    index: int
    key: str | None


@dataclass(frozen=True)
class Batches:
    """The fills that run batched, and the nodes before which the queue must have run."""

    fills: Mapping[fx.Node, BatchedFill]
    flushes: frozenset[fx.Node]


NO_BATCHES = Batches({}, frozenset())


def batched_fills(nodes: list[fx.Node], rng: str, decided: AbstractSet[fx.Node],
                  shared: AbstractSet[fx.Node], device_map: Mapping[torch.device, torch.device],
                  kernels: Mapping[fx.Node, Kernel] | None = None) -> Batches:
    """The batches of the slice ``nodes`` (program order). ``decided``: nodes another pass
    decided how to run; ``shared``: storage roots that may share storage with another
    (``passes.roots.shared_roots``); ``device_map``: where an absent device's nodes run;
    ``kernels``: portable mode's compiled fills (``plan.kernels``)."""
    members = set(nodes)
    kernels = kernels or {}
    fills: dict[fx.Node, BatchedFill] = {}
    touching: set[fx.Node] = set()
    queued: set[int] = set()  # storages a batched fill writes
    for n in nodes:
        if not is_random(n) or n in decided:
            continue
        if not queued.isdisjoint(n.meta.get("mutates", ())):
            continue  # a second fill of a storage (dead-write elimination off): in order, after the batch
        fill = _exact_fill(n) if rng == "exact" else _portable_fill(n)
        target = n.args[fill.index] if fill is not None else None
        if not isinstance(target, fx.Node) or not allocates(target) or target in shared or target not in members:
            continue
        spec = target.meta.get("spec")
        if spec is None or not spec.is_contiguous():
            continue
        if device_map:
            spec = spec._replace(device=device_map.get(spec.device, spec.device))
        if not (_exact_batchable(fill, spec) if rng == "exact" else _portable_batchable(spec, kernels.get(n))):
            continue
        fills[n] = fill
        queued.update(n.meta.get("mutates", ()))
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


def _exact_fill(n: fx.Node) -> BatchedFill | None:
    call = fill_call(n)
    native = native_kind(call) if call is not None and call.bounds is None else None
    return BatchedFill(native[0], native[1], call.index, call.key) if native is not None else None


def _portable_fill(n: fx.Node) -> BatchedFill | None:
    """``normal_``/``uniform_`` with plain numbers, whatever generator eager drew from."""
    if n.target not in NATIVE_FILLS or any(isinstance(a, fx.Node) for a in (*n.args[1:], *n.kwargs.values())):
        return None
    call = FillCall(n.target, 0, tuple(n.args[1:]), {k: v for k, v in n.kwargs.items() if k != "generator"}, "")
    native = native_kind(call)
    return BatchedFill(native[0], native[1], 0, None) if native is not None else None


def _exact_batchable(fill: BatchedFill, spec: TensorSpec) -> bool:
    return spec.device.type == "cpu" and batchable(fill.kind, spec.dtype, spec.numel)


def _portable_batchable(spec: TensorSpec, kernel: Kernel | None) -> bool:
    if kernel is not None:  # fxinit's own kernels take a table of fills
        return kernel.backend in TABLE_BACKENDS and not kernel.chain and kernel.cast is None and spec.numel > 0
    return spec.device.type == "cpu" and portable.batchable(spec.dtype, spec.numel)
