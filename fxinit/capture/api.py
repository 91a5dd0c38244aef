"""Entry points of capture: ``trace_init``, ``deferred_init`` and the ``meta_init`` block."""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator, TypeVar

import torch

from fxinit.capture import init_shims
from fxinit.capture.call_guards import ByModule, guard_calls
from fxinit.capture.compiled_calls import compiled_call_refusal
from fxinit.capture.deferred import is_deferred_tensor, state_of
from fxinit.capture.foreach_groups import deferred_devices
from fxinit.capture.lazy import lazy_module_support
from fxinit.capture.legacy_types import legacy_type_refusal, legacy_types
from fxinit.capture.modes import active_modes
from fxinit.capture.native_reads import native_read_refusal
from fxinit.capture.post_import import run_pending
from fxinit.capture.provenance import source_lines_scope
from fxinit.capture.real_storages import real_storages
from fxinit.capture.recorder import Recorder
from fxinit.capture.user_modes import refuse_modes_below

M = TypeVar("M", bound=torch.nn.Module)

_local = threading.local()
_META_INIT_RECORDERS: list[Recorder] = []


_ROOT_RECORDERS = ByModule()  # module -> the recorder of the trace that built it


def _depth() -> int:
    return getattr(_local, "depth", 0)


@contextlib.contextmanager
def _capturing(recorder: Recorder) -> Iterator[None]:
    run_pending()  # DTensor's constructor, if torch.distributed.tensor was imported while fxinit was
    init_shims.install()  # torch 2.11's opaque init functions ask deferred tensors ``is_meta``, as later ones do
    fmode, dmode = active_modes(recorder)
    refuse_modes_below(type(dmode))
    recorder.capturing = True
    _local.depth = _depth() + 1
    try:
        with source_lines_scope(), recorder.lazy_cpu.scope(), deferred_devices(), real_storages(recorder), \
                legacy_types(), fmode, dmode, lazy_module_support(recorder):
            yield
    except Exception as exc:
        refusal = compiled_call_refusal(exc) or legacy_type_refusal(exc) or native_read_refusal(exc)
        if refusal is None:
            raise
        raise refusal from exc
    finally:
        _local.depth = _depth() - 1
        recorder.capturing = False


def trace_init(fn: Callable[..., M], *args: Any, **kwargs: Any) -> M:
    """Build ``fn(*args, **kwargs)`` with every parameter and buffer deferred.

    ``fn`` is a module class or any callable returning an ``nn.Module``. The result
    has the shapes, dtypes, ``requires_grad`` and tying of eager construction but no
    storage; its tensors report ``device='meta'``. The global random generators are
    left exactly where eager construction would leave them, and any init applied to
    the deferred tensors afterwards (``nn.init.*``, ``model.apply(...)``) is recorded too.
    Use :func:`fxinit.materialize` to fill any part of it with eager-equal values.
    """
    recorder = Recorder("trace")
    with _capturing(recorder):
        module = fn(*args, **kwargs)
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"trace_init expects a callable returning an nn.Module, got {type(module).__name__}")
    recorder.set_root(module)
    _ROOT_RECORDERS[module] = recorder
    guard_calls(module, recorder)
    return module


def deferred_init(module_fn: Callable[..., M], *args: Any, **kwargs: Any) -> M:
    """torchdistX-compatible name of :func:`trace_init`."""
    return trace_init(module_fn, *args, **kwargs)


@contextlib.contextmanager
def meta_init() -> Iterator[None]:
    """Defer every tensor created in the block, overriding explicit ``device=`` arguments.

    Tensors (and modules) made inside can be materialized later, one by one, with
    :func:`fxinit.materialize`; see ``keep_cache`` there.
    """
    recorder = Recorder("meta_init")
    _META_INIT_RECORDERS.append(recorder)
    with _capturing(recorder):
        yield


def recorder_of_root(module: torch.nn.Module) -> Recorder | None:
    """The recorder of the trace that built ``module`` (as its root), if any."""
    return _ROOT_RECORDERS.get(module)


def _recorder_for(module: torch.nn.Module) -> Recorder:
    recorder = _ROOT_RECORDERS.get(module)
    if recorder is None:
        found = [state_of(t).recorder for t in list(module.parameters()) + list(module.buffers())
                 if is_deferred_tensor(t)]
        recorder = found[0] if found else Recorder("trace")
    if recorder.root is None:
        recorder.set_root(module)
    recorder.names.forget_paths()
    return recorder


@contextlib.contextmanager
def recording(module: torch.nn.Module) -> Iterator[None]:
    """Run init code on a deferred model as if it were still being constructed.

    After ``trace_init`` a deferred tensor reports ``device='meta'``, so code that builds
    new tensors "like" a parameter (``torch.randn(w.shape, device=w.device)``, registering
    a parametrization) would build plain meta tensors fxinit knows nothing about. Inside
    this block the model's tensors report their intended device again and every new
    tensor is deferred and recorded, drawing random numbers exactly as eager code would.
    """
    with _capturing(_recorder_for(module)):
        yield


def dry_run(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Run ``module(*args, **kwargs)`` on a deferred model so lazy modules infer their shapes.

    This is the deferred counterpart of the dry run that ``nn.LazyLinear`` & co. need:
    the parameters they create become deferred tensors whose init is recorded, drawing
    random numbers exactly where the eager dry run would. The forward computation itself
    is recorded too but never executed by materialization; its (deferred) output is returned.
    """
    with recording(module):
        return module(*args, **kwargs)


def is_meta_init() -> bool:
    """True while a constructor runs under ``trace_init``/``meta_init`` (for module authors)."""
    return _depth() > 0


def clear_meta_init_cache() -> None:
    """Forget the recorded graphs of ``meta_init`` blocks; their tensors can no longer be materialized."""
    while _META_INIT_RECORDERS:
        recorder = _META_INIT_RECORDERS.pop()
        recorder.cleared = True
        recorder.graph = None  # type: ignore[assignment]
        recorder.constants.clear()
        recorder.lifted_with_grad.clear()
        recorder.snapshots.clear()
