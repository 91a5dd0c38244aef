"""Real tensors during capture: values that exist already, and where they may go.

A constructor meets real tensors as well as deferred ones: arguments handed to it, module
globals, what ``torch.load``, ``from_numpy`` or ``safetensors`` return, results built
from those. Eager construction computes with them and writes into them, and the tensors
it returns share their memory; capture keeps those semantics:

* an op whose tensors are all real runs for real, at once: its result is a real tensor,
  a view aliases its real base, an in-place op writes the real tensor (which the caller
  may hold), a random op draws from the real generator (set to its true state first);
* an op that writes into a real tensor from deferred values runs for real on those
  values when they are cheap to know exactly (``Shadows.value_of``: the slice that
  computes them replays from generator snapshots), and is refused otherwise, since a
  real tensor cannot wait for its value;
* any other op (a deferred result computed from real inputs) takes the real inputs as
  graph constants (``Recorder.lift``), with their values as of the op, as eager would
  read them; so does an op of real inputs only whose result the caller asked for on
  another device than the CPU (``real.to("cuda")``, ``zeros_like(real, device="cuda")``):
  such results are deferred on every machine, with the device or without it;
* a result that is not strided (``to_sparse()``) cannot be a node of the graph: it is
  computed for real from exact values, or refused;
* ``deferred.data = real`` (in ``__init__``, an init step, ``nn.utils.vector_to_parameters``)
  makes the deferred tensor real at once, sharing ``real``'s memory as eager's does
  (``adopt_real``); ``real.data = deferred`` makes the real tensor deferred, sharing the
  deferred one's storage (``adopt_deferred``).
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from typing import Any, Iterator

import torch
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit.capture.devices import default_device, device_available, output_device
from fxinit.capture.deferred import dressed_as, is_deferred_tensor, state_of
from fxinit.capture.materialized_marks import unmark
from fxinit.capture.schema import generator_of, mutated_arg_indices, schema_value
from fxinit.capture.swap import swap
from fxinit.capture.trees import leaves, map_tree, tensors_in
from fxinit.ops import draws_random

aten = torch.ops.aten

NOT_REAL = object()  # real_tensor_op's answer when the op is recorded as usual
STORAGES = (torch.UntypedStorage, torch.TypedStorage)


def real_tensor_op(recorder: Any, func: Any, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` for real when eager semantics need it (see the module docstring), or
    return ``NOT_REAL`` to have it recorded with its real inputs lifted."""
    tensors = tensors_in((args, kwargs))
    deferred = [t for t in tensors if is_deferred_tensor(t)]
    if any(state_of(t).recorder is not recorder for t in deferred):
        return NOT_REAL  # the recorder refuses mixing traces
    written = [t for i in mutated_arg_indices(func) for t in tensors_in(schema_value(func, args, kwargs, i))]
    writes_real = any(not is_deferred_tensor(t) for t in written)
    shared = [recorder.lifted_reals.get(t.untyped_storage().data_ptr()) for t in written
              if recorder.lifted_reals and not is_deferred_tensor(t)]
    if any(shared):
        raise recorder.fail(
            f"fxinit cannot run {func} here: this real tensor shares memory with a deferred one in eager "
            f"construction ({next(r for r in shared if r)}), so this write would change both there, and fxinit "
            "keeps them apart", op=str(func), hint="write before the `.data =` assignment, or assign a deferred tensor")
    if deferred and not writes_real:
        return NOT_REAL
    if deferred and any(t.device.type == "meta" for t in tensors if not is_deferred_tensor(t)):
        return NOT_REAL  # a plain meta tensor mixed in: the recorder says what went wrong
    if draws_random(func, args, kwargs):
        recorder.lazy_cpu.flush()
        gen = generator_of(func, args, kwargs) if hasattr(func, "_schema") else kwargs.get("generator")
        if gen is not None:
            recorder.lazy_cpu.true_snapshot(gen)  # the true state in place before it draws
    if not deferred:
        if recorder._intended is not None and _on_meta(kwargs):
            # ``zeros_like(real, device="cuda")``, ``real.to("cuda")``: built on meta for a device
            # (which this machine may lack), so deferred there, with the real inputs as constants
            return NOT_REAL
        with recorder.suspended(), _as_called(recorder, tensors):
            return func(*args, **kwargs)
    if torch.is_grad_enabled() and any(t.requires_grad for t in deferred):
        raise recorder.fail(  # (found by fuzzer seed 22: the gradient reached the deferred tensor, not the real one)
            f"fxinit cannot write a deferred tensor that requires grad into a real tensor with autograd on ({func}): "
            "eager's real tensor would lead its gradient to the parameter, which has no value yet",
            op=str(func), hint="write under torch.no_grad(), as init code does, or after fxinit.materialize")
    if any(recorder.value_of(t, bounded=recorder.capturing) is None for t in deferred):
        raise recorder.fail(
            f"fxinit cannot write deferred values into a real tensor ({func}): the real tensor is there now, "
            "its new value would have to be computed now, and that is too costly while recording",
            op=str(func),
            hint="let the tensor written be deferred too (build it inside the constructor, not before it), or "
                 "compute this after fxinit.materialize")
    return recorder.compute_real(func, args, kwargs)


def _as_called(recorder: Any, tensors: list[torch.Tensor]) -> Any:
    """Subclasses' ``__torch_function__`` as it was where the op was called, for a wrapper
    subclass's own ``__torch_dispatch__`` (torchao's float8 weights): there eager's deferred
    tensors say their device, not meta."""
    foreign = any(type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__ for t in tensors)
    if foreign and recorder.torch_function_outside and not torch._C._is_torch_function_enabled():
        return torch._C._EnableTorchFunction()
    return contextlib.nullcontext()


def _on_meta(kwargs: dict) -> bool:
    device = kwargs.get("device")
    return device is not None and torch.device(device).type == "meta"


def adopt_real(recorder: Any, t: torch.Tensor, src: torch.Tensor, refuse: bool = True) -> bool:
    """``t.data = src``, ``t`` deferred and ``src`` real: eager's ``t`` now is ``src``'s memory
    (a later write through either is seen by both), and so is this one. ``t`` becomes real
    now: the same Python object (``swap_tensors``), still a Parameter of its class, with its
    hooks and attributes; what it was before no longer matters. It is a real tensor the model
    holds, as one handed to the constructor (``init_graph`` carries it, ``dtype=`` casts it).
    False when ``t`` cannot be swapped while recording (or with ``refuse=False``): the caller
    takes a copy instead."""
    if src.device.type == "meta":
        raise recorder.fail(
            "fxinit cannot give a deferred tensor the .data of a plain meta tensor, which has no value",
            op="Tensor.data", hint="build that tensor on a real device")
    new = dressed_as(t, src)
    try:
        with _weak_references_dropped(recorder, t):
            swap(t, new)
    except RuntimeError as exc:
        if recorder.capturing or not refuse:
            return False
        raise recorder.fail(
            f"fxinit cannot make this deferred tensor real for `.data = ...`: {exc}", op="Tensor.data",
            hint="drop other references (weak references) to the tensor, or materialize it before this line") from exc
    unmark(t)
    state_of(new).now = t  # (``new`` holds what ``t`` was: a kept tensor's ``grad_fn`` may lead to it)
    return True


def adopt_deferred(recorder: Any, t: torch.Tensor, src: torch.Tensor) -> bool:
    """``t.data = src``, ``t`` real and ``src`` deferred: eager's ``t`` now is ``src``'s memory,
    which does not exist before materialize, so ``t`` becomes deferred: an alias of ``src``,
    the same Python object (``swap_tensors``), of its class (a Parameter stays one). A model
    that holds it materializes it as a view of ``src``'s storage; elsewhere
    ``fxinit.materialize(t)`` does. False when ``t`` cannot be swapped (views of it, weak
    references, or a gradient graph built from it: ``b = t[t > 0]`` before, whose
    ``AccumulateGrad`` a swap would poison where eager's ``.data =`` keeps it), or when ``t``
    has a ``grad_fn`` (``b = arg.clone()``), which eager's ``.data =`` keeps and a deferred
    alias would not: the caller decides."""
    if t._use_count() > 1 or t.grad_fn is not None:
        return False
    with torch._C.DisableTorchFunctionSubclass():
        alias = recorder.dispatch(aten.detach.default, (src,), {})
    new = torch.nn.Parameter(alias, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) \
        else alias.requires_grad_(t.requires_grad)
    for k, v in t.__dict__.items():
        new.__dict__.setdefault(k, v)
    try:
        with _weak_references_dropped(recorder, t):
            swap(t, new)
    except RuntimeError:
        return False
    recorder.adopted.append(t)  # materialized with src's storage, whoever holds it
    return True


@contextlib.contextmanager
def _weak_references_dropped(recorder: Any, t: torch.Tensor) -> Iterator[None]:
    """``swap_tensors`` refuses a tensor with weak references: RNNs keep them to their flat
    weights. As ``RNNBase._apply`` does, they are dropped for the swap and rebuilt after."""
    if not weakref.getweakrefs(t):
        yield
        return
    root = recorder.root  # None while the constructor runs: then whoever holds the references
    candidates = root.modules() if root is not None else (
        m for r in weakref.getweakrefs(t) for refs in gc.get_referrers(r) if type(refs) is list
        for d in gc.get_referrers(refs) if type(d) is dict and d.get("_flat_weight_refs") is refs
        for m in gc.get_referrers(d) if isinstance(m, torch.nn.Module) and m.__dict__ is d)
    holders = [m for m in candidates if hasattr(m, "_init_flat_weights")
               and any(r is not None and r() is t for r in getattr(m, "_flat_weight_refs", ()))]
    for m in holders:
        m._flat_weight_refs = []
    try:
        yield
    finally:
        for m in holders:
            m._init_flat_weights()


def is_strided_result(mout: Any) -> bool:
    return all(o.layout == torch.strided for o in leaves(mout) if isinstance(o, torch.Tensor))


def non_strided_result(recorder: Any, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> Any:
    """A sparse (or other non-strided) result: real, from exact values, on the device eager
    builds it on (``torch.sparse_coo_tensor`` under ``with torch.device("cuda")``), or refused."""
    device = output_device(func, inputs, kwargs, recorder._intended)
    if not draws_random(func, args, kwargs) and all(recorder.value_of(t) is not None for t in inputs):
        if device.type not in ("cpu", "meta") and not device_available(device):
            raise recorder.fail(f"fxinit cannot build {func}'s non-strided (sparse) result for {device} on a machine "
                                "without it: it is kept as a real tensor", op=str(func),
                                hint="trace on a machine with that device, or build it after fxinit.materialize")
        real = recorder.compute_real(func, args, kwargs)
        return real.to(device) if device.type not in ("cpu", "meta") else real
    raise recorder.fail(
        f"fxinit cannot defer {func}: its result is not a strided tensor (sparse, ...), which an init graph cannot "
        "hold, and its inputs are too costly to compute while recording",
        op=str(func),
        hint="build this tensor from real data, or after fxinit.materialize")


#: Sparse constructors and the position of their ``size``, which, when not given, torch's C++
#: infers from the indices' values (a deferred tensor has none: meta underneath).
SIZE_FROM_INDICES = {torch.sparse_coo_tensor: 2, torch.sparse_compressed_tensor: 3, torch.sparse_csr_tensor: 3,
                     torch.sparse_csc_tensor: 3, torch.sparse_bsr_tensor: 3, torch.sparse_bsc_tensor: 3}


def with_inferred_size(recorder: Any, func: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """``func``'s arguments with the ``size`` torch would infer from deferred indices, read
    from their exact values (then the call runs as one given that size, recorded as eager
    runs it: a result made from a parameter keeps its autograd edge); as they are where the
    size is given or no index is deferred."""
    at = SIZE_FROM_INDICES[func]
    if len(args) > at or kwargs.get("size") is not None:
        return args, kwargs
    if not any(is_deferred_tensor(t) for t in tensors_in((args, kwargs))):
        return args, kwargs
    indices = [t for t in tensors_in((args[:at - 1], {k: v for k, v in kwargs.items() if k != "values"}))
               if is_deferred_tensor(t)]
    if any(recorder.value_of(t) is None for t in indices):
        raise recorder.fail(
            f"fxinit cannot infer the size of {func.__name__}'s result: it comes from the values of the indices, "
            "which are too costly to compute while recording", op=func.__name__,
            hint="pass size= (the dense shape) to the constructor")

    def stand_in(x: Any) -> Any:  # the indices' values; the values' shape is all the size needs of them
        if not is_deferred_tensor(x) or any(x is i for i in indices):
            return x
        with recorder.suspended():
            return FACTORIES.zeros(x.shape, dtype=x.dtype)

    real = recorder.compute_real(func, map_tree(stand_in, args), map_tree(stand_in, kwargs))
    return args, {**kwargs, "size": tuple(real.shape)}


def shares_memory(func: Any, data: Any, device: Any) -> bool:
    """Whether eager's ``func(data)`` (``from_numpy``, ``frombuffer``, ``as_tensor`` of an
    array or a real CPU tensor) returns a tensor sharing the caller's memory: then capture
    returns that real tensor too, and later writes through either side are seen by both."""
    if func is torch.from_numpy or func is torch.frombuffer:
        return True
    if func is torch.tensor:
        return False
    if (torch.device(device) if device is not None else default_device()).type != "cpu":
        return False
    if isinstance(data, torch.Tensor):
        return not is_deferred_tensor(data) and data.device.type == "cpu"
    return hasattr(data, "__array_interface__")


def contains_deferred(data: Any) -> bool:
    """A (nested) list or tuple with a deferred tensor in it (``torch.tensor([a, b])``)."""
    return isinstance(data, (list, tuple)) and any(is_deferred_tensor(x) for x in leaves(data))


def set_from_storage(recorder: Any, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """``t.set_(storage, ...)`` with a real storage: how ``torch.load`` (``mmap`` and
    ``weights_only`` too) and other deserializers rebuild a tensor. Its value is the
    storage's data now: ``t`` becomes a constant of that value (no copy: nothing in
    the graph writes a constant)."""
    t = args[0]
    if not is_deferred_tensor(t):
        with recorder.suspended():
            return func(*args, **kwargs)
    storage = args[1]
    if isinstance(storage, torch.TypedStorage):
        storage = storage._untyped_storage
    if storage.device.type == "meta":
        raise recorder.fail("fxinit cannot rebuild a deferred tensor from a meta storage", op=str(func),
                            hint="load the data for real (map_location='cpu')")
    with recorder.suspended(), torch.no_grad():
        real = FACTORIES.empty(0, dtype=t.dtype, device=storage.device).set_(storage, *args[2:], **kwargs)
    recorder.set_data(t, real, copy=False)
    return t
