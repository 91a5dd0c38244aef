"""Call guards: calling a module of a deferred model is a clear error until its tensors are real.

``trace_init`` puts a ``CallGuard`` (a forward pre-hook) on each module that holds deferred
tensors, and takes it off again as those tensors are materialized, whole or part by part, so
that a materialized model holds no hook of fxinit's: it pickles, ``torch.save``s and scripts
as eager's does. A guard follows its module through ``copy.deepcopy`` (the copy is guarded, and
unguarded, on its own: Ultralytics' ``ModelEMA`` copies the model it is given), and a tensor
given to a module after the trace (conv + batch-norm fusion replaces ``conv.weight``) is
found when it is materialized.

Where the guards are is indexed (``GuardIndex``, one per trace: ``Recorder.guards``) by the ids
of the tensors the guarded modules hold, and, for a module without tensors of its own, by the
guarded modules right below it, so that materializing a model tensor by tensor does not walk it
once per tensor. The index is rebuilt from the modules where a guarded module was copied, or a
parameter not in it is materialized and something was recorded since it was built.

Not guarded: a module whose tensors were all real at the trace's end (one given a deferred
tensor later, or added after the trace), and parameters that are wrapper subclasses around
deferred tensors. Calling those before ``materialize`` returns deferred tensors, not values.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Iterable

import torch
from torch.nn.parameter import UninitializedTensorMixin
from torch.nn.utils import parametrize

from fxinit.capture.deferred import is_deferred_tensor
from fxinit.capture.trees import leaves
from fxinit.errors import DeferredInitError

_PARAMETRIZE = "torch.nn.utils.parametriz"  # parametrize, parametrizations


class ByModule:
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


@dataclass
class GuardIndex:
    """The guarded modules of one trace's model (``modules``: theirs and their copies'), indexed.
    A module with tensors of its own waits for those: ``by_tensor``, id of a deferred tensor ->
    the modules holding it; one without (a model's root, a ``ModuleList``) waits for the guarded
    modules right below it: ``parents``, id of a module -> the modules it is right below, and
    ``pending``, id of such a module -> how many of those are guarded still. ``stale``: a guarded
    module was copied since; ``at``: how many nodes the recorder had recorded when it was built."""

    modules: list[weakref.ReferenceType] = field(default_factory=list)
    by_tensor: dict[int, list[weakref.ReferenceType]] = field(default_factory=dict)
    parents: dict[int, list[weakref.ReferenceType]] = field(default_factory=dict)
    pending: dict[int, int] = field(default_factory=dict)
    stale: bool = False
    at: int = 0

    def unguarded(self, mod: torch.nn.Module) -> None:
        """``mod``'s guard came off: so does that of a module it was the last one waited for below."""
        for ref in self.parents.pop(id(mod), ()):
            parent = ref()
            if parent is None:
                continue
            self.pending[id(parent)] = self.pending.get(id(parent), 1) - 1
            guard = _GUARDS.get(parent)
            if self.pending[id(parent)] <= 0 and guard is not None:
                guard.remove(parent)


class _NotScriptable(DeferredInitError, AttributeError):
    """A guard has no name: asked by TorchScript's compiler, it says why (an ``AttributeError``
    as well, for code that asks any hook ``getattr(hook, "__name__", None)``)."""


_GUARDS = ByModule()  # module -> its CallGuard, until that module's tensors are materialized


class CallGuard:
    """The forward pre-hook of one module of a deferred model: calling the module raises a
    clear error while its tensors are deferred, and takes the hook off once none is; inside
    ``recording`` (``dry_run``) the call runs, recorded.

    >>> import torch, fxinit
    >>> m = fxinit.trace_init(torch.nn.Linear, 2, 2)
    >>> type(next(iter(m._forward_pre_hooks.values()))).__name__
    'CallGuard'
    >>> _ = fxinit.materialize(m)
    >>> len(m._forward_pre_hooks)
    0
    """

    fxinit_own = True  # holds no tensor of the model (``reachable.captured``)

    def __init__(self, module: torch.nn.Module, path: str, recorder: Any,
                 parent: torch.nn.Module | None = None) -> None:
        self.module = weakref.ref(module)
        self.path = path
        self.recorder = recorder
        self.parent = weakref.ref(parent) if parent is not None else None  # the module right above it
        self.key: int | None = None  # its key in the module's ``_forward_pre_hooks``

    def __call__(self, mod: torch.nn.Module, args: Any) -> None:
        if self.recorder.capturing:
            return
        deferred = next((name for name, t in (*mod.named_parameters(), *mod.named_buffers()) if _is_deferred(t)), None)
        if deferred is None:
            self.remove(mod)
            return
        raise DeferredInitError(
            f"{self.path or type(mod).__name__} was called while its tensors are deferred (built by fxinit.trace_init, "
            f"e.g. {deferred!r}): they have no values yet",
            hint="call fxinit.materialize(model) (or materialize the part you run) first; to record the dry run "
                 "that lazy modules need, use fxinit.dry_run(model, ...); where a framework calls the model in a "
                 "step of its own (Lightning's ModelSummary), run that step inside `with fxinit.recording(model):`")

    def remove(self, mod: torch.nn.Module | None = None) -> None:
        """Take this guard off ``mod`` (default: its own module; a copy that ``copy.deepcopy``
        did not tell it of holds it too)."""
        mod = self.module() if mod is None else mod
        if mod is not None:
            mod._forward_pre_hooks.pop(self.key, None)
            if _GUARDS.get(mod) is self:
                _GUARDS.pop(mod)
                self.recorder.guards.unguarded(mod)

    def __deepcopy__(self, memo: dict[int, Any]) -> CallGuard:
        """The guard of the module's copy (``copy.deepcopy`` makes the module first: ``memo``
        has it), guarded and unguarded on its own, as the module it was copied from."""
        mod = self.module()
        copied = memo.get(id(mod)) if mod is not None else None
        if not isinstance(copied, torch.nn.Module):
            return self
        parent = self.parent() if self.parent is not None else None
        copied_parent = memo.get(id(parent)) if parent is not None else None  # (``copy.deepcopy`` makes a
        guard = CallGuard(copied, self.path, self.recorder, copied_parent)   # module before its children)
        guard.key = self.key
        _GUARDS[copied] = guard
        self.recorder.guards.modules.append(weakref.ref(copied))
        self.recorder.guards.stale = True  # (its tensors are not copied yet)
        if copied_parent is None:  # the outermost module of the model that this deep copy copies
            self.recorder.copies = [*(r for r in self.recorder.copies if r() is not None), weakref.ref(copied)]
        return guard

    @property
    def __name__(self) -> str:  # noqa: A003  (TorchScript's compiler asks a hook for its name first)
        raise _NotScriptable(
            f"{self.path or 'the model'} holds deferred tensors: TorchScript cannot compile it (nor fxinit's call "
            "guard on it)", op="torch.jit.script", hint="script the model after fxinit.materialize")

    def __reduce__(self) -> Any:
        mod = self.module()
        raise DeferredInitError(
            f"{self.path or type(mod).__name__} holds deferred tensors, which cannot be pickled or saved",
            op="pickle", hint="call fxinit.materialize(model) first, or save its init graph (fxinit.save)")


def _holds_tensors(script: torch.jit.ScriptModule) -> bool:
    """Whether a TorchScript module or one inside it has a tensor among its attributes
    (parameters and buffers too, in lists and dicts too); one without
    (``torch.jit.script(nn.GELU())``, e3nn's compiled code) only computes, and its calls on
    deferred tensors are recorded (``capture.torchscript_calls``)."""
    return any(isinstance(t, torch.Tensor) for sub in script.modules()
               for _, value in torch._C._jit_debug_module_iterators(sub._c)["named_attributes"] for t in leaves(value))


def guard_calls(module: torch.nn.Module, recorder: Any) -> None:
    """Put a ``CallGuard`` on each module of ``module`` that holds tensors (the traced model)."""
    by_path = dict(module.named_modules())
    for path, mod in by_path.items():
        if isinstance(mod, torch.jit.ScriptModule) and _holds_tensors(mod):
            raise DeferredInitError(
                f"{path or type(mod).__name__} is a TorchScript module (torch.jit.script/trace in the constructor) "
                "that holds tensors: it keeps them in TorchScript, where fxinit's deferred tensors lose what they are "
                "and materialize cannot reach them", op="torch.jit.script",
                hint="script the module after fxinit.materialize, or build this model eagerly")
        if type(mod).__module__.startswith(_PARAMETRIZE) and not parametrize.is_parametrized(mod):
            continue  # computes a weight from parameters (recorded), never from data (its owner is guarded)
        if next(itertools.chain(mod.parameters(), mod.buffers()), None) is None:
            continue  # nothing to wait for (an activation, e3nn's generated code: pickled as eager's)
        guard = CallGuard(mod, path, recorder, by_path.get(path.rpartition(".")[0]) if path else None)
        guard.key = mod.register_forward_pre_hook(guard).id
        _GUARDS[mod] = guard
        recorder.guards.modules.append(weakref.ref(mod))
    _index(recorder)


def _index(recorder: Any) -> None:
    """Index the guarded modules of ``recorder``'s model by what they wait for now (see
    ``GuardIndex``); take the guard off those that wait for nothing."""
    index = GuardIndex(at=recorder.recorded_nodes)
    done = []
    for ref in recorder.guards.modules:
        mod = ref()
        guard = _GUARDS.get(mod) if mod is not None else None
        if guard is None:
            continue
        index.modules.append(ref)
        own = _own(mod)
        if own:
            waits_for = {id(t) for t in own if _waits(t)}
            for i in waits_for:
                index.by_tensor.setdefault(i, []).append(ref)
        else:
            waits_for = {id(c) for c in mod.children() if _GUARDS.get(c) is not None}
            for i in waits_for:
                index.parents.setdefault(i, []).append(ref)
            index.pending[id(mod)] = len(waits_for)
        if not waits_for:
            done.append((mod, guard))
    recorder.guards = index
    for mod, guard in done:
        if _GUARDS.get(mod) is guard:
            guard.remove(mod)


def unguard(module: torch.nn.Module) -> None:
    """Take the guard off each module of ``module`` whose own tensors are all materialized."""
    for mod in module.modules():
        guard = _GUARDS.get(mod)
        if guard is not None and not any(map(_is_deferred, _own(mod))):
            guard.remove(mod)


def unguard_holders(recorders: Iterable[Any], made: list[torch.Tensor]) -> None:
    """Take the guard off the modules that held the tensors just materialized (``made``;
    ``recorders``: theirs), where none of their own tensors is deferred any more (one without
    tensors of its own, a model's root, once nothing below it is): a model materialized part
    by part, tensor by tensor, holds no hook of fxinit's at the end either."""
    ids = {id(t) for t in made}
    for recorder in recorders:
        index = recorder.guards
        if not index.modules:
            continue
        if index.stale or (recorder.recorded_nodes != index.at and any(
                id(t) not in index.by_tensor and isinstance(t, torch.nn.Parameter) for t in made)):
            _index(recorder)  # a parameter given since (conv + batch-norm fusion); what was just made is real
        else:             # now: its holders are unguarded there
            _unguard_indexed(index, ids)


def _unguard_indexed(index: GuardIndex, made: AbstractSet[int]) -> None:
    reached = {id(ref): ref for i in made for ref in index.by_tensor.pop(i, ())}  # (one reference per module)
    for ref in reached.values():
        mod = ref()
        guard = _GUARDS.get(mod) if mod is not None else None
        if guard is None:
            continue
        waiting = [t for t in _own(mod) if _waits(t)]
        for t in waiting:  # one given to it since the index (``m[0].weight = m[1].weight``): waited for too
            holders = index.by_tensor.setdefault(id(t), [])
            if not any(r is ref for r in holders):
                holders.append(ref)
        if not waiting:
            guard.remove(mod)


def _own(mod: torch.nn.Module) -> list[torch.Tensor]:
    """``mod``'s own tensors, with those of its parametrizations (``parametrize`` moves a weight
    into a submodule of no guard of its own: ``mod.parametrizations.weight.original``)."""
    own = [t for t in (*mod._parameters.values(), *mod._buffers.values()) if t is not None]
    held = mod._modules.get("parametrizations")
    if held is not None and type(held).__module__.startswith(_PARAMETRIZE):
        own += [*held.parameters(), *held.buffers()]
    return own


def _waits(t: torch.Tensor) -> bool:
    """A tensor a module's guard waits for: deferred, or a lazy module's uninitialized one
    (``dry_run`` makes it deferred)."""
    return _is_deferred(t) or isinstance(t, UninitializedTensorMixin)


def _is_deferred(t: Any) -> bool:
    return t is not None and (is_deferred_tensor(t) or is_deferred_tensor(getattr(t, "_local_tensor", None)))
