"""Composite ops that choose their computation by whether autograd may need it, run as eager
runs them.

torch's spectral composites compute only what a caller needs unless the input "may require a
forward or backward gradient" (``_may_require_fw_or_bw_grad`` in ``BatchLinearAlgebra.cpp``):
``linalg_svdvals`` asks LAPACK for singular vectors too only then, ``linalg_eigvalsh`` for
eigenvectors, and ``linalg_eigvals`` runs ``linalg_eig`` instead of ``_linalg_eigvals``. The
values differ in their last bits between the two paths. The test counts any tensor subclass,
and any active dispatch mode, as possibly needing gradients, so while fxinit records, C++
always takes the vectors' path: ``linalg.matrix_norm(w, ord=2)`` in a constructor under
``torch.no_grad()`` gave other values than eager's (found by a hunt through ``torch.linalg``).

Eager's choice is ``torch.is_grad_enabled() and input.requires_grad`` (a deferred tensor keeps
eager's ``requires_grad``; forward-mode AD plays no part in a constructor). fxinit makes it
where C++ makes it: Python kernels for the three composites' ``CompositeImplicitAutograd``
key, which torch's Python dispatcher runs in place of the C++ ones, so a composite reached
from C++ (``matrix_norm``, ``cond``, ``matrix_rank``, ``torch.norm(p="nuc")``,
``torch.svd(compute_uv=False)``) takes eager's path too. The Python dispatcher is on only
around calls of the functions that can reach them (``ENTRY_POINTS``: it routes every op
through Python, ~20% of a trace's time were it on throughout); elsewhere, and on threads that
are not recording, the kernels run torch's own C++ composite.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import torch
from torch._C import DispatchKey

aten = torch.ops.aten
_CIA = DispatchKey.CompositeImplicitAutograd
_LOCAL = threading.local()


def _eager_needs_grad(t: torch.Tensor) -> bool:
    """torch's ``_may_require_fw_or_bw_grad`` as eager construction answers it."""
    return torch.is_grad_enabled() and t.requires_grad


def _svdvals(A: torch.Tensor, *, driver: str | None = None) -> torch.Tensor:
    if not _on():
        return aten.linalg_svdvals.default._op_dk(_CIA, A, driver=driver)
    return aten._linalg_svd.default(A, False, _eager_needs_grad(A), driver=driver)[1]


def _eigvalsh(A: torch.Tensor, UPLO: str = "L") -> torch.Tensor:
    if not _on():
        return aten.linalg_eigvalsh.default._op_dk(_CIA, A, UPLO)
    return aten._linalg_eigh.default(A, UPLO, _eager_needs_grad(A))[0]


def _eigvals(A: torch.Tensor) -> torch.Tensor:
    if not _on():
        return aten.linalg_eigvals.default._op_dk(_CIA, A)
    return aten.linalg_eig.default(A)[0] if _eager_needs_grad(A) else aten._linalg_eigvals.default(A)


KERNELS: dict[Any, Callable[..., Any]] = {
    aten.linalg_svdvals.default: _svdvals,
    aten.linalg_eigvalsh.default: _eigvalsh,
    aten.linalg_eigvals.default: _eigvals,
}


def _on() -> bool:
    return getattr(_LOCAL, "depth", 0) > 0


@functools.lru_cache(maxsize=None)
def entry_points() -> frozenset[Any]:
    """The functions a recorded call of which may reach the composites of ``KERNELS``: every
    function of ``torch.linalg`` and the norms and SVDs outside it."""
    found = [getattr(torch.linalg, name) for name in dir(torch.linalg) if not name.startswith("_")]
    found += [torch.norm, torch.functional.norm, torch.Tensor.norm, torch.nuclear_norm, torch.svd, torch.Tensor.svd,
              torch.pinverse, torch.Tensor.pinverse]
    return frozenset(f for f in found if callable(f) and not isinstance(f, type))


_REGISTERING = threading.Lock()


@functools.lru_cache(maxsize=1)
def _registered() -> bool:
    """The kernels, registered once with torch's Python dispatcher (they run torch's own
    composite on any thread that is not inside ``eager_branches``)."""
    with _REGISTERING:
        for op, kernel in KERNELS.items():
            if _CIA not in op.py_kernels:
                op.py_impl(_CIA)(kernel)
    return True


@contextlib.contextmanager
def eager_branches() -> Iterator[None]:
    """Inside: the composites of ``KERNELS`` take eager's path on this thread."""
    from torch._dispatch.python import enable_python_dispatcher

    _registered()
    _LOCAL.depth = getattr(_LOCAL, "depth", 0) + 1
    try:
        with enable_python_dispatcher():
            yield
    finally:
        _LOCAL.depth -= 1
