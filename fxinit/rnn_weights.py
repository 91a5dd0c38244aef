"""RNNs' weak references to their flat weights, which ``torch.utils.swap_tensors`` refuses:
the modules that hold them, and the references dropped for a swap and made again after it.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch

from fxinit.capture.deferred import state_of
from fxinit.module_to import Location


def weakref_holders(where: dict[int, list[Location]], tensors: list[torch.Tensor]) -> list[torch.nn.Module]:
    """Modules that keep weak references to the tensors being swapped (RNNs' flat weights).

    ``swap_tensors`` refuses tensors with weak references; like ``RNNBase._apply``, the
    references are dropped for the swap and made again after it (``weak_references_dropped``),
    so that torch's own swap runs, which also takes a parameter that a gradient graph reaches
    (``capture.swap`` keeps weak references but takes only tensors nothing else holds). A
    tensor materialized on its own is looked up in the modules of the model it was traced
    with and of its deep copies (``AveragedModel``'s, ``prepare_qat``'s); an RNN elsewhere
    keeps its references through ``capture.swap``.
    """
    mods = {id(mod): mod for places in where.values() for mod, _, _ in places if _holds_refs(mod)}
    referenced = {id(t) for t in tensors if weakref.getweakrefs(t)}
    if not referenced:
        return list(mods.values())
    recorders = {id(rec): rec for t in tensors if (rec := state_of(t).recorder)}.values()
    models = {id(m): m for rec in recorders for m in (rec.root, *(r() for r in rec.copies)) if m is not None}
    for model in models.values():
        for mod in model.modules():
            if _holds_refs(mod) and any(r is not None and id(r()) in referenced for r in mod._flat_weight_refs):
                mods[id(mod)] = mod
    return list(mods.values())


def _holds_refs(mod: torch.nn.Module) -> bool:  # (a module's missing attribute raises, slowly: read its dict)
    return "_flat_weight_refs" in mod.__dict__ and hasattr(type(mod), "_init_flat_weights")


@contextlib.contextmanager
def weak_references_dropped(holders: list[torch.nn.Module]) -> Iterator[None]:
    """Drop ``holders``' weak references to their flat weights for the swaps inside, as
    ``RNNBase._apply`` does, then make each again as it was: to the same object (the swaps keep
    every object), dead where it was dead (an RNN given other weights since: its next forward
    reads them again, as eager's), and flatten the weights as ``_init_flat_weights`` would
    (cuDNN's one buffer; nothing on the CPU). ``_init_flat_weights`` itself would read each
    weight again: a parametrized one (``spectral_norm``) would run its parametrization, which
    eager never ran there, and the list would hold the result where eager's holds the parameter."""
    was = [[_DEAD if r is not None and r() is None else (r() if r is not None else None)
            for r in mod._flat_weight_refs] for mod in holders]
    for mod in holders:
        mod._flat_weight_refs = []
    try:
        yield
    finally:
        for mod, targets in zip(holders, was):
            mod._flat_weight_refs = [None if w is None else _dead_reference() if w is _DEAD else weakref.ref(w)
                                     for w in targets]
            mod.flatten_parameters()


_DEAD = object()


class _Gone:
    """An object no one holds: a weak reference to one is dead at once."""


def _dead_reference() -> weakref.ReferenceType:
    return weakref.ref(_Gone())
