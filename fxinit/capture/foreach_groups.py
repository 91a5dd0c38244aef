"""Grouping tensors by device for torch's foreach paths, with deferred tensors on their device.

``torch.utils._foreach_utils._group_tensors_by_device_and_dtype`` (``clip_grad_norm_``,
``clip_grad_value_``, optimizers' foreach and fused steps, ``nn.utils`` vector helpers) asks
C++ for the groups, and C++ sees a deferred tensor's meta storage: the group's key said
``meta``. Code then builds its helper tensors on that key (``clip_coef.to(device)``: a plain
meta tensor with no value, which an in-place ``mul_`` of a gradient took as nothing) or
refuses the foreach path (``foreach=True``: "can't use the foreach API on meta tensors").
Eager's key is the tensor's device. While a capture is on (``trace_init``,
``fxinit.recording``), the function torch's wrapper calls answers with the device each
deferred tensor reports (``capture.deferred.reported_device``: the intended device), in
torch's own grouping order; lists without deferred tensors go to torch's C++ as before. Only
then: torch.compile has a rule of its own for torch's function, which a replacement for good
would take from compiled optimizer steps.

    >>> import torch, fxinit
    >>> from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype
    >>> m = fxinit.trace_init(torch.nn.Linear, 2, 2)
    >>> with fxinit.recording(m):
    ...     [device.type for device, _ in _group_tensors_by_device_and_dtype([[m.weight, m.bias]])]
    ['cpu']
"""

from __future__ import annotations

import sys
from typing import Optional

import torch

from fxinit.capture.deferred import is_deferred_tensor, reported_device
from fxinit.capture.patches import WhileCapturing

_GROUP = torch._C._group_tensors_by_device_and_dtype

Groups = dict[tuple[torch.device, torch.dtype], tuple[list[list[Optional[torch.Tensor]]], list[int]]]


def grouped_by_device_and_dtype(tensorlistlist: list[list[Optional[torch.Tensor]]], with_indices: bool) -> Groups:
    """torch's ``_group_tensors_by_device_and_dtype``: the tensors at one index of every list
    go to the group of the first list's tensor there, keyed by its device and dtype."""
    if not any(is_deferred_tensor(t) for tensors in tensorlistlist for t in tensors):
        return _GROUP(tensorlistlist, with_indices)
    caller = sys._getframe(2)  # past torch's Python wrapper
    groups: Groups = {}
    for i, first in enumerate(tensorlistlist[0]):
        if first is None:
            raise RuntimeError("Tensors of the first list of nested Tensor lists are supposed to be defined but "
                               f"the {i}-th Tensor is not.")
        device = reported_device(first, caller) if is_deferred_tensor(first) else first.device
        lists, indices = groups.setdefault((device, first.dtype), ([[] for _ in tensorlistlist], []))
        for out, tensors in zip(lists, tensorlistlist):
            out.append(tensors[i])
        if with_indices:
            indices.append(i)
    return groups


def _install() -> None:
    torch._C._group_tensors_by_device_and_dtype = grouped_by_device_and_dtype  # type: ignore[attr-defined]


def _uninstall() -> None:
    torch._C._group_tensors_by_device_and_dtype = _GROUP  # type: ignore[attr-defined]


#: While capture is on, torch's foreach grouping sees deferred tensors' devices.
deferred_devices = WhileCapturing(_install, _uninstall)
