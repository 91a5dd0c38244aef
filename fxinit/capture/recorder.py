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

The concerns it draws on live apart: ``capture.schema`` (facts about aten ops),
``capture.trees`` (walking arguments), ``capture.storages`` and ``capture.names`` (storage
ids, names of storages and modules), ``capture.shadows`` (exact values while recording),
``capture.stepping`` (generator snapshots and skips), ``capture.devices``.
"""

from __future__ import annotations

import contextlib
import operator
import os
import sys
import types
import weakref
from typing import Any, Iterator

import torch
import torch.fx as fx
from torch._C import TensorBase
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit import execute
from fxinit.capture.call_guards import GuardIndex
from fxinit.capture.deferred import STATE_ATTR, DeferredState, DeferredTensor, is_deferred_tensor, state_of
from fxinit.capture.devices import CPU, META, default_device, device_available, output_device
from fxinit.capture.doors import Doors, open_doors_after_trace
from fxinit.capture.grad_branches import eager_arguments
from fxinit.capture.grad_hooks import note_untracked
from fxinit.capture.layouts import eager_layout
from fxinit.capture.materialized_marks import TRACE_SERIALS
from fxinit.capture.names import TraceNames
from fxinit.capture.opaque import find_opaque_call
from fxinit.capture.provenance import (called_from, current_provenance, format_source, module_path_from_stack,
                                       subclass_dispatch, user_frame)
from fxinit.capture.random_draws import META_RESULTS, draw_for_real
from fxinit.capture.real import (NOT_REAL, STORAGES, adopt_real, is_strided_result, non_strided_result,
                                 real_tensor_op, set_from_storage)
from fxinit.capture.schema import (AUTOCAST_LOWER, COLLECTIVE_NAMESPACES, DATA_DEPENDENT, DETACH, LIFT_OPS,
                                   OVERWRITE_OPS, SCALAR_FACTORIES, SLOW_META_FILLS, fill_result, generator_of,
                                   mutated_arg_indices, schema_value, takes_device, takes_generator)
from fxinit.capture.shadows import SHADOW_LIMIT, Shadows
from fxinit.capture.stepping import GeneratorStepper
from fxinit.capture.storages import Storages, storage_key
from fxinit.capture.trees import leaves, map_tree, tensors_in
from fxinit.errors import DeferredInitError
from fxinit.init_bodies import body_fingerprint
from fxinit.numerics import current as current_numerics, note_settings
from fxinit.ops import (ALLOCATIONS, DRAW_NOTHING, call_init_function, changes_view, draws_random, positional_generator,
                        resolve_init_function)
from fxinit.passes.fingerprint import fingerprint
from fxinit.rng import default_generator_for
from fxinit.spec import TensorSpec, copy_with_strides

aten = torch.ops.aten
#: Ops that make quantized tensors (``torch.ao.nn.quantized`` modules, ``quantize_per_tensor``).
QUANTIZED_MAKERS = frozenset({"quantize_per_tensor", "quantize_per_tensor_dynamic", "quantize_per_channel",
                              "_empty_affine_quantized", "_empty_per_channel_affine_quantized",
                              "_make_per_tensor_quantized_tensor", "_make_per_channel_quantized_tensor"})

_DISTRIBUTED_DIR = os.path.join(os.path.dirname(torch.__file__), "distributed") + os.sep
_DTENSOR_DIR = os.path.join(_DISTRIBUTED_DIR, "tensor") + os.sep


class Recorder(Shadows, Doors):
    """Records init ops of one trace into an fx graph."""

    def __init__(self, kind: str = "trace") -> None:
        self.kind, self.serial = kind, next(TRACE_SERIALS)  # (serial: a materialized tensor's mark names it)
        open_doors_after_trace()
        self.graph = fx.Graph()
        self.constants: dict[str, torch.Tensor] = {}
        # the real tensors that require grad whose values constants copy with grad mode on (a caller's
        # tensor, a real parameter or a view of it): eager's gradients pass them, so a tensor rebuilt
        # from them must reach them too (``autograd_links``); held, as the constants hold their values
        self.lifted_with_grad: dict[str, torch.Tensor] = {}
        self.generators = GeneratorStepper()
        self.snapshots = self.generators.snapshots  # generator states by key, one per random op
        self.lazy_cpu = self.generators.lazy_cpu
        self.storages = Storages()
        self._storage = self.storages.info  # per op: one lookup less
        self._known = self.storages.by_key
        self.names = TraceNames(self._owns, self.storage_id)
        self.seed = torch.initial_seed()  # the default for the portable stream
        self.default_dtype = torch.get_default_dtype()
        self.numerics = current_numerics()  # torch's numeric settings (fxinit.numerics): ops replay under them
        self.capturing = False
        self.cleared = False
        # The default device around the constructor was meta (trace_init under
        # `with torch.device("meta")`): its tensors have no values unless later init gives them some.
        self.meta_around = kind == "trace" and default_device().type == "meta"
        self._pos = self._suspended = 0
        self._intended: torch.device | None = None
        self._module_ref: weakref.ReferenceType | None = None
        self.call_site: types.FrameType | None = None  # the caller of the torch function being run (modes.py)
        # Autocast was on when the torch function being run was called (it is off inside dispatch).
        self.autocast = False
        self.composite_device: torch.device | None = None  # its deferred input's device (modes.py)
        self.inexact: str | None = None  # why the torch function being run is not eager's there (modes.py)
        # Subclasses' __torch_function__ was on where the op being dispatched was called (the
        # recorder runs with it off; a wrapper subclass's own __torch_dispatch__ runs as in eager).
        self.torch_function_outside = True
        # Storages whose value a real tensor or array holds a copy of where eager shares them
        # (storage id -> how): a later write to one cannot reach that copy, so it is refused.
        self.copied_out: dict[int, str] = {}
        self.numpy_arrays: list[tuple[Any, torch.Tensor]] = []  # what numpy() gave, and for which tensor
        self.numpy_out: set[int] = set()  # storages numpy() gave an array of after the trace
        self.adopted: list[torch.Tensor] = []  # real tensors made deferred by `real.data = deferred`
        # data pointers of real storages that share memory with a deferred tensor in eager (`.data =`)
        self.lifted_reals: dict[int, str] = {}
        self.guards = GuardIndex()  # the modules of the model with a call guard, indexed
        self.copies: list[weakref.ReferenceType] = []  # deep copies of the model, or of a part (call_guards)

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

    def _owns(self, t: torch.Tensor) -> bool:
        return is_deferred_tensor(t) and state_of(t).recorder is self

    @property
    def recorded_nodes(self) -> int:
        """How many nodes were recorded so far (each new node's ``meta["pos"]``)."""
        return self._pos

    @property
    def root(self) -> torch.nn.Module | None:
        """The traced model, while it is alive."""
        return self.names.root

    def set_root(self, module: torch.nn.Module) -> None:
        self.names.set_root(module, self.graph)

    def stamp_module_paths(self) -> None:
        """Give every node recorded so far ``meta["module"]`` (``TraceNames.stamp_module_paths``)."""
        self.names.stamp_module_paths(self.graph)

    def module_paths(self) -> dict[int, str]:
        """id(module) -> dotted path under the traced root (empty while it is being built)."""
        return self.names.module_paths()

    def storage_names(self) -> dict[int, str]:
        """Names of storages for portable stream keys (``TraceNames.storage_names``)."""
        return self.names.storage_names()

    def name_storage(self, t: torch.Tensor, name: str) -> None:
        """Name ``t``'s storage for portable stream keys (a tensor the model does not hold)."""
        self.names.name_storage(t, name)

    def fingerprint(self, tensors: list[torch.Tensor]) -> str:
        """A digest of what computes the current values of ``tensors`` (passes.fingerprint)."""
        nodes = execute.slicer(self).required([(state_of(t).node, self.storage_id(t)) for t in tensors])[0]
        return fingerprint(nodes, self.constants, self.snapshots)

    def storage_id(self, t: torch.Tensor) -> int:
        return self._storage(t).sid

    def dead_writes(self) -> set[fx.Node]:
        """Writes overwritten unread so far (passes.dead_init); recomputed as the graph grows."""
        return execute.program_dead_writes(self)

    def _wrap(self, meta: torch.Tensor, node: fx.Node, device: torch.device) -> torch.Tensor:
        node.meta["spec"] = TensorSpec.of(meta, device)
        return self._deferred(meta, node, device)

    def _deferred(self, meta: torch.Tensor, node: fx.Node, device: torch.device) -> torch.Tensor:
        with torch._C._DisableTorchDispatch():
            t = torch.Tensor._make_subclass(DeferredTensor, meta, meta.requires_grad)
        t.__dict__[STATE_ATTR] = DeferredState(self, node, device)
        return t

    def _detached(self, t: torch.Tensor) -> torch.Tensor:
        """``t.detach()`` of a ``t`` that requires no grad: a new tensor object for the same value, so the
        same node (every ``nn.Parameter(...)`` detaches: a node each would be a quarter of a model's graph).
        Of one that requires grad it is a node: the ops that rebuild a kept tensor's ``grad_fn``
        (``autograd_links``) must see where eager's gradients stop (botorch's ``covar * scale.detach()``)."""
        with torch._C._DisableTorchDispatch():
            meta = aten.detach.default(t)
        return self._deferred(meta, state_of(t).node, state_of(t).device)  # the node's spec holds for the same view

    def _node(self, target: Any, args: tuple, kwargs: dict, op: str = "call_function") -> fx.Node:
        # Arguments are set after creation: create_node would walk them with torch's general
        # pytree looking for symbolic ints, which capture never produces (sizes are concrete),
        # at a cost per op comparable to the rest of recording.
        node = self.graph.create_node(op, target, (), {}, name=_node_name(self.graph, target))
        if args or kwargs:
            node._update_args_kwargs(args, kwargs)  # one update instead of two
        if self.inexact is not None:  # the meta path of an op eager runs otherwise (capture.branches)
            node.meta["inexact"] = self.inexact
        node.meta["pos"] = self._pos
        self._pos += 1
        if not torch.is_grad_enabled():  # (autograd_links replays the op in the mode eager ran it in)
            node.meta["no_grad"] = True
        note_settings(node.meta, self.default_dtype, self.numerics)
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
            hint="materialize the tensor first (torch.export reads it so), or guard this code with "
                 "`if not fxinit.is_meta_init():`")

    def _check_live(self) -> None:
        if self.cleared:
            raise DeferredInitError(
                "this deferred tensor's meta-init cache was cleared, so it can no longer be materialized",
                hint="pass keep_cache=True to materialize() when materializing tensors one at a time",
            )

    # ------------------------------------------------------------------ constants
    def lift(self, real: torch.Tensor, device: torch.device | None = None, copy: bool = True,
             with_grad: bool = False) -> torch.Tensor:
        """A deferred tensor whose value is ``real``'s now (a graph constant): a copy, or with
        ``copy=False`` ``real`` itself, for a tensor nothing else writes (replay copies constants).
        ``with_grad``: held as a real tensor gradients pass (``capture.lifted``) in no_grad too."""
        if is_deferred_tensor(real):
            return real
        if real.layout != torch.strided:
            raise self.fail(f"fxinit records strided tensors only; this one is {real.layout}", op="lift",
                            hint="build sparse or other non-strided tensors after fxinit.materialize")
        with self.suspended(), torch.no_grad():
            value = copy_with_strides(real) if copy else real.detach()
        name = f"_const{len(self.constants)}"
        self.constants[name] = value
        if real.requires_grad and (with_grad or torch.is_grad_enabled()):
            self.lifted_with_grad[name] = real
        node = self._node(name, (), {}, op="get_attr")
        with torch._C._DisableTorchDispatch():
            meta = FACTORIES.empty_strided(real.size(), real.stride(), dtype=real.dtype, device=META)
        t = self._wrap(meta, node, real.device)
        if value.numel() <= SHADOW_LIMIT:
            with self.suspended():
                shadow = copy_with_strides(value) if value.device.type == "cpu" else value.to("cpu", copy=True)
                self.set_shadow(t, shadow)
        if device is not None and device.type == "meta":
            # A copy to meta that eager makes (``torch.tensor(data, device="meta")``): dispatch
            # would read device=meta on a deferred input as "like the input".
            with torch._C._DisableTorchDispatch():
                mout = aten._to_copy.default(t, device=META)
            t = self._record(aten._to_copy.default, (t,), {"device": device}, [t], mout, device)
        elif device is not None and device != real.device:
            t = self.dispatch(aten._to_copy.default, (t,), {"device": device})
        return t

    # ------------------------------------------------------------------ .data
    def data_alias(self, t: torch.Tensor) -> torch.Tensor:
        """``t.data``: on ``t``'s node (``_detached``), whether or not ``t`` requires grad (every
        ``p.data.normal_()`` takes one: a node each would grow a model's graph by half)."""
        return self._detached(t)

    def set_data(self, t: torch.Tensor, src: torch.Tensor, copy: bool = True) -> None:
        """``t.data = src``: rebind ``t`` to ``src``'s storage and metadata (no write)."""
        if not isinstance(src, torch.Tensor):
            raise TypeError("Tensor.data must be set to a tensor")
        if not is_deferred_tensor(src) and copy and adopt_real(self, t, src):
            return
        if not is_deferred_tensor(src):
            if copy:  # eager's t would share src's memory: a later write to src is refused (capture.real)
                self.lifted_reals[src.untyped_storage().data_ptr()] = "a deferred tensor took its value through " \
                                                                      "`.data = ...`"
            src = self.lift(src, copy=copy)
        alias = self._detached(src)
        with torch._C.DisableTorchFunctionSubclass():
            TensorBase.data.__set__(t, src)
        st = state_of(t)
        st.former = (*st.former, st.node)
        st.node = state_of(alias).node
        st.device = state_of(src).device

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
        ambient = default_device()
        if ambient.type not in ("cpu", "meta"):
            node_kwargs["default_device"] = ambient
        keys: dict[str, str] = {}
        absent = st.device.type not in ("meta", "cpu") and not device_available(st.device)
        if absent and call.qualname not in DRAW_NOTHING:
            raise self.fail(f"fxinit cannot record {call.qualname} for {st.device} without that device: how far it moves "
                            "the generator depends on the values it draws", op=call.qualname, hint=_ABSENT_HINT)
        if st.device.type != "meta":
            keys[f"default:{CPU}"] = self.generators.snapshot(torch.default_generator)
        if st.device.type != "meta" and not absent:  # (an absent device's dirac_ draws nothing: nothing to run)
            if st.device.type != "cpu":
                keys[f"default:{st.device}"] = self.generators.snapshot(default_generator_for(st.device))
            if gen is not None:
                keys["gen"] = self.generators.snapshot(gen)
            self.lazy_cpu.flush()  # the function draws for real
            with self.suspended():
                scratch = FACTORIES.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=st.device)
                resolve_init_function(call.qualname)(scratch, **kwargs)
        sid = self.storage_id(t)
        node = self._node(call_init_function, (call.qualname, st.node), node_kwargs)
        node.meta.update(reads=(sid,), mutates=(sid,), generators=keys, opaque=call.qualname,
                         body=body_fingerprint(call.qualname),
                         overwrites=self._replaced_storage(t, []))
        self._storage(t).shadow = None
        return True

    def _overwrites(self, func: Any, inputs: list[torch.Tensor], mutated: list[torch.Tensor]) -> tuple[int, ...]:
        """The storage an op replaces entirely without reading it (see passes.dead_init)."""
        if func.overloadpacket not in OVERWRITE_OPS or len(mutated) != 1:
            return ()
        written = next(i for i, t in enumerate(inputs) if t is mutated[0])
        # the other inputs, by position: ``t.copy_(t)`` reads the storage it writes
        return self._replaced_storage(mutated[0], inputs[:written] + inputs[written + 1:])

    def _replaced_storage(self, t: torch.Tensor, others: list[torch.Tensor]) -> tuple[int, ...]:
        info = self._storage(t)
        sid = info.sid
        if any(self.storage_id(o) == sid for o in others):
            return ()
        with torch._C.DisableTorchFunctionSubclass():
            whole = t.is_contiguous() and t.numel() * t.element_size() == info.keepalive.nbytes()
        return (sid,) if whole else ()

    # ------------------------------------------------------------------ the op
    def dispatch(self, func: Any, args: tuple, kwargs: dict) -> Any:
        self._check_live()
        args, kwargs = eager_arguments(func, args, kwargs)  # capture.grad_branches
        if getattr(func, "namespace", None) in COLLECTIVE_NAMESPACES:
            raise self.fail(
                f"fxinit cannot record the collective {func} on a deferred tensor: replaying communication would need "
                "every rank to materialize the same tensors in the same order",
                op=str(func),
                hint="materialize before redistributing (redistribute, full_tensor, dist.broadcast of a parameter; "
                     "all_gather_object sends a tensor it builds, deferred too); parallelize_module, "
                     "distribute_tensor and fully_shard on a deferred model need no collective")
        if func in LIFT_OPS:
            if func is aten.lift_fresh.default and not is_deferred_tensor(args[0]) and args[0].device.type != "meta":
                # from_numpy, frombuffer: the tensor that shares the caller's memory (capture.real),
                # or, of an array numpy() gave for a deferred tensor, that tensor (capture.doors)
                return self.numpy_source(args[0])
            return self.lift(args[0])
        if len(args) > 1 and isinstance(args[1], STORAGES) and func.overloadpacket is aten.set_:
            return set_from_storage(self, func, args, kwargs)
        inputs = self._own_inputs(args, kwargs)
        if inputs is None:  # real tensors among the arguments (or another trace's)
            real = real_tensor_op(self, func, args, kwargs)
            if real is not NOT_REAL:
                return real
            args, kwargs = self._lift_reals(func, args, kwargs)
            inputs = [t for t in tensors_in((args, kwargs)) if is_deferred_tensor(t)]
        if getattr(getattr(func, "overloadpacket", None), "__name__", None) in QUANTIZED_MAKERS:
            raise self.fail(
                f"fxinit cannot defer quantized tensors ({func}): torch's meta kernels give them no quantized dtype "
                "(quantize_per_tensor says float32) or none at all, so code reading them while recording would see "
                "other values than eager's", op=str(func),
                hint="quantize after fxinit.materialize (torch.ao.quantization.convert, quantize=True of a model "
                     "zoo), as on a model built eagerly")
        if func is DETACH and not kwargs and len(args) == 1 and inputs and not args[0].requires_grad:
            return self._detached(args[0])  # (of one that requires grad, a node: where gradients stop)
        if func in DATA_DEPENDENT:
            return self.via_values(func, args, kwargs, inputs, data_dependent=True)
        if self.autocast and getattr(func, "overloadpacket", None) in AUTOCAST_LOWER:
            raise self.fail(
                f"fxinit cannot record {func} under autocast: autocast would run it in lower precision on a real "
                "device, and deferred tensors (meta underneath) are not cast by it",
                op=str(func), hint="leave torch.autocast out of the constructor (or around trace_init), or compute this "
                                   "after fxinit.materialize")
        composite = self.composite_device if func not in SCALAR_FACTORIES else None
        device = output_device(func, inputs, kwargs, self._intended or composite, asked=self._intended is not None)
        mkwargs = dict(kwargs)
        if "device" in mkwargs or not inputs and takes_device(func):  # (an aten factory called as it is: on CPU)
            mkwargs["device"] = META
        if "generator" in mkwargs:
            mkwargs["generator"] = None
        at = positional_generator(func)  # (poisson's: where the dispatcher passes it)
        margs = args if at is None or at >= len(args) else (*args[:at], None, *args[at + 1:])
        try:
            with torch._C._DisableTorchDispatch():
                if func in SLOW_META_FILLS:
                    mout = fill_result(func, margs, mkwargs)
                else:
                    mout = META_RESULTS.get(func, func)(*margs, **mkwargs)
        except DeferredInitError:
            raise
        except Exception as exc:  # no meta kernel, or data-dependent output shape
            if func in SLOW_META_FILLS:  # the CPU kernel refused the arguments: so would eager
                raise self.fail(f"{func}: {type(exc).__name__}: {exc}", op=str(func),
                                hint="eager construction raises this error too: check the arguments of this "
                                     "init call") from exc
            return self.via_values(func, args, kwargs, inputs, data_dependent=False, cause=exc)
        if not (mout.layout is torch.strided if isinstance(mout, torch.Tensor) else is_strided_result(mout)):
            return non_strided_result(self, func, args, kwargs, inputs)
        return self._record(func, args, kwargs, inputs, eager_layout(func, mout, device, args, kwargs), device)

    def _own_inputs(self, args: tuple, kwargs: dict) -> list[torch.Tensor] | None:
        """The deferred tensors among the arguments if all tensors there are this trace's."""
        inputs = []
        for x in leaves((args, kwargs)):
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
                    dispatcher = subclass_dispatch(sys._getframe(1))
                    raise self.fail(
                        "a plain meta tensor (not created under fxinit) was mixed into a deferred computation"
                        + (f", inside {dispatcher}: a tensor subclass's own code, where a deferred tensor says it is "
                           "on 'meta' if subclasses' __torch_function__ is off there" if dispatcher else ""),
                        op=str(func),
                        hint="wrap (quantize) after materializing, or build inside __torch_dispatch__ on the device "
                             "of the wrapper itself" if dispatcher else
                             "a tensor built on the meta device after trace_init has no value: by hand, by "
                             "torch.distributed (which sees deferred tensors as meta), or by a composite op that builds "
                             "helper tensors like its input (torch.quantile, torch.cov, F.cosine_similarity, "
                             "torch.svd_lowrank); run that init step inside `with fxinit.recording(model):`, where it "
                             "is recorded as in the constructor, or build the tensor on a real device",
                    )
                return self.lift(x)
            if is_deferred_tensor(x) and state_of(x).recorder is not self:
                raise self.fail(
                    "tensors from two different fxinit traces were combined in one op",
                    op=str(func),
                    hint="a cache that outlives a trace (functools.lru_cache, a module-level dict) may hold a tensor "
                         "of an earlier one, also once that model is materialized: clear it before tracing "
                         "(f.cache_clear()); else materialize one of them first, or construct both under one trace_init",
                )
            return x

        return map_tree(lift, args), map_tree(lift, kwargs)

    @contextlib.contextmanager
    def intended_device(self, device: torch.device) -> Iterator[None]:
        """Factory ops built on meta inside this block were asked for ``device``."""
        saved, self._intended = self._intended, device
        try:
            yield
        finally:
            self._intended = saved

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

        gargs = map_tree(to_node, args)
        gkwargs = map_tree(to_node, kwargs)
        if "device" in gkwargs:
            gkwargs["device"] = device
        return gargs, gkwargs

    def _record(self, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor], mout: Any,
                device: torch.device, real_out: Any = None) -> Any:
        reads = tuple(dict.fromkeys(self.storage_id(t) for t in inputs))
        mutated_objs = [t for i in mutated_arg_indices(func) for t in tensors_in(schema_value(func, args, kwargs, i))]
        mutates = tuple(dict.fromkeys(self.storage_id(t) for t in mutated_objs))
        how = self.copied_out_by(mutates) if self.copied_out or self.numpy_out else None
        if how is not None:
            raise self.fail(
                f"fxinit cannot record {func} here: {how} earlier, so in eager construction this write would "
                "reach it too, and fxinit gave it a copy of the value as it was then",
                op=str(func), hint="let the other tensor be a view of this one (keep it deferred), or write before "
                                   "copying the value out")
        gargs, gkwargs = self._graph_args(func, args, kwargs, device, inputs)
        random = draws_random(func, args, kwargs) and device.type != "meta"
        if random:
            if called_from(_DTENSOR_DIR):  # DTensor runs the op on the local tensors (capture.dtensor)
                raise self.fail(
                    f"fxinit cannot record {func} on the local shards of a deferred DTensor: each rank would draw "
                    "its shard from its own generator, which no single-process run does",
                    op=str(func),
                    hint="call the init function on the DTensor itself (nn.init.*, Tensor.normal_ & co. act on its "
                         "global tensor), or materialize before calling this")
            gen = generator_of(func, args, kwargs)
            if gen is None and device.type != "cpu" and not device_available(device):
                try:  # CUDA's generator is followed by reservations (rng.philox)
                    key = self.generators.step_absent(func, args, kwargs, device, mutated_objs or [mout])
                except LookupError as exc:
                    raise self.fail(f"fxinit cannot record a random op for {device}: that device is not available "
                                    f"here, and {exc}", op=str(func), hint=_ABSENT_HINT) from None
            else:
                used = gen if gen is not None else default_generator_for(device)
                key = self.generators.step(func, args, kwargs, device, used, mutated_objs or [mout],
                                           lambda: draw_for_real(self, func, args, kwargs, device))
        node = self._node(func, gargs, gkwargs)
        node.meta.update(reads=reads, mutates=mutates, overwrites=self._overwrites(func, inputs, mutated_objs))
        note_untracked(node.meta, inputs)
        if random:
            node.meta["generators"] = {"gen" if takes_generator(func) else f"default:{device}": key}

        if isinstance(mout, torch.Tensor):  # most ops: one tensor out
            same = next((t for t in inputs if t is mout), None)  # in-place / out=: the same Python object
            if same is not None:
                if changes_view(func):  # the object now holds this node's view
                    state_of(same).node = node
                    node.meta["spec"] = TensorSpec.of(same, device)
                self.update_shadows(func, args, kwargs, inputs, mutated_objs, [], random, real_out)
                return same
            known = storage_key(mout) in self._known
            w = self._wrap(mout, node, device)
            if func in ALLOCATIONS and not self.capturing and called_from(_DISTRIBUTED_DIR):
                # a buffer torch.distributed fills by communicating (passes.uninitialized)
                node.meta.update(fill_expected=True, allocates=(self.storage_id(w),))
            self.update_shadows(func, args, kwargs, inputs, mutated_objs, [] if known else [(w, 0)], random,
                                 real_out)
            return w

        # Several results (a tuple, a list): each new tensor is a getitem of the node.
        input_ids = {id(t): t for t in inputs}
        fresh: list[tuple[torch.Tensor, int]] = []
        results = []  # one per tensor in the output
        for j, o in enumerate(leaves(mout)):
            if not isinstance(o, torch.Tensor):
                continue
            if id(o) in input_ids:
                results.append(input_ids[id(o)])  # in-place / out=: the same Python object
            else:
                vnode = self._node(operator.getitem, (node, j), {})
                vnode.meta.update(reads=(), mutates=())
                known = storage_key(o) in self._known
                w = self._wrap(o, vnode, device)
                if not known:
                    fresh.append((w, j))
                results.append(w)
        node.meta["spec"] = None
        self.update_shadows(func, args, kwargs, inputs, mutated_objs, fresh, random, real_out)
        replacements = iter(results)
        return map_tree(lambda o: next(replacements) if isinstance(o, torch.Tensor) else o, mout)

_NAMES: dict[Any, str] = {}
_ABSENT_HINT = "trace on a machine with that device, or for the CPU and materialize with device=..."


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
