"""Python lists and numpy arrays as indices of deferred tensors (``capture.indices``).

``w[[1, 5]] = 0.0`` was refused, during the trace and after it: torch made the index tensor
on the deferred tensor's device, which is meta underneath (found by a hunt, through peft's
``trainable_token_indices``). Each form is compared with eager construction, in the
constructor and in an init step after the trace, under the CPU default and a device context.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxinit
from conftest import assert_same_as_eager

Index = collections.namedtuple("Index", "rows cols")  # a tuple to torch

# each edits w (10 x 4) in place and keeps a value read through an index
EDITS = {
    "list": lambda w: w.__setitem__([1, 5], 0.0),
    "list of tensors value": lambda w: w.__setitem__([0, 2], torch.ones(2, 4)),
    "bool list": lambda w: w.__setitem__([True, False] * 5, 1.5),
    "list and slice": lambda w: w.__setitem__(([0, 3], slice(1, 3)), -1.0),
    "list holding a list": lambda w: w.__setitem__([[0, 1], [2, 3]], 7.0),  # a tuple of two index lists
    "nested list": lambda w: w.__setitem__([[1, 2], [0, 3]], 2.0),
    "floats": lambda w: w.__setitem__([1.7, -2.5, 3.0], 4.0),
    "long list": lambda w: w.__setitem__(list(range(0, 10)) * 4, 3.0),  # 40 items: one index tensor
    "numpy int32": lambda w: w.__setitem__(np.array([4, 9], dtype=np.int32), 5.0),
    "numpy bool": lambda w: w.__setitem__(np.arange(10) % 3 == 0, 6.0),
    "negative": lambda w: w.__setitem__([-1, -3], 8.0),
    "range": lambda w: w.__setitem__((range(2), slice(1, None)), 9.0),
    "namedtuple": lambda w: w.__setitem__(Index([0, 7], slice(None)), 1.25),
    "list of 0-dim tensors": lambda w: w.__setitem__(([torch.tensor(1), torch.tensor(4)], slice(2)), 0.5),
}
READS = {
    "getitem list": lambda w: w[[1, 5, 7]] * 2,
    "getitem rows and cols": lambda w: w[[0, 2], [1, 3]],
    "getitem list then slice": lambda w: w[[9, 8], 1:],
    "getitem numpy": lambda w: w[np.array([3, 3, 1])],
}


def _model(edit, read, after: bool):
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.e = nn.Embedding(10, 4)
            if not after:
                init(self)

    def init(m: nn.Module) -> None:
        with torch.no_grad():
            edit(m.e.weight)
            m.register_buffer("read", read(m.e.weight).clone())

    return M, (init if after else None)


@pytest.mark.parametrize("after", [False, True], ids=["in __init__", "after the trace"])
@pytest.mark.parametrize("edit", EDITS, ids=list(EDITS))
def test_sequence_indices_equal_eager(edit, after) -> None:
    factory, post = _model(EDITS[edit], READS["getitem list"], after)
    assert_same_as_eager(factory, post=post, seeds=(0,), orders=("whole",))


@pytest.mark.parametrize("read", READS, ids=list(READS))
def test_reads_through_sequence_indices(read) -> None:
    factory, _ = _model(EDITS["list"], READS[read], False)
    assert_same_as_eager(factory, seeds=(0,), orders=("whole", "reverse"))


def test_under_a_device_context() -> None:
    factory, _ = _model(EDITS["list and slice"], READS["getitem rows and cols"], False)
    with torch.device("cpu"):
        report = fxinit.check(factory)
    assert report.ok, report


def test_complex_lists_are_left_to_torch() -> None:
    """torch refuses complex numbers as an index; so does the trace (no guess)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.zeros(4))
            with torch.no_grad():
                self.w[[1j, 2j]] = 1.0

    with pytest.raises(Exception):
        M()
    with pytest.raises(Exception):
        fxinit.materialize(fxinit.trace_init(M))
