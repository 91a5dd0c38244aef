"""Putting a materialized value into the user's tensor object: ``torch.utils.swap_tensors``,
and where the object has weak references, a swap that keeps them.

``swap_tensors`` refuses an object that weak references point to. Model code keeps such
references (``weakref.ref(self.lin.weight)``, ``torch.utils.weak.WeakTensorKeyDictionary``,
``weakref.finalize``), and so do RNNs (their flat weights). In eager construction each of them
points to the tensor object the model holds; the object fxinit swaps the value into is that
object, so the references stay right as they are: they point to it, and it now holds the
value. Putting a new object in the module's place instead would leave every other holder of
the old one (an optimizer built in ``__init__``) with a deferred tensor.
"""

from __future__ import annotations

import copyreg
import weakref

import torch


def swap(t: torch.Tensor, new: torch.Tensor, saved: bool = False) -> None:
    """Swap ``new``'s value, class and attributes into ``t`` (the same object after, as for
    ``torch.utils.swap_tensors``), whether or not weak references point to ``t``. ``saved``:
    autograd graphs that fxinit rebuilt may hold ``new`` (``autograd_links``: a tensor computed
    from it saved it), which then hold ``t``, as eager's hold that tensor.

    >>> import weakref, torch
    >>> t, new = torch.zeros(2), torch.ones(2)
    >>> r = weakref.ref(t)
    >>> swap(t, new)
    >>> r() is t and t.tolist() == [1.0, 1.0]
    True
    """
    held = saved and new._use_count() > 1
    if weakref.getweakrefs(new) or not (weakref.getweakrefs(t) or held):
        torch.utils.swap_tensors(t, new)
        return
    for x, which in ((t, "the tensor"),) + (() if held else ((new, "its value"),)):
        if x._use_count() != 1:  # (an autograd graph, a view or a C++ holder keeps it: its impl cannot change)
            raise RuntimeError(f"use_count of {which} is {x._use_count()}, not 1: something else holds it")
    if copyreg._slotnames(type(t)) or copyreg._slotnames(type(new)):  # type: ignore[attr-defined]
        raise RuntimeError("Cannot swap a tensor that has weakref associated with it and slots")
    t.__class__, new.__class__ = new.__class__, t.__class__
    t.__dict__, new.__dict__ = new.__dict__, t.__dict__
    torch._C._swap_tensor_impl(t, new)
