"""Entry points of capture: ``trace_init``, ``deferred_init`` and the ``meta_init`` block."""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from typing import Any, Callable, Iterator, TypeVar

import torch

from fxinit.capture import init_shims
from fxinit.capture.compiled_calls import compiled_call_refusal
from fxinit.capture.deferred import is_deferred_tensor, state_of
from fxinit.capture.foreach_groups import deferred_devices
from fxinit.capture.lazy import lazy_module_support
from fxinit.capture.legacy_types import legacy_type_refusal, legacy_types
from fxinit.capture.modes import active_modes
from fxinit.capture.post_import import run_pending
from fxinit.capture.provenance import source_lines_scope
from fxinit.capture.real_storages import real_storages
from fxinit.capture.recorder import Recorder
from fxinit.errors import DeferredInitError

M = TypeVar("M", bound=torch.nn.Module)
_PARAMETRIZE = "torch.nn.utils.parametriz"  # parametrize, parametrizations

_local = threading.local()
_META_INIT_RECORDERS: list[Recorder] = []


class _ByModule:
    """Values by module, as long as the module lives. Keyed by identity: a
    ``WeakKeyDictionary`` compares its keys with ``==``, which a module may define otherwise
    (tensordict's ``TensorDictParams``, in every torchrl loss, compares element by element, and
    its truth value raises)."""

    def __init__(self) -> None:
        self._items: dict[int, tuple[weakref.ref, Any]] = {}

    def get(self, module: torch.nn.Module) -> Any:
        item = self._items.get(id(module))
        return item[1] if item is not None and item[0]() is module else None

    def __setitem__(self, module: torch.nn.Module, value: Any) -> None:
        key, items = id(module), self._items
        items[key] = (weakref.ref(module, lambda _: items.pop(key, None)), value)

    def pop(self, module: torch.nn.Module) -> Any:
        value = self.get(module)
        if value is not None:
            del self._items[id(module)]
        return value


_ROOT_RECORDERS = _ByModule()  # module -> the recorder of the trace that built it
#: The hook ``guard_calls`` put on each module, until that module's tensors are materialized.
_GUARDS = _ByModule()


def _depth() -> int:
    return getattr(_local, "depth", 0)


@contextlib.contextmanager
def _capturing(recorder: Recorder) -> Iterator[None]:
    run_pending()  # DTensor's constructor, if torch.distributed.tensor was imported while fxinit was
    init_shims.install()  # torch 2.11's opaque init functions ask deferred tensors ``is_meta``, as later ones do
    fmode, dmode = active_modes(recorder)
    recorder.capturing = True
    _local.depth = _depth() + 1
    try:
        with source_lines_scope(), recorder.lazy_cpu.scope(), deferred_devices(), real_storages(recorder), \
                legacy_types(), fmode, dmode, lazy_module_support(recorder):
            yield
    except Exception as exc:
        refusal = compiled_call_refusal(exc) or legacy_type_refusal(exc)
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


def guard_calls(module: torch.nn.Module, recorder: Recorder) -> None:
    """Calling a module of a deferred model raises a clear error until its own tensors are
    materialized (the hook then removes itself); inside ``recording`` (``dry_run``) it runs."""
    for path, mod in module.named_modules():
        if isinstance(mod, torch.jit.ScriptModule):
            raise DeferredInitError(
                f"{path or type(mod).__name__} is a TorchScript module (torch.jit.script/trace in the constructor): "
                "it keeps its tensors in TorchScript, where fxinit's deferred tensors lose what they are and "
                "materialize cannot reach them", op="torch.jit.script",
                hint="script the module after fxinit.materialize, or build this model eagerly")
        if type(mod).__module__.startswith(_PARAMETRIZE):
            continue  # computes a weight from parameters (recorded), never from data
        if next(itertools.chain(mod.parameters(), mod.buffers()), None) is None:
            continue  # nothing to wait for (an activation, e3nn's generated code: pickled as eager's)
        holder: list[Any] = []

        def refuse(mod: torch.nn.Module, args: Any, path: str = path, holder: list[Any] = holder) -> None:
            if recorder.capturing:
                return
            deferred = next((name for name, t in (*mod.named_parameters(), *mod.named_buffers()) if _is_deferred(t)),
                            None)
            if deferred is None:
                holder[0].remove()
                _GUARDS.pop(mod)
                return
            raise DeferredInitError(
                f"{path or type(mod).__name__} was called while its tensors are deferred (built by fxinit.trace_init, "
                f"e.g. {deferred!r}): they have no values yet",
                hint="call fxinit.materialize(model) (or materialize the part you run) first; to record the dry run "
                     "that lazy modules need, use fxinit.dry_run(model, ...)")

        refuse.fxinit_own = True  # type: ignore[attr-defined]  # holds no tensor of the model (reachable.captured)
        holder.append(mod.register_forward_pre_hook(refuse))
        _GUARDS[mod] = holder[0]
        own = {id(t) for t in (*mod._parameters.values(), *mod._buffers.values()) if t is not None}
        # a module without tensors of its own (a model's root) waits for all of those below it
        waits_for = own or {id(t) for t in itertools.chain(mod.parameters(), mod.buffers())}
        recorder.guard_pending[id(mod)] = len(waits_for)
        for i in waits_for:
            recorder.guarded_by.setdefault(i, []).append(weakref.ref(mod))


def unguard(module: torch.nn.Module) -> None:
    """Take ``guard_calls``' hook off each module of ``module`` whose own tensors are all
    materialized: a materialized model holds no hook of fxinit's (eager's has none: it pickles,
    ``torch.save``s and scripts as eager's does)."""
    for mod in module.modules():
        handle = _GUARDS.get(mod)
        if handle is not None and not any(_is_deferred(t) for t in (*mod._parameters.values(), *mod._buffers.values())):
            handle.remove()
            _GUARDS.pop(mod)


def unguard_holders(recorders: Any, made: Any) -> None:
    """Take ``guard_calls``' hook off the modules that held the tensors just materialized
    (``made``: their ids), where none of their own tensors is deferred any more: a model
    materialized part by part, tensor by tensor, holds no hook of fxinit's at the end either
    (it pickles and scripts as eager's does). Modules are found by the tensors they held at
    the trace's end (one without tensors of its own, a model's root, once all below it are
    materialized); one given a tensor since keeps its hook until it is called or ``unguard``."""
    clean: dict[int, bool] = {}  # module id -> nothing deferred in it or below (asked once per module)

    def nothing_deferred(mod: torch.nn.Module) -> bool:
        known = clean.get(id(mod))
        if known is None:
            clean[id(mod)] = True  # (a module below itself: asked no further)
            known = clean[id(mod)] = not any(map(_is_deferred, (*mod._parameters.values(), *mod._buffers.values()))) \
                and all(map(nothing_deferred, filter(None, mod._modules.values())))
        return known

    for recorder in recorders:
        holders, pending = recorder.guarded_by, recorder.guard_pending
        for i in made:
            for ref in holders.pop(i, ()):
                mod = ref()
                handle = _GUARDS.get(mod) if mod is not None else None
                if handle is None:
                    continue
                pending[id(mod)] -= 1
                if any(t is not None for t in (*mod._parameters.values(), *mod._buffers.values())):
                    done = not any(map(_is_deferred, (*mod._parameters.values(), *mod._buffers.values())))
                else:
                    done = pending[id(mod)] <= 0 and nothing_deferred(mod)
                if done:
                    handle.remove()
                    _GUARDS.pop(mod)


def _is_deferred(t: Any) -> bool:
    return t is not None and (is_deferred_tensor(t) or is_deferred_tensor(getattr(t, "_local_tensor", None)))


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
