"""What goes with the deferred tensors a materialize call was asked for: the model's tensors
over the same storages (one computation, one real storage, as in eager), tensors computed with
autograd and the parameters and buffers their ``grad_fn`` holds (swapped together, or not at
all), tensors held as attributes, and ``.grad``. Each module's places are noted for the swap.
"""

from __future__ import annotations

from typing import Any

import torch

from fxinit.autograd_links import now_real
from fxinit.capture.deferred import is_deferred_tensor, plain_attributes, state_of
from fxinit.capture.recorder import Recorder
from fxinit.capture.storages import storage_references
from fxinit.errors import DeferredInitError
from fxinit.grad_graphs import autograd_leaves, held_tensors
from fxinit.module_to import Location
from fxinit.reachable import Slot, module_walk


def with_companions(tensors: list[torch.Tensor], where: dict[int, list[Location]],
                    walked: dict[int, list[Slot]] | None = None, all_places: bool = True) -> list[torch.Tensor]:
    """Add the traced model's other deferred tensors that must be materialized with ``tensors``.

    Tensors that alias one storage in eager construction (a parameter that is a view of
    another, a buffer aliasing a parameter) must be materialized from one computation to
    alias one real storage too, whichever of them was asked for. Tensors computed with
    autograd from parameters go with the parameters they came from (``autograd_links``), and
    tensors a tensor holds as attributes with it.
    ``all_places``: ``where`` gets every place in the model of the tensors returned (else
    those it has, when nothing else of the model need go with them: ``_alone``).
    """
    walked = {} if walked is None else walked
    out = companions(tensors, where, walked, all_places)
    ids = {id(t) for t in out}
    with plain_attributes():
        derived = [t for t in out if grad_fn_of(t) is not None]
    leaves = [p for t in derived for p in autograd_leaves(t)
              if is_deferred_tensor(p) and id(p) not in ids and now_real(p) is None]  # (made real since: relinked)
    if leaves:
        out = companions(out + leaves, where, walked, all_places)
    have = {id(t) for t in out}
    held = list({id(x): x for t in out for x in vars(t).values()
                 if is_deferred_tensor(x) and id(x) not in have}.values())
    if held:  # tensors a parameter holds as attributes (bitsandbytes' ``Int8Params.SCB``): part of it
        out = companions(out + held, where, walked, all_places)
    with plain_attributes():
        grads = [g for g in map(deferred_grad, out) if g is not None and id(g) not in ids]
    return out + list({id(g): g for g in grads}.values())


def deferred_grad(t: torch.Tensor) -> torch.Tensor | None:
    """``t.grad`` where the constructor gave it one (a ``backward()`` or a ``.grad =`` in
    ``__init__``): it is materialized with ``t``, and is ``t``'s ``.grad`` after, as in eager.
    (Under ``plain_attributes``.)"""
    g = t.grad if t.grad_fn is None else None  # (a tensor that is not a leaf has none, and torch warns)
    return g if g is not None and is_deferred_tensor(g) else None


def _alone(rec: Recorder, tensors: list[torch.Tensor]) -> bool:
    """Whether no other deferred tensor of ``rec``'s model must go with ``tensors``: no other
    tensor holds their storages (each holds a reference; so does the recorder's record of it,
    ``Storages``), nothing else holds them (a ``grad_fn`` that reaches a parameter holds it, a
    view its base: ``_use_count``), and they have no ``grad_fn``. Decided without walking the
    model, which materializing it module by module would walk once per module."""
    with plain_attributes():
        for t in tensors:
            rec.storage_id(t)  # (recorded: the recorder holds it)
            if storage_references(t) != 2 or t._use_count() != 1 or grad_fn_of(t) is not None:
                return False
    return True


def companions(tensors: list[torch.Tensor], where: dict[int, list[Location]],
               walked: dict[int, list[Slot]], all_places: bool = True) -> list[torch.Tensor]:
    """``with_companions``' tensors of one step (``walked``: ``module_walk`` of modules
    already walked, by ``id``; a walk of the model made here is added). The model's deep
    copies (``Recorder.copies``: ``prepare_qat``'s, ``AveragedModel``'s) are walked too: their
    tensors go with each other as the model's do."""
    out = {id(t): t for t in tensors}
    for rec in {id(state_of(t).recorder): state_of(t).recorder for t in tensors}.values():
        models = [m for m in (rec.root, *(r() for r in rec.copies)) if m is not None]  # (alive)
        if not models:
            continue
        mine = [t for t in tensors if state_of(t).recorder is rec]
        wanted = {rec.storage_id(t) for t in mine}
        if not all_places and _alone(rec, mine):
            slots: list[Slot] = []
        else:
            slots = [slot for model in models for slot in _walk(model, walked)]
        held: dict[int, frozenset[int]] = {}
        with plain_attributes():
            while True:  # until nothing more is taken (``nn.Parameter(b)`` of a taken ``b = w.clone()``)
                before = len(out)
                for t in list(out.values()):  # what a computed tensor's ``grad_fn`` holds comes along
                    wanted |= _held_storages(rec, t, held)
                for _, mod, kind, name, t in slots:
                    if not is_deferred_tensor(t):
                        continue
                    # A tensor computed with autograd (weight_norm's or pruning's ``weight``) goes with
                    # any call: its ``grad_fn`` holds the parameters it came from and what it saved (a
                    # mask, a view of a buffer), which could not be swapped while it does; and those
                    # come along with it (above), or it would keep its value without eager's ``grad_fn``.
                    if id(t) not in out and (rec.storage_id(t) in wanted or grad_fn_of(t) is not None):
                        out[id(t)] = t
                    places = where.setdefault(id(t), []) if id(t) in out else None
                    if places is not None and not any(p[0] is mod and p[1] == name for p in places):
                        places.append((mod, name, kind))
                taken = {rec.storage_id(t) for t in out.values() if state_of(t).recorder is rec}
                if taken <= wanted and len(out) == before:
                    break
                wanted |= taken
        for t in rec.adopted:  # `real.data = deferred`: the caller's tensor shares that storage
            if is_deferred_tensor(t) and rec.storage_id(t) in wanted:
                out.setdefault(id(t), t)
    return list(out.values())


def _walk(model: torch.nn.Module, walked: dict[int, list[Slot]]) -> list[Slot]:
    """``module_walk(model)``, once per materialize call."""
    slots = walked.get(id(model))
    if slots is None:
        slots = walked[id(model)] = module_walk(model)
    return slots


def _held_storages(rec: Recorder, t: torch.Tensor, held: dict[int, frozenset[int]]) -> frozenset[int]:
    """The storages of the deferred tensors ``t``'s ``grad_fn`` holds (``held_tensors``; none
    for a tensor not computed with autograd), by ``rec.storage_id``; ``held`` keeps them by
    ``id`` of ``t`` for one call."""
    mine = held.get(id(t))
    if mine is None:
        mine = held[id(t)] = frozenset() if grad_fn_of(t) is None else frozenset(
            rec.storage_id(p) for p in held_tensors(t) if is_deferred_tensor(p) and state_of(p).recorder is rec)
    return mine


def grad_fn_of(t: torch.Tensor) -> Any:
    """``t.grad_fn`` (read under ``plain_attributes``). Refused by name where torch cannot
    answer:

    * a deferred view of a parameter written in place (through another view) and then frozen
      (``requires_grad_(False)``) before anything read the view's ``grad_fn``. torch
      regenerates that ``grad_fn`` by replaying the view on its base (a subclass's views carry
      their view function), gets none since the base requires no grad, and fails an internal
      assert; eager's plain view regenerates an ``AsStridedBackward0`` without inputs, which
      fxinit cannot rebuild;
    * a view made under ``no_grad`` (``p.mul_(m)`` under ``no_grad`` with ``m`` of a tensor
      subclass gives ``p.as_subclass(...)``) whose base requires grad and was written in place
      later: torch refuses its ``grad_fn``, ``is_leaf`` and any use of it with gradients, in
      eager too; fxinit would have to read them to materialize it."""
    try:
        return t.grad_fn
    except RuntimeError as exc:
        stale = "created in no_grad mode" in str(exc)
        if not stale and ("new_fn" not in str(exc) or t._base is None):
            raise
        node = state_of(t).node if is_deferred_tensor(t) else None
        where = dict(op=str(node.target) if node is not None else None,
                     module=node.meta.get("module") if node is not None else None,
                     source=getattr(node.meta.get("prov"), "source", None) if node is not None else None)
        if stale:
            raise DeferredInitError(
                "a deferred view made under torch.no_grad of a tensor that requires grad, written in place "
                "afterwards: torch refuses the view's grad_fn (and is_leaf, and any use of it with gradients), in "
                "eager as well, so fxinit cannot tell how to materialize it", **where,
                hint="make the view after the base's last in-place write, or keep a copy (.clone()) of it") from exc
        raise DeferredInitError(
            "a deferred view of a parameter that was written in place through another view and then frozen "
            "(requires_grad_(False)) before its grad_fn was read: torch cannot regenerate that view's grad_fn "
            "here, and fxinit cannot rebuild the one eager's view has", **where,
            hint="freeze the parameters after materialize, or keep a copy (.clone()) rather than a view of the "
                 "parameter") from exc
