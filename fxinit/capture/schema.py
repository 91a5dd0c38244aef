"""What capture needs to know about aten ops: facts read off their schemas, and the sets of
ops it treats specially (collectives, lifts, data-dependent ops, whole-storage overwrites)."""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit.ops import positional_generator
from fxinit.rng.draws import call_key

aten = torch.ops.aten

DETACH = aten.detach.default
COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "_dtensor"}
SCALAR_FACTORIES = {aten.scalar_tensor.default, aten.lift_fresh.default}
# In-place ops whose result does not depend on the old contents of what they write.
OVERWRITE_OPS = {
    aten.uniform_, aten.normal_, aten.bernoulli_, aten.exponential_, aten.random_, aten.cauchy_,
    aten.log_normal_, aten.geometric_, aten.fill_, aten.zero_, aten.copy_,
}
LIFT_OPS = {aten.lift_fresh.default, aten.lift_fresh_copy.default, aten.lift.default}
DATA_DEPENDENT = {
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
WHAT_THE_USER_WROTE = {
    aten._local_scalar_dense.default: "reading a value (Tensor.item(), bool(t) as in `if t > 0:`, float(t), int(t))",
    aten.is_nonzero.default: "bool(tensor) (e.g. `if t:` or `if t.any():`)",
    aten.nonzero.default: "Tensor.nonzero() / torch.where(cond)",
    aten.equal.default: "torch.equal",
}


@functools.lru_cache(maxsize=None)
def takes_generator(func: Any) -> bool:
    return any(a.name == "generator" for a in func._schema.arguments)


@functools.lru_cache(maxsize=None)
def takes_device(func: Any) -> bool:
    """Whether ``func``'s schema has a ``device`` argument (factories: ``aten.randn``)."""
    return any(a.name == "device" for a in func._schema.arguments)


def generator_of(func: Any, args: tuple, kwargs: dict) -> Any:
    """The generator a call of ``func`` is given, or None: keyword-only in most samplers
    (``normal_``), positional in others (``poisson``, ``binomial``, ``_standard_gamma``,
    ``rrelu_with_noise``), where the dispatcher passes it among ``args``."""
    at = positional_generator(func)
    return args[at] if at is not None and at < len(args) else kwargs.get("generator")


# Ops that write into arguments their schema does not mark as written (running stats).
UNANNOTATED_WRITES = {
    aten.native_batch_norm.default: (3, 4),
    aten.cudnn_batch_norm.default: (3, 4),
    aten.miopen_batch_norm.default: (3, 4),
}


def updates_running_stats(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether a call of an op of ``UNANNOTATED_WRITES`` writes those arguments: in training
    (``training``, the sixth argument of each), not in evaluation."""
    return func not in UNANNOTATED_WRITES or bool(schema_value(func, args, kwargs, 5))


@functools.lru_cache(maxsize=None)
def mutated_arg_indices(func: Any) -> tuple[int, ...]:
    marked = [i for i, a in enumerate(func._schema.arguments) if a.alias_info is not None and a.alias_info.is_write]
    return (*marked, *(i for i in UNANNOTATED_WRITES.get(func, ()) if i not in marked))


def schema_value(func: Any, args: tuple, kwargs: dict, i: int) -> Any:
    if i < len(args):
        return args[i]
    return kwargs.get(func._schema.arguments[i].name)


# In-place fills whose meta kernels are Python references (normal_'s costs ~0.3 ms a call,
# and a 405B model has ~900): their result is the tensor itself.
SLOW_META_FILLS = {aten.normal_.default, aten.uniform_.default}
# Ops autocast runs in a lower precision on CPU and CUDA. Autocast acts on the device's dispatch
# key, which meta tensors lack: recorded under it, they would keep full precision.
AUTOCAST_LOWER = {getattr(aten, name) for name in (
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "addmv", "mv", "dot", "vdot", "convolution",
    "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d", "conv_transpose2d",
    "conv_transpose3d", "prelu", "_scaled_dot_product_attention_math", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "chain_matmul", "linalg_multi_dot") if hasattr(aten, name)}
_PROBE_GENERATOR = torch.Generator()  # what probes draw is thrown away


def fill_result(func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """What the meta kernel of in-place fill ``func`` returns (``args[0]``), after eager's
    argument checks: the CPU kernel on one element, drawing from a generator of its own."""
    key = call_key(func, args, kwargs, args[0])
    if key is not None and key in _ACCEPTED:
        return args[0]
    probe = FACTORIES.empty(1, dtype=args[0].dtype)
    func(probe, *args[1:], **{**kwargs, "generator": _PROBE_GENERATOR})
    if key is not None:
        _ACCEPTED.add(key)
    return args[0]


_ACCEPTED: set[tuple] = set()
