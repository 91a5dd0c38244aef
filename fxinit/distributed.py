"""Materializing sharded parameters: DTensors (FSDP2's ``fully_shard``, ``distribute_tensor``)
whose local shard is still deferred.

``fully_shard`` on a traced model works on the deferred tensors like any other code: the
chunking and padding it does are recorded, and each parameter becomes a DTensor whose local
tensor is deferred. Materializing computes each rank's local shard from the init graph
(exact: equal to the matching slice of eager construction; portable: the stream values of
the full tensor's elements) and installs a new DTensor parameter the way ``to_empty``
does, so FSDP2's lazy init re-reads it (``FSDPParam.reset_sharded_param``).
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch

from fxinit.capture.deferred import dressed_as, state_of
from fxinit.capture.dtensor import is_deferred_dtensor
from fxinit.capture.layout import Runs, local_runs
from fxinit.reachable import Slot
from fxinit.spec import dtype_after_to

DTensorPlace = tuple[torch.nn.Module, str, str]  # (module, "_parameters" | "_buffers", name)


def deferred_dtensors(module: torch.nn.Module, walk: Iterable[Slot] | None = None
                      ) -> dict[int, tuple[Any, list[DTensorPlace]]]:
    """``{id(dtensor): (dtensor, [(module, kind, name), ...])}`` for deferred DTensors among the
    parameters and buffers under ``module`` (whose ``reachable.module_walk`` is ``walk``, if known)."""
    if walk is None:
        walk = ((None, mod, kind, name, t) for mod in module.modules() for kind in ("_parameters", "_buffers")
                for name, t in getattr(mod, kind).items())
    found: dict[int, tuple[Any, list[DTensorPlace]]] = {}
    for _, mod, kind, name, t in walk:
        if kind in ("_parameters", "_buffers") and is_deferred_dtensor(t):
            found.setdefault(id(t), (t, []))[1].append((mod, kind, name))
    return found


def held_elsewhere(entries: dict[int, tuple[Any, list[DTensorPlace]]]) -> None:
    """Add to ``entries`` the places outside the materialized module that hold the same
    DTensors, under their trace's root: a weight tied across modules (``emb.weight =
    head.weight``) stays one parameter when the modules are materialized one at a time."""
    roots = {id(root): root for dt, _ in entries.values()
             if (root := state_of(dt._local_tensor).recorder.root) is not None}
    for root in roots.values():
        for mod in root.modules():
            for kind in ("_parameters", "_buffers"):
                for name, t in getattr(mod, kind).items():
                    places = entries[id(t)][1] if id(t) in entries else None
                    if places is not None and not any(m is mod and k == kind and n == name for m, k, n in places):
                        places.append((mod, kind, name))


def local_part(dt: Any, read: Callable[[tuple[slice, ...]], torch.Tensor]) -> torch.Tensor:
    """This rank's part of the full tensor behind ``dt``, from ``read(index)`` of blocks of
    the full tensor (a checkpoint reads only those): one block per run of positions the
    placements give this rank (``capture.layout``), strided shards included."""
    runs = local_runs(dt.shape, dt.placements, dt.device_mesh.shape, dt.device_mesh.get_coordinate())
    return _read_runs(read, runs, [])


def _read_runs(read: Callable[[tuple[slice, ...]], torch.Tensor], runs: list[Runs], fixed: list[slice]
               ) -> torch.Tensor:
    dim = len(fixed)
    if all(len(r) == 1 for r in runs[dim:]):
        return read(tuple(fixed) + tuple(slice(*r[0]) for r in runs[dim:]))
    pieces = runs[dim] or [(0, 0)]
    return torch.cat([_read_runs(read, runs, fixed + [slice(lo, hi)]) for lo, hi in pieces], dim=dim)


def materialize_dtensors(entries: dict[int, tuple[Any, list[DTensorPlace]]], device: torch.device | str | None,
                         init: bool, compute: Callable[[Any, list[torch.Tensor], Callable[[int], str]],
                                                       list[torch.Tensor]],
                         dtype: torch.dtype | None = None,
                         loaded: dict[int, Callable[[], torch.Tensor]] | None = None) -> None:
    """Compute every entry's local shard (``compute(recorder, locals, describe)``, which applies
    ``dtype``; ``describe(i)`` names the i-th in errors), or read it (``loaded``: ``id(dtensor)``
    -> reader of its local part of a checkpoint tensor), then install new DTensors; nothing is
    installed if anything fails.
    ``dtype`` casts floating-point and complex shards, as ``Module.to`` would."""
    loaded = loaded or {}
    by_recorder: dict[int, tuple[Any, list[Any]]] = {}
    read: list[tuple[Any, list[DTensorPlace]]] = []
    for dt, places in entries.values():
        if id(dt) in loaded:
            read.append((dt, places))
            continue
        rec = state_of(dt._local_tensor).recorder
        by_recorder.setdefault(id(rec), (rec, []))[1].append((dt, places))
    target = torch.device(device) if device is not None else None
    done: list[tuple[Any, list[DTensorPlace], torch.Tensor]] = []
    for rec, items in by_recorder.values():
        locals_ = [dt._local_tensor for dt, _ in items]
        if init:
            values = compute(rec, locals_, lambda i: _describe(rec, *items[i]))
        else:
            values = [torch.empty_strided(t.size(), t.stride(), device=target or state_of(t).device,
                                          dtype=dtype_after_to(t.dtype, dtype)) for t in locals_]
        done += [(dt, places, value) for (dt, places), value in zip(items, values)]
    for dt, places in read:
        local = dt._local_tensor
        value = loaded[id(dt)]()
        if tuple(value.shape) != tuple(local.shape):
            raise RuntimeError(f"fxinit: a checkpoint part of shape {tuple(value.shape)} for a local shard of "
                               f"{tuple(local.shape)}")
        done.append((dt, places, value.to(dtype_after_to(local.dtype, dtype)).contiguous()))
    from torch.distributed.tensor import DTensor  # imported already: these are DTensors

    plan = [(dt, places, value.to(device if device is not None else _mesh_device(dt))) for dt, places, value in done]
    for dt, places, value in plan:
        new = dressed_as(dt, DTensor.from_local(value, dt.device_mesh, dt.placements, run_check=False,
                                                shape=dt.shape, stride=dt.stride()))
        if not places:  # ``materialize(dtensor)``: that object, filled
            torch.utils.swap_tensors(dt, new)
        for mod, kind, name in places:
            getattr(mod, kind)[name] = new


def _describe(rec: Any, dt: Any, places: list[DTensorPlace]) -> str:
    mod, _, name = places[0]
    path = rec.module_paths().get(id(mod))
    where = f"{path}.{name}" if path else f"{type(mod).__name__}.{name}"
    return f"{where.lstrip('.')} (placements {tuple(dt.placements)})"


def _mesh_device(dt: Any) -> torch.device:
    kind = dt.device_mesh.device_type
    if kind == "cpu":
        return torch.device("cpu")
    module = getattr(torch, kind)
    return torch.device(kind, module.current_device())
