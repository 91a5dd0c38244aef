"""The few graph ops of an InitGraph that are not aten ops.

An InitGraph is a torch.fx graph whose ``call_function`` nodes call aten overloads,
``operator.getitem`` and the functions here. Keeping this vocabulary small and named
is what lets a graph be checked, saved and replayed without the model's code.
"""

from __future__ import annotations

import functools
import gc
import importlib
import inspect
import operator
import types
from typing import Any, Callable

import torch
import torch.fx as fx

# Init functions that cannot be expressed as a static aten graph (data-dependent
# sampling, QR, randperm loops) or that return early on meta tensors. They are
# recorded as one node and replayed by calling the installed torch's own function.
OPAQUE_INIT_FUNCTIONS: tuple[str, ...] = (
    "torch.nn.init.trunc_normal_",
    "torch.nn.init._no_grad_trunc_normal_",
    "torch.nn.init.orthogonal_",
    "torch.nn.init.dirac_",
    "torch.nn.init.sparse_",
)
#: the opaque init functions that draw no random numbers (no generator to follow)
DRAW_NOTHING = frozenset({"torch.nn.init.dirac_"})


def per_target(fn: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``fn(target)`` computed once per graph op object. Keyed by the object's identity (it is
    kept alive with its answer): an ``OpOverload``'s ``__hash__`` is Python code, and the
    passes ask about every node several times."""
    memo: dict[int, tuple[Any, Any]] = {}

    @functools.wraps(fn)
    def answer(target: Any) -> Any:
        hit = memo.get(id(target))
        if hit is None or hit[0] is not target:
            hit = memo[id(target)] = (target, fn(target))
        return hit[1]

    return answer


def per_node(fn: Callable[[fx.Node], Any]) -> Callable[[fx.Node], Any]:
    """``fn(node)`` kept on the node: a node's arguments, spec and generators never change once
    it is recorded, and the passes ask about every node several times. A None answer is not
    kept (a node being recorded may not be complete yet)."""
    key = f"_fxinit_{fn.__name__}"

    @functools.wraps(fn)
    def answer(node: fx.Node) -> Any:
        found = node.__dict__.get(key)
        if found is None:
            found = fn(node)
            if found is not None:
                node.__dict__[key] = found
        return found

    return answer


def torch_own(qualname: str) -> types.FunctionType | None:
    """torch's own function object ``qualname``, also where other code has put another in its
    place while fxinit is imported (transformers' ``no_init_weights`` and
    ``guard_torch_init_functions`` do, for a while); None where torch has none."""
    module_name, _, attr = qualname.rpartition(".")
    fn = getattr(importlib.import_module(module_name), attr, None)
    fn = inspect.unwrap(fn) if fn is not None else None
    if isinstance(fn, types.FunctionType) and fn.__module__ == module_name and fn.__qualname__ == attr:
        return fn
    for obj in gc.get_objects():  # the stand-in's owner keeps torch's object somewhere
        if isinstance(obj, types.FunctionType) and obj.__module__ == module_name and obj.__qualname__ == attr:
            return obj
    return None


#: qualname -> torch's own init function object (its body may be changed by
#: ``capture.init_shims``), not what other code puts in its place for a while
TORCH_FUNCTIONS = {q: fn for q in OPAQUE_INIT_FUNCTIONS if (fn := torch_own(q)) is not None}


def resolve_init_function(qualname: str) -> types.FunctionType:
    """torch's own function object that an opaque node names (only the allowed set resolves):
    the one that ran at capture and runs at replay, whatever another library has put in its
    place in ``torch.nn.init`` for a while."""
    if qualname not in OPAQUE_INIT_FUNCTIONS:
        raise ValueError(f"{qualname!r} is not an init function fxinit may call")
    fn = TORCH_FUNCTIONS.get(qualname)
    if fn is None:
        raise AttributeError(f"torch {torch.__version__} has no {qualname}")
    return fn


#: Node arguments naming a device, which a plan maps where the device is absent (``Plan.device_map``).
DEVICE_KWARGS = ("device", "default_device")


def call_init_function(qualname: str, tensor: torch.Tensor, *args: Any, default_device: torch.device | None = None,
                       **kwargs: Any) -> torch.Tensor:
    """Graph op: run an opaque init function in place on ``tensor``.

    The backend sets up the generators (the snapshots recorded at capture) around it.
    ``default_device``: the default device eager ran the function under (``with
    torch.device("cuda")``; the CPU when not given), whatever the default device around the
    replay: what the function builds without ``device=`` is built there again (``sparse_``'s
    ``randperm``), drawing from that device's generator as eager's did.
    """
    with torch.device(default_device if default_device is not None else "cpu"):
        resolve_init_function(qualname)(tensor, *args, **kwargs)
    return tensor


call_init_function.__module__ = "fxinit.ops"


@per_target
def changes_view(target: Any) -> bool:
    """In-place view ops (``t_``, ``unsqueeze_``, ``as_strided_``...): the tensor object they
    are given becomes another view of its storage. A graph gives the result its own node,
    and replay runs the op on an alias (``replay_args``), so that values taken before keep
    their view."""
    return isinstance(target, torch._ops.OpOverload) and torch.Tag.inplace_view in target.tags


def replay_args(target: Any, args: tuple) -> tuple:
    """The arguments to run graph op ``target`` with when replaying it: ``args``, except that
    an in-place view op gets an alias of its input instead of the input's own value."""
    if changes_view(target) and args and isinstance(args[0], torch.Tensor):
        return (torch.ops.aten.alias.default(args[0]), *args[1:])
    return args


_READS_GRAD_MODE = frozenset({torch.ops.aten.mkldnn_rnn_layer.default})


@per_target
def reads_grad_mode(target: Any) -> bool:
    """Whether kernel ``target`` gives other values with autograd off (oneDNN's LSTM picks its
    inference primitive under no_grad: other bits): replayed in the grad mode it was recorded in."""
    return target in _READS_GRAD_MODE

#: Factories whose result holds whatever the memory held (``torch.empty`` & co.).
ALLOCATIONS = frozenset({
    torch.ops.aten.empty.memory_format, torch.ops.aten.empty_like.default, torch.ops.aten.empty_strided.default,
    torch.ops.aten.new_empty.default, torch.ops.aten.new_empty_strided.default,
})

# Ops that read only the shape, dtype and device of their tensor argument.
_METADATA_ONLY = frozenset(getattr(torch.ops.aten, name) for name in (
    "new_zeros", "new_empty", "new_ones", "new_full", "new_empty_strided", "empty_like", "zeros_like", "ones_like",
    "full_like", "rand_like", "randn_like"))


#: Factories of a tensor holding one value: op -> the value, or the index of the argument holding it.
_CONSTANT_FACTORIES: dict[Any, tuple[str, Any]] = {
    **{getattr(torch.ops.aten, name).default: ("value", 0) for name in ("zeros", "new_zeros", "zeros_like")},
    **{getattr(torch.ops.aten, name).default: ("value", 1) for name in ("ones", "new_ones", "ones_like")},
    torch.ops.aten.full.default: ("arg", 1), torch.ops.aten.full_like.default: ("arg", 1),
    torch.ops.aten.new_full.default: ("arg", 2),
}


@per_target
def _constant_factory(target: Any) -> tuple[str, Any] | None:
    return _CONSTANT_FACTORIES.get(target)


def constant_value(node: fx.Node) -> Any:
    """The value every element of ``node``'s new tensor holds (``zeros``, ``new_full``...), or
    None for other nodes."""
    how = _constant_factory(node.target) if node.op == "call_function" else None
    if how is None:
        return None
    kind, where = how
    if kind == "value":
        return where
    value = node.args[where] if len(node.args) > where else node.kwargs.get("fill_value")
    return value if isinstance(value, (bool, int, float)) else None


@per_target
def _view_op(target: Any) -> bool:
    if target is torch.ops.aten._unsafe_view.default:  # declared fresh, but a view of its input's storage
        return True
    if not isinstance(target, torch._ops.OpOverload) or not target._schema.returns:
        return False
    alias = target._schema.returns[0].alias_info
    return alias is not None and not alias.is_write


def is_view(node: fx.Node) -> bool:
    """``node``'s value is a view of its first argument (``view``, ``t``, ``slice``,
    ``detach``, ``split``...; ``getitem`` of a view op's list): it reads no data."""
    if node.target is operator.getitem:
        parent = node.args[0] if node.args else None
        return isinstance(parent, fx.Node) and is_view(parent)
    return _view_op(node.target)


def view_base(node: fx.Node) -> fx.Node:
    """The node whose storage ``node``'s value views: up through views to the first non-view."""
    while is_view(node) and node.args and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    return node


def reads_no_data(node: fx.Node) -> bool:
    """Whether ``node`` reads only the metadata of its tensor argument (``empty_like``, ``new_zeros``...)."""
    return _metadata_only(node.target)


@per_target
def _metadata_only(target: Any) -> bool:
    return getattr(target, "overloadpacket", None) in _METADATA_ONLY


def allocates(node: fx.Node) -> bool:
    """Whether running ``node`` creates a new storage (not a view, not in place)."""
    if node.meta.get("spec") is None:
        return False
    if node.op == "get_attr":
        return True
    return _returns_new(node.target)


@per_target
def _returns_new(target: Any) -> bool:
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.returns:
        return False
    return schema.returns[0].alias_info is None


def draws_random(target: Any, args: tuple | None = None, kwargs: dict | None = None) -> bool:
    """Whether graph op ``target`` draws random numbers (it is seeded or takes a generator).
    Given a call's arguments: the attention kernels draw only for dropout, so not with
    ``dropout_p=0`` (the CPU's flash attention, which eager picks in constructors)."""
    if not _seeded(target):
        return False
    at = _attention_dropout(target)
    if at is None or args is None:
        return True
    p = args[at] if at < len(args) else (kwargs or {}).get("dropout_p", target._schema.arguments[at].default_value)
    return not (isinstance(p, (int, float)) and p == 0)


@per_target
def _seeded(target: Any) -> bool:
    if target is call_init_function:
        return True
    return isinstance(target, torch._ops.OpOverload) and (torch.Tag.nondeterministic_seeded in target.tags or any(
        "Generator" in str(a.type) for a in target._schema.arguments))


@per_target
def _attention_dropout(target: Any) -> int | None:
    """The position of a ``_scaled_dot_product_*`` kernel's ``dropout_p``, else None."""
    if not target.__name__.startswith("_scaled_dot_product_"):
        return None
    names = [a.name for a in target._schema.arguments]
    return names.index("dropout_p") if "dropout_p" in names else None


def filled_argument(node: fx.Node) -> int | None:
    """Which argument an in-place op writes: 1 for an opaque init function (``(name,
    tensor)``), 0 for an aten op that writes its first argument, None for others."""
    if node.target is call_init_function:
        return 1
    return _writes_first(node.target)


@per_target
def _writes_first(target: Any) -> int | None:
    schema = getattr(target, "_schema", None)
    first = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
    return 0 if first is not None and first.is_write else None


def is_random(node: fx.Node) -> bool:
    """Whether ``node`` draws random numbers (it carries the generators it draws from)."""
    return bool(node.meta.get("generators"))


def op_name(node: fx.Node) -> str:
    """``normal_``, ``constant``, ``trunc_normal_`` (opaque init functions by their name)."""
    if node.op == "get_attr":
        return "constant"
    if node.meta.get("opaque"):
        return node.meta["opaque"].rsplit(".", 1)[-1]
    return getattr(getattr(node.target, "overloadpacket", node.target), "__name__", str(node.target))


@per_target
def positional_generator(target: Any) -> int | None:
    """Where op ``target``'s schema takes a generator that is not keyword-only (``poisson``,
    ``binomial``: the dispatcher passes it among the arguments), if it does."""
    schema = getattr(target, "_schema", None)
    arguments = schema.arguments if schema is not None else ()
    return next((i for i, a in enumerate(arguments) if a.name == "generator" and not a.kwarg_only), None)
