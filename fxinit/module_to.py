"""What ``Module.to(dtype)`` does to each tensor a model holds, for ``materialize(dtype=...)``.

``materialize(m, dtype=d)`` promises eager construction followed by ``m.to(d)``, and
``Module.to`` does not cast every tensor the model reaches:

- a parameter is cast in place (``param.data = param.to(d)``): the same object, everywhere
  it is held;
- a buffer slot is *replaced* by ``buf.to(d)``: one buffer object registered under two names
  (or two modules) becomes two tensors, and a plain attribute that held the buffer object
  (transformers' ``self.original_inv_freq = self.inv_freq``) keeps the old, uncast tensor;
- plain attributes and tensors in lists and dicts are left as they are.

Tensors whose dtype ``d`` does not change (integer buffers) are returned as they are by
``.to``, so they keep every tie. fxinit swaps values into the deferred objects in place;
these rules decide which value each object gets (:func:`takes_dtype`) and which slots get a
tensor of their own afterwards (:func:`separate_buffer_slots`). A module whose class has its
own ``_apply`` (timm's rotary embeddings rebuild their ``bands`` in float32 after a downcast;
others keep a ``dtype`` attribute in step) is cast by that code, as in eager: its tensors
materialize in the dtype they were built in, then ``module.to(d)`` runs
(:func:`casting_themselves`).

>>> import torch, fxinit
>>> class M(torch.nn.Module):
...     def __init__(self):
...         super().__init__()
...         f = torch.arange(4.)
...         self.register_buffer("a", f)
...         self.register_buffer("b", f)
...         self.kept = f
>>> m = fxinit.trace_init(M)
>>> _ = fxinit.materialize(m, dtype=torch.bfloat16)
>>> m.a.dtype, m.b.dtype, m.kept.dtype, m.a is m.b
(torch.bfloat16, torch.bfloat16, torch.float32, False)
"""

from __future__ import annotations

from typing import AbstractSet, Any, Iterable

import torch

from fxinit.capture.deferred import is_deferred_tensor
from fxinit.spec import dtype_after_to

Location = tuple[torch.nn.Module, str, str]  # (module, name, a kind of reachable.module_slots)

_PLAIN = frozenset({"__dict__", "container", "hook"})


def new_objects_on_conversion() -> bool:
    """Whether ``Module.to`` puts new objects in the parameters' places (``torch.__future__``'s
    ``set_overwrite_module_params_on_conversion``) or swaps them (``set_swap_module_params_on_conversion``)."""
    return torch.__future__.get_overwrite_module_params_on_conversion() or \
        torch.__future__.get_swap_module_params_on_conversion()


def _kinds(places: Iterable[Location]) -> set[str]:
    return {kind for _, _, kind in places}


def takes_dtype(t: torch.Tensor, places: list[Location], dtype: torch.dtype | None,
                within: AbstractSet[int] | None = None) -> bool:
    """Whether the deferred object ``t`` held at ``places`` is swapped with its value cast to
    ``dtype``: a parameter, a buffer no plain attribute holds, or a tensor materialized on its
    own (no places). A buffer also held as a plain attribute, or by a module outside ``within``
    (the modules, by ``id``, of the one whose ``.to`` this is), keeps its own dtype there, and
    its buffer slots get cast copies (:func:`separate_buffer_slots`)."""
    if dtype is None or dtype_after_to(t.dtype, dtype) == t.dtype or not places:
        return True
    kinds = _kinds(places)
    if "_parameters" in kinds:
        return True
    if within is not None and any(id(mod) not in within for mod, _, _ in places):
        return False
    return "_buffers" in kinds and not kinds & _PLAIN


def replaced_by_to(t: torch.Tensor, places: list[Location], dtype: torch.dtype | None) -> bool:
    """Whether ``Module.to(dtype)`` puts a tensor of its own in the place of the buffer ``t``
    held at ``places`` (without the attributes and hooks of ``t``: an ``nn.Buffer`` is one no more)."""
    return dtype is not None and bool(places) and dtype_after_to(t.dtype, dtype) != t.dtype \
        and "_parameters" not in _kinds(places)


def buffer_slots_apart(tensors: Iterable[torch.Tensor], where: dict[int, list[Location]],
                      dtype: torch.dtype | None, within: AbstractSet[int] | None = None
                      ) -> list[tuple[torch.Tensor, list[tuple[torch.nn.Module, str]], bool]]:
    """Decided before the swap, while ``tensors`` are deferred: the buffer slots that
    ``Module.to(dtype)`` gives tensors of their own, as ``(tensor, slots, cast)``. A buffer
    object in several slots keeps the first (it is swapped cast) and the others get copies
    (``cast`` False); one that a plain attribute or a module outside ``within`` also holds is
    swapped uncast, and every buffer slot of the modules ``within`` gets a cast copy (``cast`` True)."""
    out = []
    if dtype is None:
        return out
    for t in tensors:
        places = where.get(id(t), [])
        kinds = _kinds(places)
        if "_parameters" in kinds or dtype_after_to(t.dtype, dtype) == t.dtype:
            continue
        slots = [(mod, name) for mod, name, kind in places
                 if kind == "_buffers" and (within is None or id(mod) in within)]
        cast = not takes_dtype(t, places, dtype, within)
        if slots and (cast or len(slots) > 1):
            out.append((t, slots if cast else slots[1:], cast))
    return out


def separate_buffer_slots(apart: list[tuple[torch.Tensor, list[tuple[torch.nn.Module, str]], bool]],
                          dtype: torch.dtype) -> None:
    """After the swap (``tensors`` are real now): put in the slots of :func:`buffer_slots_apart`
    the tensors ``Module.to`` would have put there (with autograd, as ``Module._apply`` casts
    buffers: one computed from a parameter gets ``ToCopyBackward0``)."""
    for t, slots, cast in apart:
        with torch.set_grad_enabled(t.grad_fn is not None):
            for mod, name in slots:
                if mod._buffers.get(name) is t:
                    mod._buffers[name] = t.to(dtype_after_to(t.dtype, dtype)) if cast \
                        else t.clone(memory_format=torch.preserve_format)


#: ``_apply`` overrides whose effect on a ``.to(dtype)`` fxinit's own casting gives: torch's
#: RNNs (their flat-weight references, rebuilt around every swap), FSDP2's modules (resharding,
#: which a model being materialized has nothing to do), torchtitan's modules (annotations kept).
_APPLY_AS_PLAIN = frozenset({
    ("torch.nn.modules.module", "Module._apply"),
    ("torch.nn.modules.rnn", "RNNBase._apply"),
    ("torch.distributed.fsdp._fully_shard._fully_shard", "FSDPModule._apply"),
    ("torchtitan.protocols.module", "Module._apply"),
})


#: ``to`` overrides that read no tensor (Lightning's modules note the dtype, and build tensors of
#: ``self.dtype`` in ``forward``): fxinit casts as usual, then runs them.
_TO_NOTING_DTYPE = frozenset({
    ("lightning_fabric.utilities.device_dtype_mixin", "_DeviceDtypeModuleMixin.to"),
    ("lightning.fabric.utilities.device_dtype_mixin", "_DeviceDtypeModuleMixin.to"),
    ("transformers.modeling_utils", "PreTrainedModel.to"),  # (refuses quantized models, casts others)
})


def _code_key(fn: Any) -> tuple[str | None, str | None]:
    """``(module, qualname)`` of the code ``fn`` runs: read off its code object, which
    ``functools.wraps`` does not rename (transformers' ``PreTrainedModel.to`` is wrapped as
    ``Module.to``)."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    return getattr(fn, "__globals__", {}).get("__name__"), getattr(code, "co_qualname", code.co_name)


def _own_to(module: torch.nn.Module) -> tuple[str | None, str | None] | None:
    """``_code_key`` of the ``to`` of ``module``'s class, where it is not ``Module``'s."""
    fn = type(module).to
    return None if fn is torch.nn.Module.to else _code_key(fn)


def casting_themselves(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The outermost modules of ``module``'s tree (itself included) whose class has an
    ``_apply`` of its own that ``.to(dtype)`` runs in eager: what it does is that code's. So is
    ``module`` itself where its class has a ``to`` of its own that may read its tensors
    (``.to(dtype)`` calls the model's own ``to``, not its submodules')."""
    own_to = _own_to(module)
    if own_to is not None and own_to not in _TO_NOTING_DTYPE:
        return [module]
    found: dict[int, torch.nn.Module] = {}
    seen: set[int] = set()

    def visit(mod: torch.nn.Module) -> None:
        if id(mod) in seen:
            return
        seen.add(id(mod))
        if _code_key(type(mod)._apply) not in _APPLY_AS_PLAIN:
            found[id(mod)] = mod
            return
        for child in mod.children():
            visit(child)

    visit(module)
    return list(found.values())


def runs_own_to(module: torch.nn.Module, casting: list[torch.nn.Module]) -> bool:
    """Whether ``module``'s class has a ``to`` of its own that only notes the dtype, which
    ``casting`` (``casting_themselves``) does not run already: run once the tensors are cast,
    as eager's ``module.to(dtype)`` runs it."""
    return _own_to(module) in _TO_NOTING_DTYPE and not any(top is module for top in casting)


def cast_real(module: torch.nn.Module, dtype: torch.dtype, made: AbstractSet[int],
              inside: AbstractSet[int] = frozenset()) -> None:
    """``dtype=`` for the real tensors the model holds besides those this call made (``made``,
    by ``id``, cast as they were made): data loaded or kept as it was, and parts materialized
    before, by this trace or another (a module handed to the constructor). Cast as
    ``Module.to(dtype)`` casts them — a parameter in place through ``.data``, each buffer slot
    given a cast tensor of its own — so the whole model is eager construction followed by
    ``.to(dtype)``, in its order (a module's children before its own tensors), buffers with
    autograd (one computed from a parameter gets ``ToCopyBackward0``). Modules in ``inside``
    cast themselves (``casting_themselves``)."""
    for mod in _children_first(module):
        if id(mod) in inside:
            continue
        for kind in ("_parameters", "_buffers"):
            slots = getattr(mod, kind)
            for name, t in list(slots.items()):
                if t is None or id(t) in made or is_deferred_tensor(t) or hasattr(t, "_local_tensor"):
                    continue
                cast = dtype_after_to(t.dtype, dtype)
                if cast == t.dtype:
                    continue
                if kind == "_parameters":
                    with torch.no_grad():
                        t.data = t.data.to(cast)
                else:
                    slots[name] = t.to(cast)


def _children_first(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module``'s tree in the order ``Module._apply`` reaches each module's own tensors: its
    children's (recursively) first; each module once."""
    out: list[torch.nn.Module] = []
    seen: set[int] = {id(module)}
    stack: list[tuple[torch.nn.Module, Any]] = [(module, iter(module.children()))]
    while stack:
        mod, children = stack[-1]
        child = next(children, None)
        if child is None:
            stack.pop()
            out.append(mod)
        elif id(child) not in seen:
            seen.add(id(child))
            stack.append((child, iter(child.children())))
    return out
