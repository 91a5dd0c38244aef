"""Spectral values in a constructor, bit for bit: torch's composites compute singular values and
eigenvalues without vectors unless autograd may need them, and while fxinit records, C++ took
every input for one that might (``capture.grad_branches``). Each case runs under
``torch.no_grad()`` (eager: values only) and with gradients on a parameter (eager: the vectors'
path), inside the constructor and as an init step after the trace; functions that ask for
vectors, and torch.linalg's others, must stay as torch runs them."""

from __future__ import annotations

import random
from typing import Callable

import pytest
import torch
import torch.nn as nn

import fxinit
from tests.conftest import assert_same_as_eager, compare_modules

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
    "aten_svdvals": lambda w: torch.ops.aten.linalg_svdvals(w),
    "aten_eigvalsh": lambda w: torch.ops.aten.linalg_eigvalsh.default(w @ w.T),
    "matrix_rank_hermitian": lambda w: torch.linalg.matrix_rank(w @ w.T, hermitian=True).float().reshape(1),
    # functions that ask for vectors themselves keep them
    "svd_values": lambda w: torch.linalg.svd(w).S,
    "torch_svd_values": lambda w: torch.svd(w).S,
    "eigh_values": lambda w: torch.linalg.eigh(w @ w.T).eigenvalues,
    "pinv": lambda w: torch.linalg.pinv(w),
    "pinv_hermitian": lambda w: torch.linalg.pinv(w @ w.T, hermitian=True),
    # and torch.linalg's other functions run as torch runs them
    "linalg_matmul": lambda w: torch.linalg.matmul(w[0], w.reshape(3, 33, 11)),
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


def test_a_forward_mode_gradient_takes_the_vectors_path_as_in_eager() -> None:
    """Eager's test also counts a forward-mode gradient on the input (``dual_level``)."""
    import torch.autograd.forward_ad as fwAD

    class Dual(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(8, 8))
            with torch.no_grad(), fwAD.dual_level():
                dual = fwAD.make_dual(self.w.detach(), torch.ones(8, 8))
                values = fwAD.unpack_dual(torch.linalg.svdvals(dual))
                self.register_buffer("s", values.primal.clone())
                self.register_buffer("ds", values.tangent.clone())
                self.register_buffer("e", torch.view_as_real(torch.linalg.eigvals(self.w.detach())))

    assert_same_as_eager(Dual, seeds=(0,))


def test_real_tensors_computed_while_recording_take_eagers_path() -> None:
    """A tensor from numpy is real, but fxinit's dispatch mode is active while it records, and
    C++ counts that as possibly needing gradients too."""
    import numpy as np

    class FromData(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            a = torch.from_numpy(np.random.default_rng(0).standard_normal((33, 33)).astype(np.float32))
            self.register_buffer("s", torch.linalg.svdvals(a))
            self.register_buffer("n", torch.linalg.matrix_norm(a, ord=2).reshape(1))
            self.register_buffer("e", torch.linalg.eigvalsh(a @ a.T))
            self.register_buffer("v", torch.view_as_real(torch.linalg.eigvals(a)))

    eager = FromData()
    traced = fxinit.materialize(fxinit.trace_init(FromData))  # its buffers stay real tensors
    assert compare_modules(traced, eager) == []


class Eig(nn.Module):
    """Code that depends on the layout of ``linalg_eig``'s eigenvectors (``.contiguous()``
    copies or not)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 5, 5))
        with torch.no_grad():
            vectors = torch.linalg.eig(self.w)[1]
            self.register_buffer("flat", torch.view_as_real(vectors).contiguous().view(-1))
            self.register_buffer("vectors", torch.view_as_real(vectors))


def test_eigenvectors_have_the_cpu_kernels_layout() -> None:
    """torch's meta kernel gives ``linalg_eig``'s eigenvectors row-major, the CPU kernel
    column-major (``capture.layouts``): code that depends on the layout takes eager's path."""
    assert_same_as_eager(Eig, seeds=(0,))


class SvdSplit(nn.Module):
    """OSF's and PiSSA's pattern: the top and bottom rows of ``Vh`` kept apart, and noise like
    one of them (found by a sweep of peft: ``Vh`` was row-major while recording, column-major in
    eager, so ``.contiguous()`` recorded no copy, both buffers shared one storage, and
    ``randn_like`` drew on another path: other values and another global RNG)."""

    def __init__(self, full: bool) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(12, 32))
        with torch.no_grad():
            u, s, vh = torch.linalg.svd(self.w, full_matrices=full)
            self.register_buffer("hi", vh[:4].contiguous())
            self.register_buffer("lo", vh[4:].contiguous())
            self.register_buffer("noise", torch.randn_like(vh[4:]))
            self.register_buffer("v", torch.svd(self.w).V.contiguous().view(-1))


@pytest.mark.parametrize("full", [True, False], ids=["full", "reduced"])
def test_singular_vectors_have_the_cpu_kernels_layout(full: bool) -> None:
    assert_same_as_eager(lambda: SvdSplit(full), seeds=(0,))


_LINALG: dict[str, Callable[[torch.Tensor], object]] = {
    "svd": lambda a: torch.linalg.svd(a), "svd_reduced": lambda a: torch.linalg.svd(a, full_matrices=False),
    "torch_svd": lambda a: torch.svd(a), "eig": lambda a: torch.linalg.eig(a[..., :3, :3]),
    "eigh": lambda a: torch.linalg.eigh(a @ a.mT), "qr": lambda a: torch.linalg.qr(a),
    "qr_complete": lambda a: torch.linalg.qr(a, mode="complete"), "lu": lambda a: torch.linalg.lu(a),
    "lu_factor": lambda a: torch.linalg.lu_factor(a), "cholesky": lambda a: torch.linalg.cholesky(a @ a.mT + 5 * torch.eye(a.shape[-2])),
    "inv": lambda a: torch.linalg.inv(a[..., :3, :3]), "solve": lambda a: torch.linalg.solve(a[..., :3, :3], a[..., :3, :]),
    "pinv": lambda a: torch.linalg.pinv(a), "matrix_exp": lambda a: torch.linalg.matrix_exp(a[..., :3, :3]),
    "ldl_factor": lambda a: torch.linalg.ldl_factor(a @ a.mT + 5 * torch.eye(a.shape[-2])),
    "solve_triangular": lambda a: torch.linalg.solve_triangular(a[..., :3, :3].triu() + 3 * torch.eye(3), a[..., :3, :], upper=True),
}


@pytest.mark.parametrize("shape", [(3, 5), (5, 3), (2, 3, 5)], ids=str)
@pytest.mark.parametrize("name", sorted(_LINALG))
def test_linalg_outputs_have_the_cpu_kernels_strides(name: str, shape: tuple[int, ...]) -> None:
    """Every output of torch.linalg's decompositions, recorded, has the strides the CPU kernel
    gives it in eager (``capture.layouts`` corrects the meta kernel's where they differ)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(*shape))
            with torch.no_grad():
                out = _LINALG[name](self.w)
            self.out = [t for t in (out if isinstance(out, tuple) else (out,)) if isinstance(t, torch.Tensor)]

    torch.manual_seed(0)
    eager = M()
    torch.manual_seed(0)
    traced = fxinit.trace_init(M)
    recorded = [t.stride() for t in traced.out]
    fxinit.materialize(traced)
    assert recorded == [t.stride() for t in eager.out] == [t.stride() for t in traced.out]


_FFTS = {"rfftn": torch.fft.rfftn, "irfftn": torch.fft.irfftn, "fftn": torch.fft.fftn, "ifftn": torch.fft.ifftn,
         "hfftn": torch.fft.hfftn, "ihfftn": torch.fft.ihfftn}


@pytest.mark.parametrize("case", range(48))
def test_fft_outputs_have_the_cpu_kernels_strides(case: int) -> None:
    """The FFTs over permuted inputs and any dimensions: the recorded strides are the CPU
    kernel's (``capture.layouts._fft_cpu``: MKL's ``_exec_fft`` order, pocketfft's contiguous),
    dimensions of size one aside (found by tools/ops_differential.py: ``rfftn`` over two
    dimensions recorded a layout the kernel does not give)."""
    rng = random.Random(case)
    ndim = rng.randint(1, 4)
    dims = rng.sample(range(ndim), rng.randint(1, ndim))
    shape = [rng.choice([2, 3, 4, 6] if d in dims else [1, 2, 3]) for d in range(ndim)]  # (eager refuses a
    order = rng.sample(range(ndim), ndim)                                                 # c2r of 0 points)
    name = sorted(_FFTS)[case % len(_FFTS)]
    complex_input = name in ("irfftn", "fftn", "ifftn", "hfftn")

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            base = torch.randn(*[shape[d] for d in order], dtype=torch.complex64 if complex_input else torch.float32)
            self.out = _FFTS[name](base.permute(*[order.index(d) for d in range(ndim)]), dim=dims)
            self.recorded = self.out.stride()

    torch.manual_seed(0)
    eager = M()
    torch.manual_seed(0)
    traced = fxinit.trace_init(M)
    fxinit.materialize(traced)
    wide = lambda t, stride: [s for s, n in zip(stride, t.shape) if n > 1]  # noqa: E731
    assert wide(eager.out, traced.recorded) == wide(eager.out, eager.out.stride()) == wide(traced.out, traced.out.stride())
    assert torch.equal(traced.out, eager.out)
