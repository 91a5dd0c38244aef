"""What a module reaches besides its parameters and buffers: tensor attributes, tensors in
containers (lists, tuples, dicts and other mappings: anchor tables, caches) and in the
attributes of plain objects (a tensor wrapped to hide it from ``nn.Module``), and which of
those are plain meta tensors fxinit never recorded. Materialize fills and checks all of them;
``init_graph`` refuses a model that holds the latter."""

from __future__ import annotations

import collections
import collections.abc
import functools
import types
from typing import Any, Iterable, Iterator

import torch

from fxinit.capture.deferred import is_deferred_tensor
from fxinit.capture.materialized_marks import trace_serial

CONTAINERS = (list, tuple, dict)
MODULE_DICTS = {"_parameters", "_buffers", "_modules"}
TENSOR_HOOKS = ("_backward_hooks", "_post_accumulate_grad_hooks")
_DEPTH = 3  # levels of containers and objects walked under a module attribute


def contained(x: Any, key: str = "", depth: int = 0, seen: set[int] | None = None) -> Iterable[tuple[str, Any]]:
    """``(path, leaf)`` of nested containers, a few levels deep: lists, tuples and mappings,
    their subclasses too (``OrderedDict``, ``defaultdict``, a ``MutableMapping`` cache: olmo-core's
    ``BufferCache``), and the attributes of plain objects (``_HiddenTensor(x)``: olmo-core's
    ``hide_from_torch``), named ``[key]`` and ``.attribute``. ``seen``: the ids of containers
    and objects already walked (each is walked once, under its first path)."""
    if seen is not None:
        if id(x) in seen:
            return
        seen.add(id(x))
    for k, v in _entries(x):
        path = f"{key}{k}"
        if depth < _DEPTH and _walked(type(v)):
            yield from contained(v, path, depth + 1, seen)
        else:
            yield path, v


def _entries(x: Any) -> Iterable[tuple[str, Any]]:
    """The entries of one container or object, each with the suffix that names it."""
    try:
        if isinstance(x, (list, tuple, collections.deque)):
            return [(f"[{i!r}]", v) for i, v in enumerate(x)]
        if isinstance(x, collections.abc.Mapping):
            return [(f"[{k!r}]", v) for k, v in list(x.items())]
        names = getattr(x, "__dict__", None)
        entries = [(f".{k}", v) for k, v in names.items()] if isinstance(names, dict) else []
        for cls in type(x).__mro__:  # __slots__ too
            slots = cls.__dict__.get("__slots__", ())
            for name in (slots,) if isinstance(slots, str) else slots:
                if name not in ("__dict__", "__weakref__") and hasattr(x, name):
                    entries.append((f".{name}", getattr(x, name)))
        return entries
    except Exception:  # noqa: BLE001 - a mapping or object that cannot be listed holds nothing fxinit can find
        return []


@functools.lru_cache(maxsize=None)
def _walked(cls: type) -> bool:
    """Whether ``contained`` walks into values of type ``cls``: containers, and the objects of
    user and library code (``torch.distributions``' too), not tensors, modules (each walked on
    its own), classes, callables (``captured``), nor the objects of Python's and torch's
    runtime (loggers, locks, process groups, fx graphs holding fake tensors), which hold no
    model tensor and can reach far."""
    if cls in _HOLD_NO_TENSOR or issubclass(cls, (torch.Tensor, torch.nn.Module, type, types.ModuleType)):
        return False
    if issubclass(cls, (list, tuple, collections.deque, collections.abc.Mapping)):
        return True
    module = getattr(cls, "__module__", None) or "builtins"
    root = module.split(".")[0]
    if root == "torch":
        return module.startswith("torch.distributions")
    return root not in _RUNTIME_MODULES


_RUNTIME_MODULES = frozenset({"builtins", "logging", "threading", "multiprocessing", "concurrent", "asyncio",
                              "socket", "io", "_io", "weakref", "_weakref", "typing", "enum", "re", "inspect",
                              "abc", "_thread", "queue", "subprocess", "numpy", "pathlib", "contextlib",
                              "functools", "collections", "ctypes", "triton", "fxinit"})


def captured(fn: Any, key: str, depth: int = 0) -> Iterable[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for the tensors a callable holds: its closure's cells, its default
    arguments, a ``functools.partial``'s arguments, a bound method's function (a few levels:
    a gradient mask in a hook's closure, ``partial(f, table)`` kept as an attribute)."""
    if depth > 3:
        return
    if isinstance(fn, torch.Tensor):
        yield key, fn
    elif type(fn) in CONTAINERS:
        for path, x in contained(fn, key):
            yield from captured(x, path, depth + 1)
    elif isinstance(fn, types.FunctionType):
        if getattr(fn, "fxinit_own", False):  # fxinit's guard against calling a deferred model
            return
        for name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                value = cell.cell_contents
            except ValueError:  # an empty cell
                continue
            yield from captured(value, f"{key}.<{name}>", depth + 1)
        for i, value in enumerate(fn.__defaults__ or ()):
            yield from captured(value, f"{key}.<default {i}>", depth + 1)
        for name, value in (fn.__kwdefaults__ or {}).items():
            yield from captured(value, f"{key}.<{name}>", depth + 1)
    elif isinstance(fn, functools.partial):
        yield from captured(fn.func, key, depth + 1)
        for i, value in enumerate(fn.args):
            yield from captured(value, f"{key}.<arg {i}>", depth + 1)
        for name, value in fn.keywords.items():
            yield from captured(value, f"{key}.<{name}>", depth + 1)
    elif isinstance(fn, types.MethodType) and not isinstance(fn.__self__, torch.nn.Module):
        yield from captured(fn.__func__, key, depth + 1)


def _tensor_hooks(t: torch.Tensor, key: str) -> Iterable[tuple[str, torch.Tensor]]:
    """Tensors held by the gradient hooks registered on ``t`` (``register_hook``)."""
    with torch._C.DisableTorchFunctionSubclass():
        found = [(name, hooks) for name in TENSOR_HOOKS if (hooks := getattr(t, name, None))]
    for name, hooks in found:
        for i, fn in enumerate(hooks.values()):
            yield from captured(fn, f"{key}.{name}[{i}]")


def inner_tensors(t: torch.Tensor, key: str, seen: set[int] | None = None) -> Iterable[tuple[str, torch.Tensor]]:
    """``(path, tensor)`` for the tensors inside ``t`` where it is a wrapper tensor subclass
    (``__tensor_flatten__``: torchao's ``NF4Tensor`` of a QLoRA base weight), at any depth,
    named like ``weight.quantized_data``; also inside a DTensor's local tensor where that is
    such a wrapper (FSDP2 over QLoRA), but not a DTensor's deferred local tensor itself:
    ``fxinit.distributed`` materializes those DTensors as DTensors."""
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None or is_deferred_tensor(t):
        return
    seen = set() if seen is None else seen
    if id(t) in seen:
        return
    seen.add(id(t))
    local = getattr(t, "_local_tensor", None)
    if local is not None:
        if isinstance(local, torch.Tensor) and not is_deferred_tensor(local):
            yield from inner_tensors(local, f"{key}._local_tensor", seen)
        return
    for attr in flatten(t)[0]:
        x = getattr(t, attr, None)
        if isinstance(x, torch.Tensor):
            yield f"{key}.{attr}", x
            yield from inner_tensors(x, f"{key}.{attr}", seen)


def _with_inner(kind: str, name: str, t: Any) -> Iterator[tuple[str, str, Any]]:
    """``(kind, name, t)`` and the ``"inner"`` slots of the tensors inside ``t``."""
    yield kind, name, t
    if hasattr(type(t), "__tensor_flatten__"):
        for path, x in inner_tensors(t, name):
            yield "inner", path, x


def module_slots(mod: torch.nn.Module, seen: set[int] | None = None) -> Iterator[tuple[str, str, Any]]:
    """``(kind, name, value)`` for what one module holds: its parameters and buffers
    (``"_parameters"``, ``"_buffers"``), its other tensor attributes (``"__dict__"``), the tensors
    in its containers and plain objects (``"container"``, named like ``anchors[0]``,
    ``cache['rope']['sin']``, ``_counts.x``: ``contained``), the
    tensors its tensors hold as attributes (``"attribute"``, named like ``weight.SCB``), the
    tensors held by callables: its own and its tensors' hooks, and functions kept as
    attributes (``"hook"``, named like ``weight._backward_hooks[0].<mask>``), and the tensors
    inside those of its tensors that are wrapper subclasses (``"inner"``, named like
    ``weight.quantized_data``: ``inner_tensors``). Containers and objects reached are walked
    once (``seen``: their ids, shared by the walk of a module tree: a config many modules hold)."""
    seen = set() if seen is None else seen
    for kind in ("_parameters", "_buffers"):
        for name, t in getattr(mod, kind).items():
            yield kind, name, t
            if t is not None:
                for path, x in _tensor_hooks(t, name):
                    yield from _with_inner("hook", path, x)
                for attr, x in vars(t).items():  # bitsandbytes' Int8Params.SCB, set by its .to()
                    if isinstance(x, torch.Tensor) and x is not t:
                        yield from _with_inner("attribute", f"{name}.{attr}", x)
                if hasattr(type(t), "__tensor_flatten__"):  # _with_inner, without a generator a parameter
                    for path, x in inner_tensors(t, name):
                        yield "inner", path, x
    attributes = vars(mod)
    for name in _HOOK_DICTS:  # of nn.Module's own bookkeeping, only a hook dict can hold a tensor
        hooks = attributes.get(name)
        if hooks:
            for i, fn in enumerate(hooks.values()):
                for path, x in captured(fn, f"{name}[{i}]"):
                    yield from _with_inner("hook", path, x)
    for name in [name for name in attributes if name not in _MODULE_OWN]:
        v = attributes[name]
        tv = type(v)
        if tv in _HOLD_NO_TENSOR:
            continue
        if tv in _CALLABLES:
            for path, x in captured(v, name):
                yield from _with_inner("hook", path, x)
        elif isinstance(v, torch.Tensor):
            yield from _with_inner("__dict__", name, v)
            for path, x in _tensor_hooks(v, name):
                yield from _with_inner("hook", path, x)
        elif name.endswith("_hooks") and isinstance(v, dict) and v:  # register_forward_hook & co.
            for i, fn in enumerate(v.values()):
                for path, x in captured(fn, f"{name}[{i}]"):
                    yield from _with_inner("hook", path, x)
        elif _walked(tv):
            for key, x in contained(v, seen=seen):
                if isinstance(x, torch.Tensor):
                    yield from _with_inner("container", name + key, x)
                elif isinstance(x, torch.nn.Module):  # not a submodule: its tensors are the walk's too
                    yield "container", name + key, x


_CALLABLES = (types.FunctionType, types.MethodType, functools.partial)
_MODULE_OWN = frozenset(vars(torch.nn.Module())) | MODULE_DICTS  # what every module's __dict__ has
_HOOK_DICTS = tuple(name for name in vars(torch.nn.Module()) if name.endswith("_hooks"))  # in Module's order
_HOLD_NO_TENSOR = frozenset({int, float, bool, str, type(None), torch.dtype, torch.device})  # hold no tensor


#: One slot of a module tree: ``(module path, module, kind, name, value)`` (``module_slots``).
Slot = tuple[str, torch.nn.Module, str, str, Any]


def module_walk(module: torch.nn.Module) -> list[Slot]:
    """Every tensor slot of every module of ``module``'s tree, in ``named_modules`` order (a
    module reached twice counts once), then of the modules it holds in containers without
    registering them (Lightning's ``save_hyperparameters`` keeps a deep copy of a loss module
    in a dict), and theirs: one walk that materialize's questions share. Only tensors: holding
    anything else (an RNN's weak references to its weights) would keep it."""
    seen: set[int] = set()
    walked: set[int] = set()
    slots: list[Slot] = []
    trees = [("", module)]
    while trees:
        prefix, top = trees.pop(0)
        for path, mod in top.named_modules(prefix=prefix):
            if id(mod) in walked:
                continue
            walked.add(id(mod))
            for kind, name, value in module_slots(mod, seen):
                if isinstance(value, torch.Tensor):
                    slots.append((path, mod, kind, name, value))
                elif isinstance(value, torch.nn.Module):
                    trees.append((f"{path}.{name}" if path else name, value))
    return slots


def left_behind(module: torch.nn.Module, walk: list[Slot] | None = None) -> list[str]:
    """Plain meta tensors that fxinit did not record (built after the trace by torch's own
    code on a deferred tensor's ``device``, or by ``to_empty(device='meta')``) reachable from
    ``module`` (whose ``module_walk`` is ``walk``, if known): materialize cannot give them
    values, and eager construction would have made them real. Tensors materialize made meta
    (model code built them there), and those of modules held in containers rather than
    registered (a meta copy kept aside), do not count."""
    found = []
    registered = {id(m) for m in module.modules()}  # (a module held in a list may be on meta, as in eager)
    for path, mod, _, name, t in module_walk(module) if walk is None else walk:
        if id(mod) not in registered:
            continue
        t = getattr(t, "_local_tensor", t)  # a DTensor's local part
        if isinstance(t, torch.Tensor) and not is_deferred_tensor(t) and t.device.type == "meta" \
                and trace_serial(t) is None:
            found.append(f"{path}.{name}" if path else name)
    return list(dict.fromkeys(found))
