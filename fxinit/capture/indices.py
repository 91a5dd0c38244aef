"""Python sequences used as indices of a deferred tensor: index tensors made as eager makes them.

``w[[1, 5]] = 0.0`` and ``w[[0, 2], :]``: torch turns each list (or numpy array) of an index
into an index tensor on the indexed tensor's device, in C++, with the tensor's options. For
a deferred tensor those options say ``meta``, so the index came out as a plain meta tensor
without values, mixed into the recording. Here such sequences become CPU index tensors
before torch sees them, by torch's own rules (``treatSequenceAsTuple`` and
``sequenceToVariable`` in ``torch/csrc/autograd/python_variable_indexing.cpp``): a list of
fewer than 32 items holding a tensor, a sequence, a slice, ``None`` or ``...`` is a tuple of
indices (as long as this torch still does so: asked of it at import); any other list, and
each sequence inside a tuple, is one index tensor, of ``bool`` or ``uint8`` where its items
are, else ``int64`` (floats truncated from double precision). Indexing with a CPU index
tensor gives the same elements on every device. Sequences torch would not turn into an
index that way (complex numbers, tensors inside a long list) are left to torch.

>>> as_index([1, 5])
tensor([1, 5])
>>> as_index(([0, 2], slice(None)))
(tensor([0, 2]), slice(None, None, None))
>>> as_index([[0, 1], slice(None)])  # a list holding a list: a tuple of indices
(tensor([0, 1]), slice(None, None, None))
>>> as_index((0, slice(1, 3)))  # nothing to convert: the same object
(0, slice(1, 3, None))
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

#: what torch's ``PySequence_Check`` finds among indices (strings aside: torch refuses them)
_SEQUENCES = (list, tuple, range, np.ndarray)
_TUPLE_BELOW = 32  # torch's (and NumPy's) heuristic looks at lists this short only
_INDEX_DTYPES = (torch.int64, torch.bool, torch.uint8)


def as_index(index: Any) -> Any:
    """``index`` (what ``w[index]`` was given) with its Python sequences as CPU index tensors,
    or ``index`` itself where it holds none."""
    if isinstance(index, np.ndarray):
        return _index_tensor(index)
    if not isinstance(index, tuple):  # a namedtuple is a tuple to torch too
        if not isinstance(index, _SEQUENCES):
            return index
        if len(index) >= _TUPLE_BELOW or not _LISTS_AS_TUPLES or not any(_tuple_item(x) for x in index):
            return _index_tensor(index)
    if not any(isinstance(x, _SEQUENCES) for x in index):
        return index
    return tuple(_index_tensor(x) if isinstance(x, _SEQUENCES) else x for x in index)


def _lists_as_tuples() -> bool:
    """Whether this torch still takes a short list holding a sequence as a tuple of indices
    (deprecated since 2.4: "will be interpreted as tensor index"): asked of torch itself."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return FACTORIES.zeros(2, 2)[[[0, 1], [1, 0]]].dim() == 1


_LISTS_AS_TUPLES = _lists_as_tuples()


def _tuple_item(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, slice, *_SEQUENCES)) or x is None or x is Ellipsis


def _index_tensor(seq: Any) -> Any:
    """``seq`` as the index tensor torch makes of it (on the CPU), or ``seq`` where torch's
    own conversion should speak (it would refuse it, or it holds tensors)."""
    if not isinstance(seq, np.ndarray) and any(isinstance(x, torch.Tensor) for x in seq):
        if not all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in seq):
            return seq  # larger tensors: torch's conversion speaks
        seq = [x.item() for x in seq]  # their numbers, as torch reads them (a deferred one's exactly)
    try:
        t = FACTORIES.as_tensor(seq, device="cpu") if isinstance(seq, np.ndarray) else FACTORIES.tensor(seq, device="cpu")
    except (TypeError, ValueError, RuntimeError):
        return seq
    if t.dtype.is_complex:
        return seq
    if t.dtype.is_floating_point:  # torch truncates Python floats to int64, from double precision
        t = torch.as_tensor(seq, dtype=torch.float64, device="cpu")
        return t.long() if bool(t.isfinite().all()) else seq
    return t if t.dtype in _INDEX_DTYPES else t.long()
