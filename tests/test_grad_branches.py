"""Spectral values in a constructor, bit for bit: torch's composites compute singular values and
eigenvalues without vectors unless autograd may need them, and while fxinit records, C++ took
every input for one that might (``capture.grad_branches``). Each case runs under
``torch.no_grad()`` (eager: values only) and with gradients on a parameter (eager: the vectors'
path), inside the constructor and as an init step after the trace."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn

import fxinit
from tests.conftest import assert_same_as_eager

CASES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "svdvals": lambda w: torch.linalg.svdvals(w),
    "eigvalsh": lambda w: torch.linalg.eigvalsh(w @ w.T),
    "eigvalsh_upper": lambda w: torch.linalg.eigvalsh(w @ w.T, UPLO="U"),
    "eigvals": lambda w: torch.view_as_real(torch.linalg.eigvals(w)),
    "matrix_norm_2": lambda w: torch.linalg.matrix_norm(w, ord=2).reshape(1),
    "matrix_norm_nuc": lambda w: torch.linalg.matrix_norm(w, ord="nuc").reshape(1),
    "linalg_norm_-2": lambda w: torch.linalg.norm(w, ord=-2).reshape(1),
    "torch_norm_nuc": lambda w: torch.norm(w, p="nuc").reshape(1),
    "tensor_norm_nuc": lambda w: w.norm(p="nuc").reshape(1),
    "nuclear_norm": lambda w: torch.nuclear_norm(w).reshape(1),
    "cond": lambda w: torch.linalg.cond(w).reshape(1),
    "svd_values_only": lambda w: torch.svd(w, compute_uv=False).S,
    "batched_svdvals": lambda w: torch.linalg.svdvals(w.reshape(9, 11, 11)[:, :, :7]),
}


class Spectral(nn.Module):
    def __init__(self, case: str, grad: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(33, 33))
        nn.init.normal_(self.w)
        if grad:  # the parameter requires grad and grad mode is on: eager computes the vectors
            self.register_buffer("values", CASES[case](self.w).detach())
        else:
            with torch.no_grad():
                self.register_buffer("values", CASES[case](self.w))
                self.w /= torch.linalg.matrix_norm(self.w, ord=2)  # spectral scaling, as initializers do


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
@pytest.mark.parametrize("case", CASES)
def test_spectral_values_in_a_constructor_equal_eager(case: str, grad: bool) -> None:
    assert_same_as_eager(Spectral, case, grad, seeds=(0,))


def test_a_spectral_init_step_after_the_trace_equals_eager() -> None:
    def rescale(m: nn.Module) -> None:
        with torch.no_grad():
            for p in m.parameters():
                if p.dim() == 2:
                    p /= torch.linalg.matrix_norm(p, ord=2)

    assert_same_as_eager(lambda: nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 8)), seeds=(0,), post=rescale)


def test_other_threads_and_real_tensors_keep_torchs_own_path() -> None:
    """The kernels stay registered with torch's Python dispatcher: used by anyone else (here,
    outside a recording), they run torch's own composite, so values stay torch's."""
    from torch._dispatch.python import enable_python_dispatcher

    from fxinit.capture import grad_branches

    torch.manual_seed(0)
    fxinit.materialize(fxinit.trace_init(Spectral, "svdvals", False))  # registers the kernels
    assert grad_branches._registered()
    a = torch.randn(20, 20)
    plain = torch.linalg.svdvals(a), torch.linalg.eigvalsh(a @ a.T), torch.linalg.eigvals(a)
    with enable_python_dispatcher():
        routed = torch.linalg.svdvals(a), torch.linalg.eigvalsh(a @ a.T), torch.linalg.eigvals(a)
    assert all(torch.equal(x, y) for x, y in zip(plain, routed))
