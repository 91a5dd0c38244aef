"""Materializing: finding a model's deferred tensors, getting their values (``execute``, or
a checkpoint), and swapping the results into the user's objects.

Values are computed first for everything requested, then swapped in with
``torch.utils.swap_tensors``: the same Python objects become real tensors (Parameter
identity, Python attributes such as ``_is_hf_initialized`` and optimizer references
survive), and a failure while computing leaves every tensor deferred, never half done.
"""

from __future__ import annotations

import functools
import gc
import warnings
from collections import defaultdict
from typing import AbstractSet, Any, Callable, Iterable, Mapping, TypeVar

import torch
from torch.nn.modules.module import _IncompatibleKeys

from fxinit.autograd_links import plan_links
from fxinit.autograd_replay import relink
from fxinit.arguments import checked_device, checked_dtype, checked_seed
from fxinit.capture.api import clear_meta_init_cache, recorder_of_root
from fxinit.capture.call_guards import unguard, unguard_holders
from fxinit.capture.deferred import dressed_as, is_deferred_tensor, plain_attributes, state_of
from fxinit.capture.recorder import Recorder
from fxinit.capture.swap import swap
from fxinit.companions import companions, deferred_grad, with_companions
from fxinit.checkpoint import CheckpointSource, checkpoint_values, load_by_its_own_code, loads_by_its_own_code
from fxinit.distributed import deferred_dtensors, held_elsewhere, is_deferred_dtensor, materialize_dtensors
from fxinit.errors import DeferredInitError
from fxinit.kept_views import kept_views, remake_views
from fxinit.module_to import (Location, buffer_slots_apart, cast_real, casting_themselves, new_objects_on_conversion,
                              replaced_by_to, runs_own_to, separate_buffer_slots, takes_dtype)
from fxinit.rnn_weights import weak_references_dropped, weakref_holders
from fxinit.reachable import Slot, inner_tensors, left_behind, module_slots, module_walk
from fxinit.spec import dtype_after_to
from fxinit.values import TRACED_SEED, compute_values, moved, stream_seed, value_of_at_read


F = TypeVar("F", bound=Callable[..., Any])


def collection_paused(fn: F) -> F:
    """``fn`` run with Python's cyclic garbage collector paused. Planning and running a slice
    allocate tens of thousands of short-lived objects that hold no cycles, and the collections
    they set off walked the traced model's whole heap for nothing: 10% of a launch-bound
    materialize (a 32-layer Llama of hidden size 64: 31 against 34 ms, median of 16). Reference
    counting frees as always, and fxinit leaves no cyclic garbage there (a compiler it calls,
    ``compile=``, may: collected once the collector runs again, as soon as ``fn`` returns). The
    pause is process-wide, as ``gc.disable`` is."""
    @functools.wraps(fn)
    def paused(*args: Any, **kwargs: Any) -> Any:
        if not gc.isenabled():
            return fn(*args, **kwargs)
        try:
            gc.disable()
            return fn(*args, **kwargs)
        finally:
            gc.enable()

    return paused  # type: ignore[return-value]


def _module_tensors(mod: torch.nn.Module, buffers_only: bool = False) -> Iterable[tuple[str, str, torch.Tensor]]:
    """(kind, name, tensor) for a module's own deferred parameters, buffers, tensor attributes
    and tensors in list, tuple and dict attributes (kind ``"container"``)."""
    if buffers_only:
        return [(kind, name, t) for buffer, b in mod._buffers.items()
                for kind, name, t in [("_buffers", buffer, b), *(("inner", path, x) for path, x in inner_tensors(b, buffer))]
                if is_deferred_tensor(t)]
    return [(kind, name, t) for kind, name, t in module_slots(mod) if is_deferred_tensor(t)]


def _deferred_in_module(module: torch.nn.Module, walk: list[Slot] | None = None
                        ) -> tuple[list[torch.Tensor], dict[int, list[Location]]]:
    """The deferred tensors ``module`` holds (its ``module_walk`` is ``walk``, if known), and
    where each is held."""
    tensors: dict[int, torch.Tensor] = {}
    where: dict[int, list[Location]] = defaultdict(list)
    for _, mod, kind, name, t in module_walk(module) if walk is None else walk:
        if is_deferred_tensor(t):
            tensors.setdefault(id(t), t)
            where[id(t)].append((mod, name, kind))
    return list(tensors.values()), where


def is_deferred(obj: torch.nn.Module | torch.Tensor) -> bool:
    """True if ``obj`` (a module, recursively, or a tensor) still has deferred tensors."""
    if isinstance(obj, torch.nn.Module):
        return bool(_deferred_in_module(obj)[0]) or bool(deferred_dtensors(obj))
    return is_deferred_tensor(obj) or is_deferred_dtensor(obj) or bool(_deferred_inside(obj))


def _deferred_inside(t: torch.Tensor) -> list[torch.Tensor]:
    """The deferred tensors inside ``t``, a wrapper tensor subclass (``reachable.inner_tensors``)."""
    return list({id(x): x for _, x in inner_tensors(t, "") if is_deferred_tensor(x)}.values())


def _inner_slots(tensors: list[torch.Tensor], where: dict[int, list[Location]],
                 model: torch.nn.Module) -> list[tuple[torch.Tensor, str]]:
    """``(tensor, name)`` of the deferred tensors held inside wrapper subclasses (``"inner"``
    slots), named with their module's path (under the traced root; for a module made after
    the trace, under ``model``)."""
    found = []
    under_model: dict[int, str] | None = None
    for t in tensors:
        for mod, name, kind in where.get(id(t), ()):
            if kind == "inner":
                path = state_of(t).recorder.module_paths().get(id(mod))
                if path is None:
                    if under_model is None:
                        under_model = {id(m): p for p, m in model.named_modules(remove_duplicate=False)}
                    path = under_model.get(id(mod))
                found.append((t, f"{path}.{name}" if path else name))
    return found


def _same_device(asked: torch.device, recorded: torch.device) -> bool:
    """``asked`` names ``recorded`` (``cpu:0`` is the CPU; ``cuda`` the current CUDA device)."""
    return asked.type == recorded.type and (asked.type == "cpu" or asked.index in (None, recorded.index))


def _refuse_meta_wrappers(slots: Iterable[tuple[str, Any]]) -> None:
    """A wrapper tensor subclass around deferred tensors that says it is on meta (``(name,
    tensor)`` of ``slots``): its own code built it on the device a deferred tensor reported
    where subclasses' ``__torch_function__`` was off (inside a ``__torch_function__`` handler,
    ``DisableTorchFunctionSubclass``), and a deferred tensor is meta underneath. Eager's device
    is unknown: refused, whatever is asked."""
    for name, t in slots:
        if isinstance(t, torch.Tensor) and not is_deferred_tensor(t) and hasattr(type(t), "__tensor_flatten__") \
                and t.is_meta and _deferred_inside(t):
            raise DeferredInitError(
                f"{type(t).__name__} {name} is a wrapper tensor subclass around deferred tensors that says it is on "
                "'meta': its code read a deferred tensor's device where subclasses' __torch_function__ was off (in a "
                "__torch_function__ handler, or under torch._C.DisableTorchFunctionSubclass), where a deferred tensor "
                "cannot report its intended device, so eager's device is unknown",
                hint="wrap (quantize) after materializing, or build the wrapper with the device of the tensor it wraps "
                     "as seen outside those (torchao's NF4Tensor does)")


def _refuse_changing_wrappers(inner: list[tuple[torch.Tensor, str]], device: torch.device | None,
                              dtype: torch.dtype | None, state_dict: Any) -> None:
    """Tensors inside a wrapper subclass (``inner``, by name: torchao's ``NF4Tensor``) are
    filled in place, in the subclass object eager's code built around them, which keeps the
    device and dtype it was built with. What would change those, or load into the subclass,
    is that subclass's own code in eager (``.to``, ``copy_``): refused, not imitated."""
    changed = [name for t, name in inner if dtype is not None or state_dict is not None or (
        device is not None and device.type != "meta" and not _same_device(device, state_of(t).device))]
    if not changed:
        return
    what = "dtype=" if dtype is not None else "state_dict=" if state_dict is not None else f"device={str(device)!r}"
    more = f", and {len(changed) - 1} more" if len(changed) > 1 else ""
    raise DeferredInitError(
        f"materialize({what}) would change the tensors inside a wrapper tensor subclass ({changed[0]}{more}): "
        "in eager that is the subclass's own code (.to, load_state_dict), which fxinit does not imitate",
        hint="materialize without it, then call model.to(...) or load_state_dict(...) as after eager construction")


def _swap_in(tensors: list[torch.Tensor], values: list[torch.Tensor], where: dict[int, list[Location]],
             bare: AbstractSet[int] = frozenset()) -> None:
    # Tensors computed with autograd (a weight_norm'ed ``weight``) hold references to the
    # parameters they came from, and views (``x = w[1:3]``) to their base: swapping them
    # first releases those references; of the first, the ones computed last first, as they
    # may hold earlier ones, views too (``t = w * b`` holds ``b = w * 2``, ``w[1] * b`` its view),
    # and a base after its views (``b4 = b0.t()`` holds ``b0``, rebound by ``.data =`` since).
    # ``bare``: buffers cast by ``dtype=``, which eager's ``.to`` replaces by tensors of their own
    # (no attributes, no hooks: ``nn.Buffer``'s mark is gone).
    with plain_attributes():
        made = {id(t): state_of(t).node.meta.get("pos", 0) for t in tensors}
        for t in tensors:
            if t.grad_fn is not None and t._is_view() and id(t._base) in made:
                made[id(t._base)] = min(made[id(t._base)], made[id(t)] - 0.5)
        order = sorted(range(len(tensors)), key=lambda i: (
            tensors[i].grad_fn is None, tensors[i].grad_fn is None and not tensors[i]._is_view(),
            -made[id(tensors[i])]))
        grads = [(t, g) for t in tensors if (g := deferred_grad(t)) is not None]
        for t, _ in grads:
            t.grad = None  # the gradient's own swap needs its only reference; set again below
    for t, v in ((tensors[i], values[i]) for i in order):
        new = dressed_as(t, v, carry=id(t) not in bare)
        try:
            swap(t, new)
        except RuntimeError as exc:
            companions([t], where, {})  # its places in the whole model
            places = where.get(id(t))
            held = "use_count" in str(exc) or "gradient edge" in str(exc)  # autograd's saved tensors hold it
            if held:
                hint = ("something holds this tensor where fxinit cannot reach it: a computation kept with autograd "
                        "(a cache the model filled, a grad_fn's saved tensors) or a C++ holder (a torch.vmap over a "
                        "TensorDict of the parameters, as torchrl's reset_parameters runs): materialize before the step "
                        "that made the reference (running the model, that init step), or run it again after materialize")
            else:
                hint = "drop other references (weakrefs) to the deferred tensor, or materialize its module"
            if not places:
                raise DeferredInitError(
                    f"fxinit could not swap the materialized value into this tensor object: {exc}", hint=hint) from exc
            warnings.warn(f"fxinit: could not swap in place ({exc}); replaced the module attribute instead, "
                          "so other references to the old object stay deferred", stacklevel=3)
            if any(kind in ("container", "hook", "inner", "attribute") for _, _, kind in places):
                raise DeferredInitError(
                    f"fxinit could not swap the materialized value into a tensor kept in a container or a hook "
                    f"({places[0][1]}): {exc}", hint=hint if held else "drop other references to the deferred tensor"
                ) from exc
            for mod, name, kind in places:
                if kind == "__dict__":
                    setattr(mod, name, new)
                else:
                    getattr(mod, kind)[name] = new
    for t, g in grads:
        t.grad = g  # (deferred still where it was not materialized with ``t``: torch refuses it, as it should)


def _materialize_tensors(tensors: list[torch.Tensor], where: dict[int, list[Location]],
                         device: torch.device | str | None, init: bool,
                         loaded: Mapping[int, Callable[[], torch.Tensor]] | None = None,
                         seed: int | None = None, dtype: torch.dtype | None = None, compile: bool | str | None = None,
                         walked: dict[int, list[Slot]] | None = None, inside: AbstractSet[int] = frozenset(),
                         within: AbstractSet[int] | None = None) -> list[torch.Tensor]:
    """Compute (or, with ``loaded``, read from a checkpoint) and swap in, and say which tensors
    (``tensors`` and the others that went with them, real now); ``loaded`` maps
    ``id(tensor)`` to a reader of its checkpoint value (called once, just before the copy,
    so that only one checkpoint tensor is held at a time); ``walked``: ``module_walk`` of
    modules already walked, by ``id``; ``inside``: modules (by ``id``) whose tensors ``dtype``
    leaves as they are: those whose own code casts what only they hold, later
    (``module_to.casting_themselves``), and those held in containers, which ``.to`` does not reach;
    ``within``: the modules (by ``id``) of the module asked for, whose ``.to(dtype)`` eager's is:
    a tensor that goes with them from elsewhere (a pruned layer's) keeps its dtype."""
    tensors = with_companions(tensors, where, walked, all_places=dtype is not None)  # (where casts them)
    uncast = {id(t) for t in tensors if where.get(id(t)) and all(
        id(mod) in inside or (within is not None and id(mod) not in within) for mod, _, _ in where[id(t)])}

    def casts(t: torch.Tensor) -> bool:
        return id(t) not in uncast and takes_dtype(t, where.get(id(t), []), dtype, within)

    loaded = loaded or {}
    by_recorder: dict[int, tuple[Recorder, list[torch.Tensor]]] = {}
    for t in tensors:
        rec = state_of(t).recorder
        by_recorder.setdefault(id(rec), (rec, []))[1].append(t)
    target = torch.device(device) if device is not None else None
    if init and target is not None and target.type != "meta":
        _refuse_meta_values(tensors, loaded, target)
    elif init and target is None:
        _refuse_meta_values([t for t in tensors if state_of(t).recorder.meta_around], loaded, None)
    plan: list[tuple[list[torch.Tensor], list[torch.Tensor]]] = []
    for rec, ts in by_recorder.values():
        sharing = defaultdict(int)
        for t in ts:
            sharing[rec.storage_id(t)] += 1
        # A checkpoint tensor with a storage of its own is read straight to its device; one
        # that is a view of a shared storage is written into it after the storage is built.
        direct = [t for t in ts if id(t) in loaded and sharing[rec.storage_id(t)] == 1 and t.grad_fn is None]
        direct_ids = {id(t) for t in direct}
        rest = [t for t in ts if id(t) not in direct_ids]
        # Module.to(dtype) leaves plain attributes (and a buffer object a plain attribute holds) uncast
        cast = [casts(t) for t in rest]
        rest = [t for t, c in zip(rest, cast) if c] + [t for t, c in zip(rest, cast) if not c]
        n_cast = sum(cast)
        if init:
            portable = stream_seed(rec, seed)
            values = compute_values(rec, rest[:n_cast], target, portable, dtype, compile=compile) if n_cast else []
            if n_cast < len(rest):
                values += compute_values(rec, rest[n_cast:], target, portable, None, compile=compile)
        else:
            values = [_empty_like(t, target, dtype if i < n_cast else None) for i, t in enumerate(rest)]
        if target is not None:
            values = moved(values, target)
        with torch.no_grad():
            for t, v in zip(rest, values):
                if id(t) in loaded:
                    v.copy_(loaded[id(t)]())
            values += [_empty_like(t, target, dtype if casts(t) else None, whole_storage=True)
                       .copy_(loaded[id(t)]()) for t in direct]
        plan.append((rest + direct, values))
    links = plan_links(tensors, value_of_at_read(target, seed, compile) if init else None,
                       {id(t) for t in tensors if casts(t) and t.dtype != dtype} if dtype is not None else frozenset(),
                       dtype)  # (``.to`` gives a tensor already in ``dtype`` back as it is)
    apart = buffer_slots_apart([t for t in tensors if id(t) not in uncast], where, dtype, within)
    bare = {id(t) for t in tensors if casts(t) and replaced_by_to(t, where.get(id(t), []), dtype)}
    holders = weakref_holders(where, [*tensors, *(link.tensor for link in links)])
    views = kept_views(tensors)
    with weak_references_dropped(holders):
        for ts, values in plan:
            _swap_in(ts, values, where, bare)
        relink(links, tensors)  # (an RNN's flat weights may be tensors computed from parameters: AWD-LSTM's)
        remake_views(views)
    if dtype is not None:
        separate_buffer_slots(apart, dtype)
    return tensors


def _refuse_meta_values(tensors: list[torch.Tensor], loaded: Mapping[int, Any], target: torch.device | None) -> None:
    """Tensors built on meta (by the model, or under ``with torch.device("meta")`` or
    ``torch.set_default_device("meta")`` around the trace) have no values in eager
    construction either: there is nothing exact to put on ``target``. With no target,
    only those built so because of the default device around the trace are refused: a
    meta tensor handed back there would pass for a materialized one, while model code that
    builds on meta itself (a skeleton) gets meta tensors, as in eager construction."""
    meta = [t for t in tensors if state_of(t).device.type == "meta" and id(t) not in loaded]
    if not meta:
        return
    rec = state_of(meta[0]).recorder
    name = rec.storage_names().get(rec.storage_id(meta[0]), "a tensor")
    if target is None:
        raise DeferredInitError(
            f"{len(meta)} tensor(s), e.g. {name!r}, were built on the meta device because the default device was "
            "meta around trace_init (torch.set_default_device('meta') or `with torch.device('meta')`): eager "
            "construction gives meta tensors without values there, and so would this",
            hint="trace without it (fxinit defers every tensor by itself); or give them values first: "
                 "model.to_empty(device=...) and your init step (recorded), or materialize(..., state_dict=...)")
    raise DeferredInitError(
        f"{len(meta)} tensor(s), e.g. {name!r}, were built on the meta device, where eager construction "
        f"computes no values: they cannot be materialized on {target}",
        hint="trace without `with torch.device('meta')` around trace_init (fxinit defers every tensor by itself); "
             "or pass init=False to allocate them uninitialized, or state_dict= to load them")


def _empty_like(t: torch.Tensor, target: torch.device | None, dtype: torch.dtype | None = None,
                whole_storage: bool = False) -> torch.Tensor:
    """An empty tensor in ``t``'s layout (``dtype``: cast, as ``.to`` makes one of its own); with
    ``whole_storage``, and where the dtype stays, on a storage of ``t``'s size at ``t``'s offset
    (eager's ``load_state_dict`` copies into ``t`` as it is: a view of a temporary keeps it)."""
    device, cast = target or state_of(t).device, dtype_after_to(t.dtype, dtype)
    if whole_storage and cast == t.dtype:
        with plain_attributes():
            nbytes, offset = t.untyped_storage().nbytes(), t.storage_offset()
        if offset or nbytes != t.numel() * t.element_size():
            return torch.empty(nbytes // t.element_size(), dtype=cast, device=device).as_strided(
                t.size(), t.stride(), offset)
    return torch.empty_strided(t.size(), t.stride(), dtype=cast, device=device)


M = TypeVar("M", torch.nn.Module, torch.Tensor)


@collection_paused
def materialize(obj: M, *, device: torch.device | str | None = None, init: bool = True,
                keep_cache: bool = False, state_dict: CheckpointSource | None = None,
                prefix: str = "", strict: bool = True, rng: str = "exact", seed: int | None = None,
                dtype: torch.dtype | None = None, compile: bool | str | None = None) -> M:
    """Fill the deferred tensors of ``obj`` in place and return ``obj``.

    ``obj`` is a module (all its parameters and buffers, recursively; any submodule,
    in any order) or a deferred tensor. Values are bit-for-bit those of eager
    construction followed by any init recorded since. ``device=None`` keeps each tensor's
    intended device; otherwise values are computed where eager would have computed them
    and moved. ``init=False`` only allocates (the ``to_empty`` pattern).
    ``keep_cache=False`` clears the ``meta_init`` cache after materializing a tensor or
    module made under ``meta_init`` (seed semantics); pass True to materialize more later.

    ``state_dict`` (a dict, a ``.safetensors`` file, a ``torch.save`` file, or a checkpoint
    sharded over such files: a ``save_pretrained`` directory, its ``*.index.json``, or a list
    of files; files are memory-mapped and read tensor by tensor, and a shard is opened only
    when it holds a tensor asked for) provides values for the tensors it names
    (``prefix`` + their name under ``obj``): those are read straight onto their device and
    their init never runs; everything else initializes exactly, as if eager construction
    had been followed by ``load_state_dict``. Like ``load_state_dict``, ``strict=True`` (the
    default) refuses a checkpoint that lacks deferred tensors of ``obj`` or has keys under
    ``prefix`` that name none of its tensors, saying which prefix explains them when one
    does (``module.``, ``_orig_mod.``); with ``strict=False`` what the checkpoint lacks
    initializes exactly, and materialize returns ``load_state_dict``'s result
    (``missing_keys``, ``unexpected_keys``) instead of ``obj``. A module's extra state
    (``<module>._extra_state``) goes to its ``set_extra_state`` after the tensors, as
    ``load_state_dict`` does; tensors that are real already are not read. A model whose
    load hooks rename or rebuild what it reads runs its own ``load_state_dict``, recorded.

    When it returns, nothing reachable from a module ``obj`` (parameters, buffers, tensor
    attributes, tensors and modules in list and dict attributes) is deferred any more; a plain meta
    tensor there (built after the trace without being recorded) is refused before any work.

    ``rng="portable"`` draws every random op from the counter-based stream keyed by
    ``seed`` (default: the seed the trace saw), the name of the tensor it writes and the
    element index (see ``fxinit.rng.portable``): the same values in any order, for any
    subset, shard or thread count, on any device; not eager's values.

    ``dtype`` (floating point or complex) gives the floating-point and complex parameters
    and buffers that dtype,
    bit for bit as eager construction followed by ``module.to(dtype)``, without the
    full-precision model ever existing whole: each tensor is cast as soon as it is final,
    and a random fill read only through the cast is generated in chunks cast as they go.

    ``compile`` (portable mode): ``True`` runs uniform and normal fills, with the scale,
    shift, casts and exactly rounded element-wise ops around them, as kernels that
    torch.compile (Inductor) generates for the device (C++ on CPU, Triton on CUDA): the same
    values, bit for bit on CPU. Kernels depend only on the kind of fill and dtype (sizes,
    offsets and numbers are arguments), so a model compiles a handful; Inductor caches them
    across processes. ``None`` (default) takes the fastest: on CUDA fxinit's own Triton
    kernel (``rng.portable_triton``: a model's fills in a few launches, no Dynamo, safe from
    any thread), or where Triton cannot run its CUDA kernel built by NVRTC
    (``rng.portable_cuda``), on the CPU fxinit's C kernel. ``"triton"`` and ``"nvrtc"`` ask
    for those kernels (on CPU tensors only under ``TRITON_INTERPRET=1``, or compiled as C
    with ``FXINIT_NVRTC_ON_CPU=1``, to check bits). Exact mode draws from torch's own
    generators and compiles nothing.
    """
    if rng not in ("exact", "portable"):
        raise ValueError(f"rng={rng!r}: choose 'exact' or 'portable'")
    seed, dtype, device = checked_seed(seed), checked_dtype(dtype), checked_device(device)
    if dtype is not None and isinstance(obj, torch.nn.Module) and new_objects_on_conversion():
        # torch.__future__'s flags: eager's ``.to`` puts new objects in the parameters' places
        # (or swaps them): its own code runs, on the values materialized in the dtypes they were built in
        out = materialize(obj, device=device, init=init, keep_cache=keep_cache, state_dict=state_dict, prefix=prefix,
                          strict=strict, rng=rng, seed=seed, compile=compile)
        obj.to(dtype)
        return out
    if state_dict is not None and isinstance(obj, torch.nn.Module) and loads_by_its_own_code(obj):
        # its load hooks rename or rebuild what it reads: its own load_state_dict runs, recorded
        missing, unexpected = load_by_its_own_code(obj, state_dict, prefix, strict, init)
        materialize(obj, device=device, init=init, keep_cache=keep_cache, rng=rng, seed=seed, dtype=dtype,
                    compile=compile)
        return obj if strict else _IncompatibleKeys(missing, unexpected)  # type: ignore[return-value]
    seed_asked = None if rng == "exact" else (TRACED_SEED if seed is None else seed)
    walked: dict[int, list[Slot]] = {}
    if isinstance(obj, torch.nn.Module):
        walked[id(obj)] = module_walk(obj)
        tensors, where = _deferred_in_module(obj, walked[id(obj)])
        rec = recorder_of_root(obj)  # tensors the caller holds that share the model's storages
        tensors += [t for t in (rec.adopted if rec is not None else ()) if is_deferred_tensor(t)]
        _refuse_meta_wrappers((f"{path}.{name}" if path else name, t) for path, _, _, name, t in walked[id(obj)])
        inner = _inner_slots(tensors, where, obj)
    elif is_deferred_tensor(obj):
        tensors, where, inner = [obj], {}, []
    elif is_deferred_dtensor(obj):  # (its local tensor is computed as a shard: fxinit.distributed)
        tensors, where, inner = [], {}, []
    elif isinstance(obj, torch.Tensor):  # a wrapper subclass: the deferred tensors inside it
        inner = [(t, name) for name, t in inner_tensors(obj, type(obj).__name__) if is_deferred_tensor(t)]
        tensors, where = list({id(t): t for t, _ in inner}.values()), {}
        if not tensors:
            return obj
        _refuse_meta_wrappers([(type(obj).__name__, obj)])
    else:
        raise TypeError(f"materialize expects an nn.Module or a tensor, got {type(obj).__name__}")
    if isinstance(obj, torch.nn.Module):
        sharded = deferred_dtensors(obj, walked[id(obj)])
        held_elsewhere(sharded)
    else:
        sharded = {id(obj): (obj, [])} if is_deferred_dtensor(obj) else {}
    _refuse_changing_wrappers(inner, device, dtype, state_dict)
    if isinstance(obj, torch.nn.Module) and init:
        _refuse_left_behind(obj, walked[id(obj)])
    loaded = None
    set_extra_states: Callable[[], None] | None = None
    incompatible: list[list[str]] = []
    if state_dict is not None:
        if not isinstance(obj, torch.nn.Module):
            raise TypeError("state_dict= needs a module to name the tensors")
        loaded, set_extra_states = checkpoint_values(obj, tensors, state_dict, prefix, strict, sharded, incompatible)
    from_meta_init = any(state_of(t).recorder.kind == "meta_init" for t in tensors)
    if sharded:
        def compute(rec: Recorder, locals_: list[torch.Tensor], describe: Callable[[int], str]) -> list[torch.Tensor]:
            return compute_values(rec, locals_, None, stream_seed(rec, seed_asked), dtype, describe, compile)

        materialize_dtensors(sharded, device, init, compute, dtype,
                             {k: v for k, v in (loaded or {}).items() if k in sharded})
    casting = casting_themselves(obj) if dtype is not None and isinstance(obj, torch.nn.Module) else []
    inside = {id(m) for top in casting for m in top.modules()}
    if dtype is not None and isinstance(obj, torch.nn.Module):  # modules held in containers: .to does not reach them
        inside |= {id(mod) for _, mod, _, _, _ in walked[id(obj)]} - {id(m) for m in obj.modules()}
    recorders = _recorders_of(tensors)
    within = {id(m) for m in obj.modules()} if dtype is not None and isinstance(obj, torch.nn.Module) else None
    made = _materialize_tensors(tensors, where, device, init, loaded, seed_asked, dtype, compile, walked, inside,
                                within)
    if set_extra_states is not None:
        set_extra_states()
    unguard_holders(recorders, made)  # (a model materialized part by part keeps no hook either)
    if isinstance(obj, torch.nn.Module):
        unguard(obj)
        if dtype is not None:
            cast_real(obj, dtype, {id(t) for t in made}, inside)
            for top in casting + ([obj] if runs_own_to(obj, casting) else []):
                top.to(dtype)  # their own code, as eager's .to(dtype) runs it
    if from_meta_init and not keep_cache:
        clear_meta_init_cache()
    if state_dict is not None and not strict:
        return _IncompatibleKeys(*incompatible)  # type: ignore[return-value]
    return obj


def _recorders_of(tensors: Iterable[torch.Tensor]) -> list[Recorder]:
    """The recorders of deferred ``tensors``, each once."""
    return list({id(rec): rec for rec in (state_of(t).recorder for t in tensors)}.values())


def _refuse_left_behind(module: torch.nn.Module, walk: list[Slot] | None = None) -> None:
    left = left_behind(module, walk)
    if left:
        raise DeferredInitError(
            f"{len(left)} tensor(s) of this model are plain meta tensors that fxinit did not record, so materialize "
            f"cannot give them values: {', '.join(left[:6])}{' ...' if len(left) > 6 else ''}",
            hint="they were built after trace_init on a deferred tensor's device (which is 'meta' once the trace has "
                 "ended), or by to_empty(device='meta'); run that init step inside `with fxinit.recording(model):` "
                 "so that it is recorded, or build those tensors on a real device")


@collection_paused
def materialize_module(module: torch.nn.Module, buffers_only: bool = False,
                       check_fn: Callable[[torch.nn.Module], bool] | None = None) -> torch.nn.Module:
    """torchdistX-compatible: materialize ``module``'s tensors in place.

    ``check_fn(submodule) -> bool`` decides, for every submodule, whether it (and its
    subtree) is materialized; ``buffers_only`` leaves parameters deferred.
    """
    tensors: dict[int, torch.Tensor] = {}
    where: dict[int, list[Location]] = defaultdict(list)

    def visit(mod: torch.nn.Module) -> None:
        if check_fn is not None and not check_fn(mod):
            return
        for kind, name, t in _module_tensors(mod, buffers_only):
            tensors.setdefault(id(t), t)
            where[id(t)].append((mod, name, kind))
        for child in mod.children():
            visit(child)

    visit(module)
    _refuse_meta_wrappers((f"{path}.{name}" if path else name, t) for path, _, _, name, t in module_walk(module))
    recorders = _recorders_of(tensors.values())  # (before they are real)
    unguard_holders(recorders, _materialize_tensors(list(tensors.values()), where, None, True))
    return module


def materialize_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """torchdistX-compatible: the materialized tensor (the same object, filled in place)."""
    return materialize(tensor, keep_cache=True)
