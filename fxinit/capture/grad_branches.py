"""Composite ops that choose their computation by whether autograd may need it, recorded as
eager runs them.

torch's spectral composites compute only what a caller needs unless the input "may require a
forward or backward gradient" (``_may_require_fw_or_bw_grad`` in ``BatchLinearAlgebra.cpp``):
``linalg_svdvals`` asks LAPACK for singular vectors too only then (``_linalg_svd``'s
``compute_uv``), ``linalg_eigvalsh`` for eigenvectors (``_linalg_eigh``'s ``compute_v``), and
``linalg_eigvals`` runs ``linalg_eig`` instead of ``_linalg_eigvals``. The values differ in
their last bits between the two paths. The test counts any tensor subclass, and any active
dispatch mode, as possibly needing gradients, so while fxinit records, C++ always took the
vectors' path: ``w /= linalg.matrix_norm(w, ord=2)`` under ``torch.no_grad()`` in a
constructor gave other values than eager's (found by a hunt through ``torch.linalg``).

Eager's answer is ``torch.is_grad_enabled() and input.requires_grad``, or a forward-mode
gradient on the input. fxinit gives it at the two places it can see:

* a call of a function whose spectral work is values only (``_values_only``: ``svdvals``,
  ``eigvalsh``, the matrix norms, ``cond``, ``matrix_rank``, ``svd(compute_uv=False)``; each
  reaches ``_linalg_svd``/``_linalg_eigh`` only through ``linalg_svdvals``/``linalg_eigvalsh``,
  by torch's C++) runs inside ``values_only()``, and there the recorder takes the
  ``compute_uv``/``compute_v`` eager would have passed (``eager_arguments``);
* ``linalg.eigvals``, which only user code calls, becomes ``_linalg_eigvals`` where eager's
  answer is no (``eigvals_call``).

Functions that ask for vectors themselves (``linalg.svd``, ``eigh``, ``pinv``) are left alone.
Both apply to deferred and real tensors alike: while fxinit records, its dispatch mode is active,
and C++ takes a real tensor for one that may need gradients as well (``run_as_eager``).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Any, Callable, Iterator

import torch

aten = torch.ops.aten
_LOCAL = threading.local()


def eager_needs_grad(t: torch.Tensor, forward: bool) -> bool:
    """torch's ``_may_require_fw_or_bw_grad`` as eager construction answers it (a deferred
    tensor keeps eager's ``requires_grad``); ``forward``: the call's inputs carry forward-mode
    gradients (``has_tangent``), which the ops in between pass on."""
    return (torch.is_grad_enabled() and t.requires_grad) or forward


def has_tangent(args: tuple, kwargs: dict) -> bool:
    """Whether a tensor argument carries a forward-mode gradient (only inside ``dual_level``)."""
    from torch.autograd import forward_ad

    if forward_ad._current_level < 0:
        return False
    return any(isinstance(t, torch.Tensor) and forward_ad.unpack_dual(t).tangent is not None
               for t in (*args, *kwargs.values()))


@functools.lru_cache(maxsize=None)
def _values_only() -> frozenset[Any]:
    functions = [torch.linalg.svdvals, torch.linalg.eigvalsh, torch.linalg.matrix_norm, torch.linalg.norm,
                 torch.linalg.cond, torch.linalg.matrix_rank, torch.norm, torch.functional.norm, torch.Tensor.norm,
                 torch.nuclear_norm]
    for packet in (aten.linalg_svdvals, aten.linalg_eigvalsh, aten.linalg_matrix_norm, aten.linalg_norm,
                   aten.linalg_cond, aten.linalg_matrix_rank, aten.nuclear_norm, aten.norm):
        functions += [packet, *(getattr(packet, name) for name in packet.overloads())]
    return frozenset(functions)


_SVD = (torch.svd, torch.Tensor.svd, aten.svd, aten.svd.default)


def values_only_call(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` reaches torch's spectral composites for values alone."""
    if func in _SVD:  # compute_uv=False: linalg_svdvals
        return kwargs.get("compute_uv", args[2] if len(args) > 2 else True) is False
    return func in _values_only()


@contextlib.contextmanager
def values_only(args: tuple, kwargs: dict) -> Iterator[None]:
    """Inside, on this thread: ``eager_arguments`` gives eager's flags for a call of
    ``(args, kwargs)``."""
    saved = getattr(_LOCAL, "forward", None)
    _LOCAL.forward = has_tangent(args, kwargs)
    try:
        yield
    finally:
        _LOCAL.forward = saved


#: op -> the position and name of its flag for vectors
_FLAGS = {aten._linalg_svd.default: (2, "compute_uv"), aten._linalg_eigh.default: (2, "compute_v")}


def eager_arguments(func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``func``'s arguments with the vectors' flag eager's composite passed, inside
    ``values_only()`` (elsewhere, and for other ops, as they are)."""
    forward = getattr(_LOCAL, "forward", None)
    if forward is None:  # outside values_only(): every op of a recording, without hashing it
        return args, kwargs
    flag = _FLAGS.get(func)
    if flag is None:
        return args, kwargs
    at, name = flag
    wanted = eager_needs_grad(args[0], forward)
    if name in kwargs or len(args) <= at:
        return args, {**kwargs, name: wanted}
    return (*args[:at], wanted, *args[at + 1:]), kwargs


_EIGVALS = (torch.linalg.eigvals, aten.linalg_eigvals, aten.linalg_eigvals.default)


def eigvals_call(func: Any, args: tuple, kwargs: dict) -> Callable[[], Any] | None:
    """``linalg.eigvals(A)`` as eager runs it where autograd needs nothing: ``_linalg_eigvals``
    (None: run ``func`` as it is)."""
    if func not in _EIGVALS or len(args) != 1 or kwargs or not isinstance(args[0], torch.Tensor):
        return None
    if eager_needs_grad(args[0], has_tangent(args, kwargs)):
        return None
    return lambda: aten._linalg_eigvals.default(args[0])


def run_as_eager(func: Any, args: tuple, kwargs: dict, call: Callable[[], Any]) -> Any:
    """``call()``, which runs ``func(*args, **kwargs)``, taking the spectral branches eager's
    C++ takes (the capture function mode's calls, ``DeferredTensor``'s after the trace)."""
    if func not in _spectral():  # nearly every call: one lookup
        return call()
    if values_only_call(func, args, kwargs):
        with values_only(args, kwargs):
            return call()
    eigvals = eigvals_call(func, args, kwargs)
    return call() if eigvals is None else eigvals()


@functools.lru_cache(maxsize=None)
def _spectral() -> frozenset[Any]:
    """Every function ``run_as_eager`` may treat otherwise than torch does."""
    return _values_only() | frozenset(_SVD) | frozenset(_EIGVALS)
