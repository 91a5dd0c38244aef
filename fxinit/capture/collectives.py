"""The collectives torch.distributed runs on deferred tensors while it lays a model out.

``distribute_tensor`` (and so ``parallelize_module`` and ``distribute_module``) splits the
full tensor on every rank and then scatters the source rank's pieces (``mesh_scatter``),
or broadcasts it for ``Replicate`` (``mesh_broadcast``; ``DTensor.from_local`` with
``run_check`` too). Both skip the communication when the tensor says it is meta, which a
deferred tensor does after capture: the receiving buffer would then hold memory nobody
wrote. Under fxinit every rank has recorded the same init graph, so the source rank's
piece for this rank is this rank's own piece of its own copy: the scatter is recorded as a
copy of it, and the broadcast needs nothing. That holds only if the ranks did record the
same values (the same seed, the same code): they compare digests of what they scatter
(``passes.fingerprint``) at the point where eager would communicate, and refuse otherwise.

Any other collective on a deferred tensor (``redistribute``, ``full_tensor``, a
``dist.broadcast`` of a parameter) is refused by the recorder: replaying communication
at materialization would need every rank to materialize the same tensors in the same order.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch

from fxinit.capture.deferred import IS_META_ANSWERS, state_of
from fxinit.capture.post_import import when_imported
from fxinit.errors import DeferredInitError


def _scatter(frame: types.FrameType, t: torch.Tensor) -> bool | None:
    local = frame.f_locals
    if local.get("output") is not t:
        return None
    mesh, mesh_dim, src = local["mesh"], local.get("mesh_dim", 0), local.get("group_src", 0)
    pieces = list(local["scatter_list"])
    _check_same_on_every_rank(t, pieces, mesh, mesh_dim, src, "scatter")
    with torch.no_grad():
        t.copy_(pieces[mesh.get_local_rank(mesh_dim)])
    return True


def _broadcast(frame: types.FrameType, t: torch.Tensor) -> bool | None:
    local = frame.f_locals
    if local.get("tensor") is not t:
        return None
    _check_same_on_every_rank(t, [t], local["mesh"], local.get("mesh_dim", 0), local.get("group_src", 0),
                              "broadcast")
    return True


def _check_same_on_every_rank(t: torch.Tensor, tensors: list[torch.Tensor], mesh: Any, mesh_dim: int, src: int,
                              what: str) -> None:
    rec = state_of(t).recorder
    group = mesh.get_group(mesh_dim)
    mine = rec.fingerprint(tensors)
    everyone: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(everyone, mine, group=group)
    differ = [i for i, d in enumerate(everyone) if d != everyone[src]]
    if differ:  # every rank of the group refuses, the source rank too
        raise DeferredInitError(
            f"fxinit cannot {what} a deferred tensor from rank {src} of mesh dimension {mesh_dim}: ranks {differ} "
            "recorded different values for it (a different seed or different code), so this rank cannot compute "
            "the source rank's values", op=f"distribute_tensor ({what})",
            hint="seed every rank alike before trace_init (torch.manual_seed(seed) on all ranks), or materialize "
                 "before distributing")


def _register(cu: types.ModuleType) -> None:
    answers: dict[Any, Callable[[types.FrameType, torch.Tensor], bool | None]] = {
        cu.mesh_scatter.__code__: _scatter,
        cu.mesh_broadcast.__code__: _broadcast,
    }
    IS_META_ANSWERS.update(answers)


when_imported("torch.distributed.tensor._collective_utils", _register)
