"""Composite ops that choose their kernel by the input's device in C++, run as eager runs
them on the *target* device.

A deferred tensor is meta underneath, so C++ code that asks ``input.is_cuda()`` hears
"no" and takes the CPU branch while recording, whatever device the model is built for. The
capture could instead report the target device to C++ (as torch's ``FakeTensor`` does), but
then every kernel registered for that device would run on fake data here, including on a
machine without that device; fxinit records on meta kernels and runs the branch choice in
Python instead, for the ops that branch. Found by reading torch's sources (2.11-2.15):

- ``aten::dropout`` (``Dropout.cpp``): on CUDA/XPU/lazy/privateuse1 inputs in training with
  ``0 < p < 1`` and elements, ``native_dropout``, a fused kernel that draws differently
  from ``bernoulli_``; ``dropout_`` (``inplace=True``), ``feature_dropout`` and the
  ``alpha_dropout``s always take ``bernoulli_``, on every device (:func:`dropout_call`).
- ``nn.RNNBase.flatten_parameters`` (Python): on CUDA, with cuDNN acceptable, it reads every
  flat weight's ``data_ptr()`` and copies them into one buffer (drawing nothing). Asked of
  deferred weights, ``data_ptr()`` answers 0 for all (they "alias"), so it does nothing;
  materialize flattens the real weights (``RNNBase._init_flat_weights``), as eager did
  (:data:`RAW_ACCESS_ANSWERS` in ``capture.deferred``).
- ``torch.normal`` and the other factories a device context does not list: ``capture.devices``.
"""

from __future__ import annotations

import types
from typing import Any, Callable

import torch
import torch.nn.functional as F

from fxinit.capture.deferred import RAW_ACCESS_ANSWERS, is_deferred_tensor, state_of

_FUSED_DROPOUT_DEVICES = ("cuda", "xpu", "lazy", "privateuseone")


def dropout_call(func: Any, args: tuple, kwargs: dict) -> Callable[[], Any] | None:
    """The call eager makes for ``torch.dropout(input, p, train)`` (or ``F.dropout`` without
    ``inplace``) on a deferred input whose target device takes the fused kernel, or None to
    run ``func`` as it is."""
    if func is torch.dropout:
        names, defaults = ("input", "p", "train"), {}
    elif func is F.dropout:
        names, defaults = ("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False}
    else:
        return None
    bound = defaults | dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    if bound.get("inplace"):
        return None
    x, p, train = bound.get("input"), bound.get("p"), bound.get("train", bound.get("training"))
    if not (is_deferred_tensor(x) and train and isinstance(p, (int, float)) and 0 < p < 1 and x.numel() > 0):
        return None
    if state_of(x).device.type not in _FUSED_DROPOUT_DEVICES:
        return None
    return lambda: torch.native_dropout(x, float(p), True)[0]


def _flatten_codes() -> list[types.CodeType]:
    code = torch.nn.RNNBase.flatten_parameters.__code__
    return [code, *(c for c in code.co_consts if isinstance(c, types.CodeType))]  # its comprehension


RAW_ACCESS_ANSWERS.update({code: 0 for code in _flatten_codes()})
