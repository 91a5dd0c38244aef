"""Torch's global numeric settings: the switches besides an op's arguments that change what
it computes, recorded with a graph so that its ops replay under the settings eager ran them in.

A constructor runs under whatever the script set before it (or sets inside it), and its
values depend on some of those settings:

* ``torch.use_deterministic_algorithms(True)`` fills ``torch.empty`` with NaN
  (``torch.utils.deterministic.fill_uninitialized_memory``);
* the float32 matmul and convolution precisions (``torch.set_float32_matmul_precision``,
  ``torch.backends.*.fp32_precision``): on a CPU with bfloat16 instructions, ``"medium"``
  computes ``a @ b`` of float32 tensors in bfloat16; on CUDA, ``"high"`` in TF32;
* reduced-precision reductions of half and bfloat16 matmuls, cuDNN's and oneDNN's
  deterministic switches, cuBLAS's and the linear-algebra library choice (``orthogonal_``'s QR);
* torch's thread count (how a large CPU reduction is split, so its sum's rounding);
* flush-denormal (``torch.set_flush_denormal``), which is a property of each CPU thread.

``current()`` reads them (a few microseconds: the recorder reads them for every op),
``applied(numerics)`` sets the ones that differ and restores them after. ``Numerics`` is a
tuple of ``(name, value)`` pairs of plain JSON values, so an artifact keeps it as it is.

    >>> import torch
    >>> from fxinit.numerics import applied, current
    >>> before = current()
    >>> torch.use_deterministic_algorithms(True)
    >>> recorded = current()
    >>> torch.use_deterministic_algorithms(False)
    >>> with applied(recorded):
    ...     bool(torch.empty(2).isnan().all())
    True
    >>> current() == before
    True
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, Iterable, Iterator, NamedTuple, Union

import torch

Value = Union[bool, int, str, tuple]
Numerics = tuple[tuple[str, Value], ...]

_C = torch._C
_TINY = 1e-310  # a subnormal double: a thread that flushes denormals multiplies it to 0.0


def _flushes_denormals() -> bool:
    return _TINY * 1.0 == 0.0


def _deterministic() -> str:
    if not _C._get_deterministic_algorithms():
        return "off"
    return "warn" if _C._get_deterministic_algorithms_warn_only() else "on"


def _set_deterministic(value: str) -> None:
    _C._set_deterministic_algorithms(value != "off", warn_only=value == "warn")


def _precision(backend: str, op: str) -> tuple[Callable[[], Value], Callable[[Value], None]]:
    return (functools.partial(_C._get_fp32_precision_getter, backend, op),
            functools.partial(_C._set_fp32_precision_setter, backend, op))


def _legacy_precision() -> Value:
    """``torch.get_float32_matmul_precision()``, or "" where the backends' precisions were set
    apart (torch's getter then raises)."""
    try:
        return _C._get_float32_matmul_precision()
    except RuntimeError:
        return ""


def _set_legacy_precision(value: Value) -> None:
    if value:  # "": set through the backends' own precisions, which come next
        _C._set_float32_matmul_precision(value)


def _pair(name: str) -> tuple[Callable[[], Value], Callable[[Value], None]]:
    get, set_ = getattr(_C, f"_get_{name}"), getattr(_C, f"_set_{name}")
    return (lambda: tuple(get()), lambda value: set_(*value))


def _flag(name: str) -> tuple[Callable[[], Value], Callable[[Value], None]]:
    return getattr(_C, f"_get_{name}"), getattr(_C, f"_set_{name}")


def _backend(name: str, enum: Any) -> tuple[Callable[[], Value], Callable[[Value], None]]:
    get, set_ = getattr(_C, f"_get_{name}"), getattr(_C, f"_set_{name}")
    return (lambda: get().name, lambda value: set_(getattr(enum, value)))


def _table() -> dict[str, tuple[Callable[[], Value], Callable[[Value], None]]]:
    """Every setting this torch has, by name: ``(get, set)``. The fp32 precisions come first,
    torch's legacy one before the backends' (``applied`` sets them as one)."""
    table: dict[str, tuple[Callable[[], Value], Callable[[Value], None]]] = {
        "float32_matmul_precision": (_legacy_precision, _set_legacy_precision)}
    if hasattr(_C, "_get_fp32_precision_getter"):
        for backend, op in (("generic", "all"), ("cuda", "matmul"), ("mkldnn", "matmul"), ("cuda", "conv"),
                            ("mkldnn", "conv"), ("cuda", "rnn"), ("mkldnn", "rnn")):
            table[f"fp32_precision.{backend}.{op}"] = _precision(backend, op)
    table["deterministic_algorithms"] = (_deterministic, _set_deterministic)
    for name, make in (("deterministic_fill_uninitialized_memory", _flag), ("cudnn_deterministic", _flag),
                       ("mkldnn_deterministic", _flag), ("cpu_allow_fp16_reduced_precision_reduction", _flag),
                       ("cublas_allow_fp16_accumulation", _flag),
                       ("cublas_allow_fp16_reduced_precision_reduction", _pair),
                       ("cublas_allow_bf16_reduced_precision_reduction", _pair)):
        if hasattr(_C, f"_get_{name}") and hasattr(_C, f"_set_{name}"):
            table[name] = make(name)
    for name, enum in (("linalg_preferred_backend", "_LinalgBackend"), ("blas_preferred_backend", "_BlasBackend")):
        if hasattr(_C, f"_get_{name}") and hasattr(_C, enum):
            table[name] = _backend(name, getattr(_C, enum))
    table["num_threads"] = (torch.get_num_threads, torch.set_num_threads)
    table["flush_denormal"] = (_flushes_denormals, torch.set_flush_denormal)
    return table


SETTINGS = _table()
_GETTERS = tuple((name, get) for name, (get, _) in SETTINGS.items())
_PRECISIONS = frozenset(name for name in SETTINGS if "precision" in name and "reduced" not in name)


def current() -> Numerics:
    """The settings in force now, on this thread."""
    return tuple((name, get()) for name, get in _GETTERS)


def check_value(name: str, value: Any) -> bool:
    """Whether ``value`` is of the kind setting ``name`` takes (for an artifact's reader)."""
    if name in ("num_threads",):
        return type(value) is int and value > 0
    if name in ("flush_denormal", "deterministic_fill_uninitialized_memory", "cudnn_deterministic",
                "mkldnn_deterministic", "cpu_allow_fp16_reduced_precision_reduction",
                "cublas_allow_fp16_accumulation"):
        return type(value) is bool
    if name.startswith("cublas_allow_"):
        return type(value) is tuple and len(value) == 2 and all(type(v) is bool for v in value)
    if name == "deterministic_algorithms":
        return value in ("off", "on", "warn")
    if name == "float32_matmul_precision":
        return value in ("", "highest", "high", "medium")
    return type(value) is str and value.isidentifier()


@contextlib.contextmanager
def applied(numerics: Numerics | None) -> Iterator[None]:
    """The settings of ``numerics`` in force inside (the process's, and this thread's
    flush-denormal); those that differ are set and restored after. None: nothing is set.
    Settings this torch does not have (recorded by a later release) are not set."""
    if numerics is None:
        yield
        return
    now = dict(current())
    changed = [name for name, value in numerics if name in now and now[name] != value]
    if not changed:
        yield
        return
    if any(name in _PRECISIONS for name in changed):
        # setting one precision can change the others (torch's legacy setter sets the backends',
        # the ``generic`` one is inherited): set them all, in the table's order
        changed = [name for name in now if name in _PRECISIONS] + [name for name in changed if name not in _PRECISIONS]
    wanted = dict(numerics)
    for name in changed:
        SETTINGS[name][1](wanted[name])
    try:
        yield
    finally:
        for name in changed:
            SETTINGS[name][1](now[name])


class Settings(NamedTuple):
    """What torch's global state gives an op besides its arguments: the default dtype
    (factories without ``dtype=``) and the numeric settings. A graph has one; a node recorded
    under others has its own (``meta["default_dtype"]``, ``meta["numerics"]``)."""

    default_dtype: torch.dtype
    numerics: Numerics | None

    def of(self, node: Any) -> Settings:
        """``node``'s settings: its own where it has them, else these."""
        meta = node.meta
        if "default_dtype" not in meta and "numerics" not in meta:
            return self
        return Settings(meta.get("default_dtype", self.default_dtype), meta.get("numerics", self.numerics))


def note_settings(meta: dict, default_dtype: torch.dtype, numerics: Numerics) -> None:
    """Note in a node's ``meta`` the settings in force now where they differ from its graph's
    (changed inside the constructor)."""
    dtype = torch.get_default_dtype()
    if dtype != default_dtype:
        meta["default_dtype"] = dtype
    now = current()
    if now != numerics:
        meta["numerics"] = now


def distinct_settings(settings: Settings, nodes: Iterable[Any]) -> set[Settings]:
    """The settings ``nodes`` were recorded under (one: they can be set once for a whole run,
    and threads running the nodes never switch them)."""
    return {settings.of(n) for n in nodes} or {settings}


@contextlib.contextmanager
def settings_applied(settings: Settings) -> Iterator[None]:
    """``settings`` in force inside: torch's default dtype and ``applied(settings.numerics)``."""
    saved = torch.get_default_dtype()
    if saved != settings.default_dtype:
        torch.set_default_dtype(settings.default_dtype)
    try:
        with applied(settings.numerics):
            yield
    finally:
        if saved != settings.default_dtype:
            torch.set_default_dtype(saved)
