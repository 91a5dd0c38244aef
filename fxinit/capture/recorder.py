"""The Recorder: turns aten calls on deferred tensors into init-graph nodes.

One Recorder backs one ``trace_init`` (or one ``meta_init`` block) and everything done to
its tensors afterwards. For every op it

1. lifts real tensors among the arguments into graph constants,
2. runs PyTorch's meta kernel to learn output shapes, strides and aliasing,
3. appends an fx node with the storages the op read and wrote,
4. for random ops, snapshots the generator and advances it exactly as eager would,
5. keeps a small exact *shadow* value for tensors computed only from constants (drop-path
   schedules, ``arange``), so data-dependent Python on them (``.item()``, ``.tolist()``)
   gets the eager answer.
"""

from __future__ import annotations

import contextlib
import functools
import operator
import os
import sys
import types
import weakref
from typing import Any, Callable, Iterable, Iterator

import torch
import torch.fx as fx
from torch._C import TensorBase

from fxinit import execute
from fxinit.capture.deferred import STATE_ATTR, DeferredState, DeferredTensor, is_deferred_tensor, state_of
from fxinit.capture.names import tensor_slots
from fxinit.capture.opaque import find_opaque_call
from fxinit.capture.provenance import called_from, current_provenance, format_source, module_path_from_stack, user_frame
from fxinit.capture.skips import LazyCpuGenerator
from fxinit.errors import DeferredInitError
from fxinit.spec import TensorSpec
from fxinit.ops import ALLOCATIONS, call_init_function, changes_view, draws_random, resolve_init_function
from fxinit.rng import Snapshot, default_generator_for, mt19937, snapshot
from fxinit.passes.fingerprint import fingerprint
from fxinit.rng.draws import call_key, cpu_draws

aten = torch.ops.aten
_META = torch.device("meta")
_CPU = torch.device("cpu")

#: Tensors up to this many elements computed only from constants get an exact shadow as
#: they are recorded.
EAGER_SHADOW_LIMIT = 1 << 12
#: Storages up to this many elements keep the exact value computed when Python first
#: reads them (and lifted constants keep theirs from the start).
SHADOW_LIMIT = 1 << 16
#: When Python needs the value of a deferred tensor, its slice is run for real if the slice
#: allocates at most this many bytes (counting every intermediate).
EVAL_BUDGET = 16 << 20

_DETACH = aten.detach.default
_DISTRIBUTED_DIR = os.path.join(os.path.dirname(torch.__file__), "distributed") + os.sep
_DTENSOR_DIR = os.path.join(_DISTRIBUTED_DIR, "tensor") + os.sep
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor"}
_SCALAR_FACTORIES = {aten.scalar_tensor.default, aten.lift_fresh.default}
# In-place ops whose result does not depend on the old contents of what they write.
_OVERWRITE_OPS = {
    aten.uniform_, aten.normal_, aten.bernoulli_, aten.exponential_, aten.random_, aten.cauchy_,
    aten.log_normal_, aten.geometric_, aten.fill_, aten.zero_, aten.copy_,
}
_LIFT_OPS = {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.lift.default}
_DATA_DEPENDENT = {
    aten._local_scalar_dense.default,
    aten.is_nonzero.default,
    aten.equal.default,
    aten.nonzero.default,
    aten.masked_select.default,
    aten._unique2.default,
    aten.unique_dim.default,
    aten.unique_consecutive.default,
    aten.bincount.default,
    aten.repeat_interleave.Tensor,
    aten._assert_async.default,
    aten._assert_async.msg,
}
_WHAT_THE_USER_WROTE = {
    aten._local_scalar_dense.default: "reading a value (Tensor.item(), bool(t) as in `if t > 0:`, float(t), int(t))",
    aten.is_nonzero.default: "bool(tensor) (e.g. `if t:` or `if t.any():`)",
    aten.nonzero.default: "Tensor.nonzero() / torch.where(cond)",
    aten.equal.default: "torch.equal",
}


@functools.lru_cache(maxsize=None)
def _takes_generator(func: Any) -> bool:
    return any(a.name == "generator" for a in func._schema.arguments)


# Ops that write into arguments their schema does not mark as written (running stats).
_UNANNOTATED_WRITES = {
    aten.native_batch_norm.default: (3, 4),
    aten.cudnn_batch_norm.default: (3, 4),
    aten.miopen_batch_norm.default: (3, 4),
}


@functools.lru_cache(maxsize=None)
def _mutated_arg_indices(func: Any) -> tuple[int, ...]:
    marked = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    return (*marked, *(i for i in _UNANNOTATED_WRITES.get(func, ()) if i not in marked))


def _schema_value(func: Any, args: tuple, kwargs: dict, i: int) -> Any:
    if i < len(args):
        return args[i]
    return kwargs.get(func._schema.arguments[i].name)


# Aten arguments and results nest only tuples, lists and dicts (torch.Size is a tuple of
# ints, which no mapped function changes): walking them directly costs a fraction of
# torch's general pytree, which dominated capture time per op.
# Leaves every mapped function returns unchanged: not worth a call each.
_PLAIN = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


def _map(fn: Callable[[Any], Any], x: Any) -> Any:
    """``tree_map`` over the containers of aten arguments and results (``fn`` must return
    ints, floats, strings, dtypes, devices, layouts, memory formats and None unchanged)."""
    t = type(x)
    if t is tuple:
        return tuple([v if type(v) in _PLAIN else _map(fn, v) for v in x])
    if t is list:
        return [v if type(v) in _PLAIN else _map(fn, v) for v in x]
    if t is dict:
        return {k: v if type(v) in _PLAIN else _map(fn, v) for k, v in x.items()}
    return fn(x)


def _leaves(x: Any, out: list[Any] | None = None) -> list[Any]:
    """``tree_flatten(x)[0]`` for the containers of aten arguments and results."""
    out = [] if out is None else out
    t = type(x)
    if t is tuple or t is list:
        for v in x:
            _leaves(v, out)
    elif t is dict:
        for v in x.values():
            _leaves(v, out)
    else:
        out.append(x)
    return out


def _tensors_in(x: Any) -> list[torch.Tensor]:
    return [t for t in _leaves(x) if isinstance(t, torch.Tensor)]


def _untyped_storage_key(t: torch.Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return TensorBase.untyped_storage(t)._cdata


# The address of a tensor's storage: torch's own accessor skips building a storage object.
_storage_key: Callable[[torch.Tensor], int] = getattr(torch._C, "_storage_id", _untyped_storage_key)


class StorageInfo:
    """One (meta) storage: an id for slicing and an optional exact shadow value."""

    __slots__ = ("sid", "keepalive", "shadow")

    def __init__(self, sid: int, keepalive: Any) -> None:
        self.sid = sid
        self.keepalive = keepalive
        self.shadow: torch.Tensor | None = None  # flat real CPU tensor over the whole storage


class Recorder:
    """Records init ops of one trace into an fx graph."""

    def __init__(self, kind: str = "trace") -> None:
        self.kind = kind
        self.graph = fx.Graph()
        self.constants: dict[str, torch.Tensor] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self.lazy_cpu = LazyCpuGenerator()  # the default CPU generator, skipped lazily inside capture
        self.random_ops = {"skipped": 0, "drawn": 0}  # how capture kept generators in step
        self.seed = torch.initial_seed()  # the default for the portable stream
        self.default_dtype = torch.get_default_dtype()
        self.capturing = False
        self.cleared = False
        self._pos = 0
        self._storages: dict[int, StorageInfo] = {}
        self._suspended = 0
        self._root: weakref.ReferenceType | None = None
        self._paths: dict[int, str] = {}
        self._intended: torch.device | None = None
        self._module_ref: weakref.ReferenceType | None = None
        self.call_site: types.FrameType | None = None  # the caller of the torch function being run (modes.py)
        self._given_names: dict[int, str] = {}  # storage id -> name (global tensors of DTensors)

    # ------------------------------------------------------------------ helpers
    @contextlib.contextmanager
    def suspended(self) -> Iterator[None]:
        """Real computation inside capture: the capture modes let ops through."""
        self._suspended += 1
        try:
            yield
        finally:
            self._suspended -= 1

    @property
    def is_suspended(self) -> bool:
        return self._suspended > 0

    def set_root(self, module: torch.nn.Module) -> None:
        self._root = weakref.ref(module)
        modules = list(module.named_modules(remove_duplicate=False))  # one walk for paths and names
        self._paths = _paths_of(modules)
        self._trace_names = self._current_names(modules)
        self.stamp_module_paths()

    def stamp_module_paths(self) -> None:
        """Give every node recorded so far ``meta["module"]``, its module's path now (at the
        end of the trace for the traced ops), so that later wrapping does not rename it."""
        paths = self.module_paths()
        for n in self.graph.nodes:
            ref = n.meta.get("module_ref")
            if "module" not in n.meta and ref is not None and ref() is not None and id(ref()) in paths:
                n.meta["module"] = paths[id(ref())]

    def _current_names(self, modules: list[tuple[str, torch.nn.Module]] | None = None) -> dict[int, str]:
        """``{storage id: smallest fully qualified name of a deferred tensor in it}`` now."""
        names: dict[int, str] = {}
        root = self.root
        if root is None:
            return names
        for fqn, _, _, _, t in tensor_slots(root, modules):
            if is_deferred_tensor(t) and state_of(t).recorder is self:
                sid = self.storage_id(t)
                if sid not in names or fqn < names[sid]:
                    names[sid] = fqn
        return names

    def storage_names(self) -> dict[int, str]:
        """Names of storages for portable stream keys: as they were when the trace ended
        (so that later wrapping, e.g. FSDP's sharding, does not rename them), plus the
        current names of storages created after it."""
        names = self._current_names()
        names.update(self._given_names)
        names.update(getattr(self, "_trace_names", {}))
        return names

    def name_storage(self, t: torch.Tensor, name: str) -> None:
        """Name ``t``'s storage for portable stream keys (a tensor the model does not hold)."""
        self._given_names[self.storage_id(t)] = name

    def fingerprint(self, tensors: list[torch.Tensor]) -> str:
        """A digest of what computes the current values of ``tensors`` (passes.fingerprint)."""
        nodes = execute.slicer(self).required([(state_of(t).node, self.storage_id(t)) for t in tensors])[0]
        return fingerprint(nodes, self.constants, self.snapshots)

    @property
    def root(self) -> torch.nn.Module | None:
        """The traced model, while it is alive."""
        return self._root() if self._root is not None else None

    def module_paths(self) -> dict[int, str]:
        """id(module) -> dotted path under the traced root (empty while it is being built)."""
        root = self._root() if self._root is not None else None
        if root is not None and not self._paths:
            self._paths = _paths_of(root.named_modules(remove_duplicate=False))
        return self._paths

    def _storage(self, t: torch.Tensor) -> StorageInfo:
        key = _storage_key(t)
        info = self._storages.get(key)
        if info is None:
            with torch._C.DisableTorchFunctionSubclass():
                st = TensorBase.untyped_storage(t)
            info = StorageInfo(len(self._storages), st)  # kept alive: its key is never reused
            self._storages[key] = info
        return info

    def storage_id(self, t: torch.Tensor) -> int:
        return self._storage(t).sid

    def shadow_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The exact real value of deferred ``t`` if it is known (small, constant-derived)."""
        if not is_deferred_tensor(t):
            return t
        info = self._storage(t)
        flat = info.shadow
        if flat is None or flat.dtype != t.dtype:
            return None
        with self.suspended():  # also reached outside the dispatch mode's handler (from property hooks)
            return flat.as_strided(t.size(), t.stride(), t.storage_offset())

    def value_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The exact current value of deferred ``t`` on the CPU, if it is cheap to know.

        Small constant-derived tensors have a shadow. Others with a slice of at most
        EVAL_BUDGET bytes are computed by running that slice of the graph recorded so far:
        every random op in it carries its generator snapshot, so this is exact and touches
        no user generator; a small storage keeps the result as its shadow until it is next
        written. Costlier ones return None (the caller refuses).
        """
        shadow = self.shadow_of(t)
        if shadow is not None:
            return shadow
        node = state_of(t).node
        targets = [(node, self.storage_id(t))]
        nodes = execute.slicer(self, eliminate_dead=False).required(targets, to_run=True)[0]
        if sum(n.meta["spec"].nbytes for n in nodes if n.meta.get("spec") is not None) > EVAL_BUDGET:
            return None
        todo = execute.plan(self, targets, device_map=_unavailable_to_cpu(nodes), eliminate_dead=False)
        with self.suspended():
            value = execute.run(self, todo, workers=1)[node].to("cpu")
            if value.untyped_storage().nbytes() <= SHADOW_LIMIT * value.element_size():
                self._set_shadow(t, value)  # the whole storage, as it is now: the next read is free
            return value

    def dead_writes(self) -> set[fx.Node]:
        """Writes overwritten unread so far (passes.dead_init); recomputed as the graph grows."""
        return execute.program_dead_writes(self)

    def _set_shadow(self, t: torch.Tensor, real: torch.Tensor) -> None:
        if real.stride() != t.stride() or real.storage_offset() != t.storage_offset() or real.dtype != t.dtype:
            return
        if real.device.type != "cpu":
            return
        with self.suspended():  # also reached outside the dispatch mode's handler (lift from a function mode)
            flat = torch.empty(0, dtype=real.dtype, device=_CPU).set_(real.detach().untyped_storage())
        self._storage(t).shadow = flat

    def _wrap(self, meta: torch.Tensor, node: fx.Node, device: torch.device) -> torch.Tensor:
        node.meta["spec"] = TensorSpec.of(meta, device)
        return self._deferred(meta, node, device)

    def _deferred(self, meta: torch.Tensor, node: fx.Node, device: torch.device) -> torch.Tensor:
        with torch._C._DisableTorchDispatch():
            t = torch.Tensor._make_subclass(DeferredTensor, meta, meta.requires_grad)
        t.__dict__[STATE_ATTR] = DeferredState(self, node, device)
        return t

    def _detached(self, t: torch.Tensor) -> torch.Tensor:
        """``t.detach()``: a new tensor object for the same value, so the same node (every
        ``nn.Parameter(...)`` detaches: a node each would be a quarter of a model's graph)."""
        with torch._C._DisableTorchDispatch():
            meta = aten.detach.default(t)
        st = state_of(t)
        return self._deferred(meta, st.node, st.device)  # the node's spec holds for the same view

    def _node(self, target: Any, args: tuple, kwargs: dict, op: str = "call_function") -> fx.Node:
        # Arguments are set after creation: create_node would walk them with torch's general
        # pytree looking for symbolic ints, which capture never produces (sizes are concrete),
        # at a cost per op comparable to the rest of recording.
        node = self.graph.create_node(op, target, (), {}, name=_node_name(self.graph, target))
        if args or kwargs:
            set_both = getattr(node, "_update_args_kwargs", None)  # one update instead of two (fx >= 1.10)
            if set_both is not None:
                set_both(args, kwargs)
            else:
                node.args = args
                node.kwargs = kwargs
        node.meta["pos"] = self._pos
        self._pos += 1
        dt = torch.get_default_dtype()
        if dt != self.default_dtype:
            node.meta["default_dtype"] = dt
        prov, module = current_provenance(self.call_site or sys._getframe(2))
        node.meta["prov"] = prov
        if module is not None:
            ref = self._module_ref
            if ref is None or ref() is not module:  # consecutive ops mostly share their module
                ref = self._module_ref = weakref.ref(module)
            node.meta["module_ref"] = ref
        return node

    # ------------------------------------------------------------------ errors
    def fail(self, what: str, op: str | None, hint: str) -> DeferredInitError:
        frame = sys._getframe(1)
        return DeferredInitError(
            what,
            op=op,
            module=module_path_from_stack(frame, self.module_paths()),
            source=format_source(user_frame(frame)),
            hint=hint,
        )

    def fail_raw_access(self, func: Any) -> None:
        raise self.fail(
            "fxinit cannot give raw storage access to a deferred tensor (it has no data yet)",
            op=getattr(func, "__name__", str(func)),
            hint="materialize the tensor first, or guard this code with `if not fxinit.is_meta_init():`",
        )

    def _check_live(self) -> None:
        if self.cleared:
            raise DeferredInitError(
                "this deferred tensor's meta-init cache was cleared, so it can no longer be materialized",
                hint="pass keep_cache=True to materialize() when materializing tensors one at a time",
            )

    # ------------------------------------------------------------------ constants
    def lift(self, real: torch.Tensor, device: torch.device | None = None) -> torch.Tensor:
        """A deferred tensor whose value is a copy of ``real`` (a graph constant)."""
        if is_deferred_tensor(real):
            return real
        with self.suspended(), torch.no_grad():
            value = torch.empty_strided(real.size(), real.stride(), dtype=real.dtype, device=real.device)
            value.copy_(real.detach())
        name = f"_const{len(self.constants)}"
        self.constants[name] = value
        node = self._node(name, (), {}, op="get_attr")
        with torch._C._DisableTorchDispatch():
            meta = torch.empty_strided(real.size(), real.stride(), dtype=real.dtype, device=_META)
        t = self._wrap(meta, node, real.device)
        if value.numel() <= SHADOW_LIMIT:
            with self.suspended():
                self._set_shadow(t, value.to("cpu", copy=True) if value.device.type != "cpu" else value.clone())
        if device is not None and device.type == "meta":
            # A copy to meta that eager makes (``torch.tensor(data, device="meta")``): dispatch
            # would read device=meta on a deferred input as "like the input".
            with torch._C._DisableTorchDispatch():
                mout = aten._to_copy.default(t, device=_META)
            t = self._record(aten._to_copy.default, (t,), {"device": device}, [t], mout, device)
        elif device is not None and device != real.device:
            t = self.dispatch(aten._to_copy.default, (t,), {"device": device})
        return t

    def constant_from(self, func: Callable, args: tuple, kwargs: dict) -> torch.Tensor:
        """``torch.tensor(data)``, ``from_numpy`` & co. during capture."""
        kwargs = dict(kwargs)
        device = kwargs.pop("device", None)
        requires_grad = kwargs.pop("requires_grad", False)
        data = args[0] if args else kwargs.get("data")
        if is_deferred_tensor(data):
            dtype = kwargs.get("dtype")
            out = data.to(dtype=dtype or data.dtype, device=device or state_of(data).device,
                          copy=func is torch.tensor)
            return out.detach().requires_grad_(requires_grad) if func is torch.tensor else out
        if device is None:
            from fxinit.capture.modes import _default_device

            device = _default_device() if func not in (torch.from_numpy, torch.frombuffer) else _CPU
        with self.suspended():
            real = func(*args, **kwargs) if func in (torch.from_numpy, torch.frombuffer) else func(*args, device="cpu", **kwargs)
        t = self.lift(real, torch.device(device))
        if requires_grad:
            t.requires_grad_(True)
        return t

    def new_tensor(self, self_t: torch.Tensor, data: Any, dtype: torch.dtype | None = None,
                   device: Any = None, requires_grad: bool = False, **_: Any) -> torch.Tensor:
        st = state_of(self_t)
        target = torch.device(device) if device is not None else st.device
        if is_deferred_tensor(data):
            out = data.detach().to(dtype=dtype or data.dtype, device=target, copy=True)
        else:
            with self.suspended():
                real = torch.tensor(data, dtype=dtype or self_t.dtype, device="cpu")
            out = self.lift(real, target)
        return out.requires_grad_(requires_grad) if requires_grad else out

    # ------------------------------------------------------------------ .data
    def data_alias(self, t: torch.Tensor) -> torch.Tensor:
        return self.dispatch(aten.detach.default, (t,), {})

    def set_data(self, t: torch.Tensor, src: torch.Tensor) -> None:
        """``t.data = src``: rebind ``t`` to ``src``'s storage and metadata (no write)."""
        if not isinstance(src, torch.Tensor):
            raise TypeError("Tensor.data must be set to a tensor")
        src = self.lift(src) if not is_deferred_tensor(src) else src
        alias = self.dispatch(aten.detach.default, (src,), {})
        with torch._C.DisableTorchFunctionSubclass():
            TensorBase.data.__set__(t, src)
        st = state_of(t)
        st.node = state_of(alias).node
        st.device = state_of(src).device

    def set_real_data(self, t: torch.Tensor, src: torch.Tensor) -> None:
        """``t.data = src`` for a real ``t`` (a tensor loaded by ``from_pretrained`` during the
        trace): ``t`` stays real, other code holds it, so ``src``'s value is computed now."""
        value = self.value_of(src)
        if value is None:
            raise self.fail(
                "fxinit cannot set the .data of a real tensor to a deferred value too large to compute while "
                "recording", op="Tensor.data",
                hint="compute this value outside the constructor, or let the tensor be deferred too")
        with self.suspended(), torch._C.DisableTorchFunctionSubclass():
            TensorBase.data.__set__(t, value.to(t.device, copy=True))

    # ------------------------------------------------------------------ value reads
    def read_values(self, func: Any, t: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        shadow = self.value_of(t)
        if shadow is None:
            raise self.fail(
                f"fxinit cannot read the values of a deferred tensor that is too large to compute while recording "
                f"({getattr(func, '__name__', func)})",
                op=f"Tensor.{getattr(func, '__name__', func)}",
                hint=self._value_hint(),
            )
        with self.suspended():
            return func(shadow, *args, **kwargs)

    def _value_hint(self) -> str:
        return ("values are computed while recording only when that costs at most 16 MiB of tensors; "
                "materialize the tensor first, move this computation out of __init__, or guard it with "
                "`if not fxinit.is_meta_init():`")

    # ------------------------------------------------------------------ opaque init functions
    def try_record_opaque(self, frame: Any, t: torch.Tensor) -> bool:
        call = find_opaque_call(frame, t)
        if call is None:
            return False
        self._check_live()
        st = state_of(t)
        kwargs = dict(call.kwargs)
        gen = kwargs.get("generator")
        node_kwargs = {k: (None if k == "generator" else v) for k, v in kwargs.items()}
        keys: dict[str, str] = {}
        if st.device.type != "meta":
            keys[f"default:{_CPU}"] = self._snapshot(torch.default_generator)
            if st.device.type != "cpu":
                keys[f"default:{st.device}"] = self._snapshot(default_generator_for(st.device))
            if gen is not None:
                keys["gen"] = self._snapshot(gen)
            self.lazy_cpu.flush()  # the function draws for real
            with self.suspended():
                scratch = torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=st.device)
                resolve_init_function(call.qualname)(scratch, **kwargs)
        sid = self.storage_id(t)
        node = self._node(call_init_function, (call.qualname, st.node), node_kwargs)
        node.meta.update(reads=(sid,), mutates=(sid,), generators=keys, opaque=call.qualname,
                         overwrites=self._replaced_storage(t, []))
        self._storage(t).shadow = None
        return True

    def _overwrites(self, func: Any, inputs: list[torch.Tensor], mutated: list[torch.Tensor]) -> tuple[int, ...]:
        """The storage an op replaces entirely without reading it (see passes.dead_init)."""
        if func.overloadpacket not in _OVERWRITE_OPS or len(mutated) != 1:
            return ()
        return self._replaced_storage(mutated[0], [t for t in inputs if t is not mutated[0]])

    def _replaced_storage(self, t: torch.Tensor, others: list[torch.Tensor]) -> tuple[int, ...]:
        info = self._storage(t)
        sid = info.sid
        if any(self.storage_id(o) == sid for o in others):
            return ()
        with torch._C.DisableTorchFunctionSubclass():
            whole = t.is_contiguous() and t.numel() * t.element_size() == info.keepalive.nbytes()
        return (sid,) if whole else ()

    # ------------------------------------------------------------------ rng
    def _snapshot(self, gen: torch.Generator) -> str:
        key = f"rng{len(self.snapshots)}"
        self.snapshots[key] = self.lazy_cpu.position() if self._lazy(gen) else snapshot(gen)
        return key

    def _lazy(self, gen: torch.Generator) -> bool:
        return gen is torch.default_generator and self.lazy_cpu.active

    def _step_generator(self, func: Any, args: tuple, kwargs: dict, device: torch.device, gen: torch.Generator,
                        filled: list[Any]) -> str:
        """Snapshot ``gen`` for this random op (returns its key in ``self.snapshots``) and leave it
        exactly where eager would: skip ahead when the op's consumption is a known pure
        advance, else consume the numbers for real on a scratch copy."""
        draws = None
        if device.type == "cpu" and len(filled) == 1 and isinstance(filled[0], torch.Tensor):
            draws = cpu_draws(func, args, kwargs, filled[0])
        if draws is None:
            key = self._snapshot(gen)
            self._draw_for_real(func, args, kwargs, device)
            return key
        key = f"rng{len(self.snapshots)}"
        if self._lazy(gen):
            self.snapshots[key] = self.lazy_cpu.skip(draws)
        else:
            start = self.snapshots[key] = snapshot(gen)
            gen.set_state(mt19937.advance(start.state, draws))
        self.random_ops["skipped"] += 1
        return key

    def _draw_for_real(self, func: Any, args: tuple, kwargs: dict, device: torch.device) -> None:
        self.random_ops["drawn"] += 1
        self.lazy_cpu.flush()
        mutated = {id(_schema_value(func, args, kwargs, i)) for i in _mutated_arg_indices(func)}

        def real(x: Any) -> Any:
            if not is_deferred_tensor(x):
                return x
            if id(x) in mutated:  # overwritten by the op: its values do not matter
                return torch.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=state_of(x).device)
            value = self.value_of(x)  # probabilities, means: exact when cheap, else a valid stand-in
            if value is not None:
                return value.to(state_of(x).device)
            return torch.ones(x.size(), dtype=x.dtype, device=state_of(x).device)

        with self.suspended(), torch.no_grad():
            rargs = _map(real, args)
            rkwargs = _map(real, kwargs)
            if "device" in rkwargs:
                rkwargs["device"] = device
            func(*rargs, **rkwargs)

    # ------------------------------------------------------------------ the op
    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self._check_live()
        if getattr(func, "namespace", None) in _COLLECTIVE_NAMESPACES:
            raise self.fail(
                f"fxinit cannot record the collective {func} on a deferred tensor: replaying communication would need "
                "every rank to materialize the same tensors in the same order",
                op=str(func),
                hint="materialize before redistributing (redistribute, full_tensor, dist.broadcast of a parameter); "
                     "parallelize_module, distribute_tensor and fully_shard on a deferred model need no collective")
        if func in _LIFT_OPS:
            return self.lift(args[0])
        inputs = self._own_inputs(args, kwargs)
        if inputs is None:  # real tensors among the arguments (or another trace's)
            args, kwargs = self._lift_reals(func, args, kwargs)
            inputs = [t for t in _tensors_in((args, kwargs)) if is_deferred_tensor(t)]
        if func is _DETACH and not kwargs and len(args) == 1 and inputs:
            return self._detached(args[0])
        if func in _DATA_DEPENDENT:
            return self._via_values(func, args, kwargs, inputs, data_dependent=True)
        device = self._output_device(func, inputs, kwargs)
        mkwargs = dict(kwargs)
        if "device" in mkwargs:
            mkwargs["device"] = _META
        if "generator" in mkwargs:
            mkwargs["generator"] = None
        try:
            with torch._C._DisableTorchDispatch():
                mout = _fill_result(func, args, mkwargs) if func in _SLOW_META_FILLS else func(*args, **mkwargs)
        except DeferredInitError:
            raise
        except Exception as exc:  # no meta kernel, or data-dependent output shape
            if func in _SLOW_META_FILLS:  # the CPU kernel refused the arguments: so would eager
                raise self.fail(f"{func}: {type(exc).__name__}: {exc}", op=str(func),
                                hint="eager construction raises this error too: check the arguments of this "
                                     "init call") from exc
            return self._via_values(func, args, kwargs, inputs, data_dependent=False, cause=exc)
        return self._record(func, args, kwargs, inputs, mout, device)

    def _own_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
        """The deferred tensors among the arguments if all tensors there are this trace's."""
        inputs = []
        for x in _leaves((args, kwargs)):
            if isinstance(x, torch.Tensor):
                state = x.__dict__.get(STATE_ATTR) if isinstance(x, DeferredTensor) else None
                if state is None or state.recorder is not self:
                    return None
                inputs.append(x)
        return inputs

    def _lift_reals(self, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        def lift(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and not is_deferred_tensor(x):
                if x.device.type == "meta":
                    raise self.fail(
                        "a plain meta tensor (not created under fxinit) was mixed into a deferred computation",
                        op=str(func),
                        hint="tensors built with device=<a deferred tensor's .device> after trace_init are plain "
                             "meta tensors; run that code inside `with fxinit.recording(model):`, or build "
                             "the tensor on a real device",
                    )
                return self.lift(x)
            if is_deferred_tensor(x) and state_of(x).recorder is not self:
                raise self.fail(
                    "tensors from two different fxinit traces were combined in one op",
                    op=str(func),
                    hint="materialize one of them first, or construct both under one trace_init",
                )
            return x

        return _map(lift, args), _map(lift, kwargs)

    @contextlib.contextmanager
    def intended_device(self, device: torch.device) -> Iterator[None]:
        """Factory ops built on meta inside this block were asked for ``device``."""
        saved, self._intended = self._intended, device
        try:
            yield
        finally:
            self._intended = saved

    def _output_device(self, func: Any, inputs: list[torch.Tensor], kwargs: dict) -> torch.device:
        dev = kwargs.get("device")
        if dev is not None:
            dev = torch.device(dev)
            if dev.type == "meta" and not inputs:
                if self._intended is not None:
                    return self._intended
                if func in _SCALAR_FACTORIES:
                    # ``t[i] = 0`` wraps the scalar on t's device, which is meta underneath;
                    # a CPU scalar combines with a tensor of any device, as eager's would.
                    return _CPU
            if dev.type != "meta" or not inputs:
                return dev  # explicit device; ``x.new_*`` passes x's (meta) device, which means "like x"
        if not inputs:
            return _CPU
        devices = [state_of(t).device for t in inputs]
        for t, d in zip(inputs, devices):
            if d.type != "cpu" and t.dim() > 0:
                return d
        for d in devices:
            if d.type != "cpu":
                return d
        return devices[0]

    def _graph_args(self, func: Any, args: tuple, kwargs: dict, device: torch.device,
                    inputs: list[torch.Tensor]) -> tuple[tuple, dict]:
        if not inputs and "generator" not in kwargs:  # a factory: nothing to replace (generators are keywords)
            gkwargs = dict(kwargs)
            if "device" in gkwargs:
                gkwargs["device"] = device
            return args, gkwargs

        def to_node(x: Any) -> Any:
            if is_deferred_tensor(x):
                return state_of(x).node
            if isinstance(x, torch.Generator):
                return None
            return x

        gargs = _map(to_node, args)
        gkwargs = _map(to_node, kwargs)
        if "device" in gkwargs:
            gkwargs["device"] = device
        return gargs, gkwargs

    def _record(self, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor], mout: Any,
                device: torch.device, real_out: Any = None) -> Any:
        reads = tuple(dict.fromkeys(self.storage_id(t) for t in inputs))
        mutated_objs = [t for i in _mutated_arg_indices(func) for t in _tensors_in(_schema_value(func, args, kwargs, i))]
        mutates = tuple(dict.fromkeys(self.storage_id(t) for t in mutated_objs))
        gargs, gkwargs = self._graph_args(func, args, kwargs, device, inputs)
        random = draws_random(func) and device.type != "meta"
        if random:
            if called_from(_DTENSOR_DIR):  # DTensor runs the op on the local tensors (capture.dtensor)
                raise self.fail(
                    f"fxinit cannot record {func} on the local shards of a deferred DTensor: each rank would draw "
                    "its shard from its own generator, which no single-process run does",
                    op=str(func),
                    hint="call the init function on the DTensor itself (nn.init.*, Tensor.normal_ & co. act on its "
                         "global tensor), or materialize before calling this")
            gen = kwargs.get("generator")
            if gen is None and device.type != "cpu" and not _device_available(device):
                raise self.fail(
                    f"fxinit cannot record a random op for {device}: that device is not available here, "
                    "so its generator state is unknown",
                    op=str(func),
                    hint=f"trace on a machine with {device.type}, or construct for the CPU and "
                         f"materialize with device='{device}'",
                )
            used = gen if gen is not None else default_generator_for(device)
            key = self._step_generator(func, args, kwargs, device, used, mutated_objs or [mout])
        node = self._node(func, gargs, gkwargs)
        node.meta.update(reads=reads, mutates=mutates, overwrites=self._overwrites(func, inputs, mutated_objs))
        if random:
            node.meta["generators"] = {"gen" if _takes_generator(func) else f"default:{device}": key}

        if isinstance(mout, torch.Tensor):  # most ops: one tensor out
            same = next((t for t in inputs if t is mout), None)  # in-place / out=: the same Python object
            if same is not None:
                if changes_view(func):  # the object now holds this node's view
                    state_of(same).node = node
                    node.meta["spec"] = TensorSpec.of(same, device)
                self._update_shadows(func, args, kwargs, inputs, mutated_objs, [], random, real_out)
                return same
            known = _storage_key(mout) in self._storages
            w = self._wrap(mout, node, device)
            if func in ALLOCATIONS and not self.capturing and called_from(_DISTRIBUTED_DIR):
                # a buffer torch.distributed fills by communicating (passes.uninitialized)
                node.meta.update(fill_expected=True, allocates=(self.storage_id(w),))
            self._update_shadows(func, args, kwargs, inputs, mutated_objs, [] if known else [(w, 0)], random,
                                 real_out)
            return w

        # Several results (a tuple, a list): each new tensor is a getitem of the node.
        input_ids = {id(t): t for t in inputs}
        fresh: list[tuple[torch.Tensor, int]] = []
        results = []  # one per tensor in the output
        for j, o in enumerate(_leaves(mout)):
            if not isinstance(o, torch.Tensor):
                continue
            if id(o) in input_ids:
                results.append(input_ids[id(o)])  # in-place / out=: the same Python object
            else:
                vnode = self._node(operator.getitem, (node, j), {})
                vnode.meta.update(reads=(), mutates=())
                known = _storage_key(o) in self._storages
                w = self._wrap(o, vnode, device)
                if not known:
                    fresh.append((w, j))
                results.append(w)
        node.meta["spec"] = None
        self._update_shadows(func, args, kwargs, inputs, mutated_objs, fresh, random, real_out)
        replacements = iter(results)
        return _map(lambda o: next(replacements) if isinstance(o, torch.Tensor) else o, mout)

    def _update_shadows(self, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
                        mutated: list[torch.Tensor], fresh: list[tuple[torch.Tensor, int]], random: bool,
                        real_out: Any) -> None:
        # A random op has no shadow, on meta too (``random`` is False there): computing one
        # would draw from the user's generator, which eager's meta op leaves alone.
        small_fresh = fresh and all(w.numel() <= EAGER_SHADOW_LIMIT for w, _ in fresh)
        if random or draws_random(func) or not (mutated or small_fresh) \
                or not all(self.shadow_of(t) is not None for t in inputs):
            for t in mutated:
                self._storage(t).shadow = None
            return
        if real_out is None:
            real_out = self._compute_real(func, args, kwargs)
        flat_real = _leaves(real_out)
        for w, j in fresh:
            r = flat_real[j]
            if isinstance(r, torch.Tensor):
                self._set_shadow(w, r)

    def _compute_real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        def real(x: Any) -> Any:
            return self.value_of(x) if is_deferred_tensor(x) else x

        rkwargs = _map(real, kwargs)
        if "device" in rkwargs:
            rkwargs["device"] = _CPU
        with self.suspended(), torch.no_grad():
            return func(*_map(real, args), **rkwargs)

    def _via_values(self, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
                     data_dependent: bool, cause: Exception | None = None) -> Any:
        """Ops whose result depends on values (or that have no meta kernel): run them on exact values, or refuse."""
        if not draws_random(func) and all(self.value_of(t) is not None for t in inputs):
            real_out = self._compute_real(func, args, kwargs)
            if not _tensors_in(real_out):
                return real_out  # a Python value (item, bool): nothing to record
            device = self._output_device(func, inputs, kwargs)
            with torch._C._DisableTorchDispatch():
                mout = _map(
                    lambda r: torch.empty_strided(r.size(), r.stride(), dtype=r.dtype, device=_META)
                    if isinstance(r, torch.Tensor) else r, real_out)
            return self._record(func, args, kwargs, inputs, mout, device, real_out=real_out)
        if data_dependent:
            what = _WHAT_THE_USER_WROTE.get(func, str(func))
            raise self.fail(
                f"fxinit cannot defer {what}: it needs the value of a deferred tensor that is too large "
                "to compute while recording",
                op=str(func),
                hint=self._value_hint(),
            )
        raise self.fail(
            f"fxinit cannot defer {func}: {type(cause).__name__}: {str(cause).splitlines()[0] if cause else ''}",
            op=str(func),
            hint="this operator has no meta implementation or needs data; compute it outside the constructor "
                 "or guard it with `if not fxinit.is_meta_init():`",
        )


# In-place fills whose meta kernels are Python references (normal_'s costs ~0.3 ms a call,
# and a 405B model has ~900): their result is the tensor itself.
_SLOW_META_FILLS = {aten.normal_.default, aten.uniform_.default}
_PROBE_GENERATOR = torch.Generator()  # what probes draw is thrown away


def _fill_result(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """What the meta kernel of in-place fill ``func`` returns (``args[0]``), after eager's
    argument checks: the CPU kernel on one element, drawing from a generator of its own."""
    key = call_key(func, args, kwargs, args[0])
    if key is not None and key in _ACCEPTED:
        return args[0]
    probe = torch.empty(1, dtype=args[0].dtype)
    func(probe, *args[1:], **{**kwargs, "generator": _PROBE_GENERATOR})
    if key is not None:
        _ACCEPTED.add(key)
    return args[0]


_ACCEPTED: set[tuple] = set()


_NAMES: dict[Any, str] = {}


def _paths_of(named_modules: Iterable[tuple[str, torch.nn.Module]]) -> dict[int, str]:
    """id(module) -> its first dotted path."""
    paths: dict[int, str] = {}
    for name, mod in named_modules:
        paths.setdefault(id(mod), name)
    return paths


def _node_name(graph: fx.Graph, target: Any) -> str | None:
    """fx's name for nodes of ``target`` (before numbering), worked out once per target."""
    if not isinstance(target, torch._ops.OpOverload):
        return None
    name = _NAMES.get(target)
    if name is None:
        to_str = getattr(graph, "_target_to_str", None)
        if to_str is None:
            return None
        name = _NAMES[target] = to_str(target)
    return name


def _unavailable_to_cpu(nodes: list[fx.Node]) -> dict[torch.device, torch.device]:
    devices = {n.kwargs.get("device") for n in nodes if n.op == "call_function"}
    return {d: _CPU for d in devices
            if isinstance(d, torch.device) and d.type not in ("cpu", "meta") and not _device_available(d)}


def _device_available(device: torch.device) -> bool:
    module = getattr(torch, device.type, None)
    is_available = getattr(module, "is_available", None)
    return bool(is_available and is_available())


