"""Kept views made views again after ``materialize``.

Eager's ``self.k = self.cache[0]`` (or ``self.v = torch.zeros(8)[2:]``) is a view: its
``_base`` is the tensor it was taken from, and an in-place write to it with autograd on (a cache
filled in ``forward``: ``self.k[1] = self.lin(x)``) gives that base a ``CopySlices``, so a
backward through the base (``self.cache.sum()``) reaches the write's inputs. The values
``materialize`` swaps in alias one storage as eager's do, but as tensors of their own: the
write's history stayed on ``k``, and a backward through ``cache`` found nothing (or a gradient
went missing, silently). So each swapped-in view without a ``grad_fn`` is made a view of its
base again: a leaf, as eager's (made under ``no_grad``, whatever its base requires since), with the
``CreationMeta`` eager's has (a view made under ``no_grad`` or ``inference_mode``, or one of
``unbind``'s outputs, refuses in-place writes with autograd, in eager as here). Its base is the
tensor eager's is: the kept tensor it was taken from (which ``companions`` materializes with it),
or, for a temporary the constructor dropped, one stand-in per temporary on the same memory.

Views with a ``grad_fn`` are ``autograd_links``' (rebuilt with it). A tensor subclass's view is
``as_subclass`` of the view, as the results of a subclass's ops are in eager.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

import torch

from fxinit.capture.deferred import is_deferred_tensor, plain_attributes
from fxinit.capture.swap import swap
from fxinit.passes.ranges import storage_extent
from fxinit.spec import TensorSpec

_CREATION_META = torch._C._autograd._get_creation_meta
_SET_CREATION_META = torch._C._autograd._set_creation_meta
_NO_GRAD = torch._C._autograd.CreationMeta.NO_GRAD_MODE


@dataclasses.dataclass
class KeptView:
    """A view among the tensors being materialized, as the capture made it."""

    tensor: torch.Tensor  # deferred until the swap, then the value's object
    base: torch.Tensor  # eager's ``_base``: a deferred tensor (kept, or a dropped temporary)
    creation: Any  # how autograd says it was made (``CreationMeta``: grad mode, inference mode, unbind's)


def kept_views(tensors: list[torch.Tensor]) -> list[KeptView]:
    """The views among deferred ``tensors`` that ``remake_views`` makes views again (read before the swap)."""
    out = []
    with plain_attributes():
        for t in tensors:
            if not is_deferred_tensor(t) or not t._is_view():
                continue
            base = t._base
            try:
                kept = KeptView(t, base, _CREATION_META(t))
            except RuntimeError:  # (not a view autograd knows: a dtype view)
                continue
            if t.grad_fn is None:  # (one with a ``grad_fn`` is ``autograd_links``')
                out.append(kept)
    return out


def remake_views(views: list[KeptView]) -> None:
    """After the swap: make each of ``views`` (real now, a tensor of its own) a view of its base
    again, on the same memory. One that cannot be (still deferred, another class now, memory
    apart from its base's, something holding it) stays as it was swapped in."""
    stand_ins: dict[int, torch.Tensor] = {}
    with torch._C.DisableTorchFunctionSubclass():  # (fxinit's reads, not the model's: a subclass's log stays eager's)
        for kept in views:
            _remake(kept, stand_ins)


def _remake(kept: KeptView, stand_ins: dict[int, torch.Tensor]) -> None:
    """``kept``'s tensor made a view of its base (``stand_ins``: those of dropped temporaries, by id)."""
    t, base = kept.tensor, kept.base
    if is_deferred_tensor(t) or isinstance(t, torch.nn.Parameter) or t._is_view() or t.grad_fn is not None \
            or _memory(t) is None:
        return
    if is_deferred_tensor(base):  # a temporary eager's view alone keeps alive
        base = stand_ins.get(id(kept.base))
        if base is None:
            base = stand_ins[id(kept.base)] = _stand_in(kept.base, t)
    if base is None or base._is_view() or base.device != t.device or _memory(base) != _memory(t):
        return
    with torch.no_grad():  # (a leaf, as eager's: without a ``grad_fn`` whatever its base requires now)
        view = _view_like(base, t)
        if view is None:
            return
        if view.is_conj() != t.is_conj():
            view = view.conj()
        if view.is_neg() != t.is_neg():
            view = torch._neg_view(view)
        if type(t) is not torch.Tensor:  # (a subclass's ops return ``as_subclass`` of theirs: a view too)
            view = view.as_subclass(type(t))
    if t.requires_grad and not view.requires_grad:  # (``requires_grad_()`` since)
        view.requires_grad_(True)
    if view.is_conj() != t.is_conj() or view.is_neg() != t.is_neg() or view._base is not base \
            or view.requires_grad != t.requires_grad:
        return
    if kept.creation != _NO_GRAD:  # (made with grad on; ``unbind``'s outputs, views made under inference_mode)
        with contextlib.suppress(RuntimeError):  # (no view autograd knows: integer elements)
            _SET_CREATION_META(view, kept.creation)
    view.__dict__.update(t.__dict__)
    with contextlib.suppress(RuntimeError):  # (held by an autograd graph or a C++ holder: its impl cannot change)
        swap(t, view)


def _memory(t: torch.Tensor) -> int | None:
    """The address of ``t``'s memory, None for none (a wrapper subclass's)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


def _view_like(base: torch.Tensor, t: torch.Tensor) -> torch.Tensor | None:
    """A view of ``base`` with ``t``'s dtype, size, strides and offset (through ``view_as_real``
    or ``view_as_complex`` where the dtype changes so), or None."""
    size, stride, offset = t.size(), t.stride(), t.storage_offset()
    try:
        if base.dtype == t.dtype:
            return base.as_strided(size, stride, offset)
        if base.is_complex() and not base.is_conj() and t.dtype == base.dtype.to_real():
            return torch.view_as_real(base).as_strided(size, stride, offset)
        if t.is_complex() and base.dtype == t.dtype.to_real():
            return torch.view_as_complex(base.as_strided((*size, 2), tuple(2 * s for s in stride) + (1,), 2 * offset))
    except RuntimeError:
        pass
    return None  # (``view(dtype)`` makes a view autograd does not relate to ``base``)


def _stand_in(deferred: torch.Tensor, view: torch.Tensor) -> torch.Tensor | None:
    """A real tensor in the place of ``deferred`` (a temporary), on the memory of ``view``."""
    with plain_attributes():
        spec = TensorSpec.of(deferred, view.device)
    storage, extent = view.untyped_storage(), storage_extent(spec)
    if extent is None or extent[1] * spec.dtype.itemsize > storage.nbytes():
        return None
    return torch.empty(0, dtype=spec.dtype, device=view.device).set_(storage, spec.storage_offset, spec.shape,
                                                                     spec.stride)
