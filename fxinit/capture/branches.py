"""Composite ops that choose their kernel by the input's device in C++, run as eager runs
them on the *target* device.

A deferred tensor is meta underneath, so C++ code that asks ``input.is_cuda()`` hears
"no" and takes the CPU branch while recording, whatever device the model is built for. The
capture could instead report the target device to C++ (as torch's ``FakeTensor`` does), but
then every kernel registered for that device would run on fake data here, including on a
machine without that device; fxinit records on meta kernels and runs the branch choice in
Python instead, for the ops that branch. Found by reading torch's sources (2.11-2.15):

- ``aten::dropout`` (``Dropout.cpp``): on CUDA/XPU/lazy/privateuse1 inputs in training with
  ``0 < p < 1`` and elements, ``native_dropout``, a fused kernel that draws differently
  from ``bernoulli_``; ``dropout_`` (``inplace=True``), ``feature_dropout`` and the
  ``alpha_dropout``s always take ``bernoulli_``, on every device (:func:`dropout_call`).
- ``nn.RNNBase.flatten_parameters`` (Python): on CUDA, with cuDNN acceptable, it reads every
  flat weight's ``data_ptr()`` and copies them into one buffer (drawing nothing). Asked of
  deferred weights, ``data_ptr()`` answers 0 for all (they "alias"), so it does nothing;
  materialize flattens the real weights (``RNNBase._init_flat_weights``), as eager did
  (:data:`RAW_ACCESS_ANSWERS` in ``capture.deferred``).
- ``aten::scaled_dot_product_attention`` (``attention.cpp``): a backend chosen per device
  (``_fused_sdp_choice_stub``; meta has none, so math); ``aten::lstm`` (``RNN.cpp``:
  oneDNN's ``mkldnn_rnn_layer`` where ``use_mkldnn``, a CPU float input); ``lstm``, ``gru``,
  ``rnn_tanh`` and ``rnn_relu`` of whole sequences (``FullLayer``: on the CPU every step's
  input projection in one matrix product, elsewhere one per step); ``aten::group_norm``
  (``group_norm.cpp``: on the CPU a channels-last input stays channels-last, and its kernel
  sums in another order; elsewhere it is made contiguous first). For a CPU target fxinit
  traces the call with torch's ``make_fx`` on fake CPU tensors, which tell C++ the
  device as torch's ``FakeTensor`` does, and records the ops of that trace
  (:func:`cpu_branch_call`): the flash attention kernel, oneDNN's LSTM, and whatever each
  torch version does around them.
- ``torch.normal`` and the other factories a device context does not list: ``capture.devices``.

Where eager's branch on the target device is a kernel fxinit does not rebuild (cuDNN's, a
fused CUDA cell), the ops are recorded on the meta path and marked *inexact*
(:func:`inexact_branch`): a materialize whose tensors need their values refuses by name, and
one that needs only their shapes (a forward run to size a layer) is unaffected:

- On CUDA, ``lstm``, ``gru``, ``rnn_*`` take cuDNN, and ``lstm_cell`` / ``gru_cell`` a
  fused kernel (``_thnn_fused_*_cell``). (The RNNs on the CPU, where make_fx could not trace
  them, likewise.)
- ``aten::batch_norm`` / ``instance_norm`` (``_batch_norm_impl_index``), ``grid_sampler``
  and ``ctc_loss`` take cuDNN's kernels on CUDA where it accepts the input.
- ``aten::softmax`` / ``log_softmax`` of a float16 CUDA input with ``dtype=float32`` run
  ``_softmax(half_to_float=True)``, not a cast and then ``_softmax``.
- ``scaled_dot_product_attention`` on CUDA (flash, memory-efficient or cuDNN attention,
  chosen by the GPU), unless only the math backend is enabled (``sdpa_kernel(MATH)``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import types
from typing import Any, Callable, ContextManager

import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils._pytree import tree_flatten, tree_unflatten
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit.capture.deferred import RAW_ACCESS_ANSWERS, is_deferred_tensor, state_of

_FUSED_DROPOUT_DEVICES = ("cuda", "xpu", "lazy", "privateuseone")


def dropout_call(func: Any, args: tuple, kwargs: dict) -> Callable[[], Any] | None:
    """The call eager makes for ``torch.dropout(input, p, train)`` (or ``F.dropout`` without
    ``inplace``) on a deferred input whose target device takes the fused kernel, or None to
    run ``func`` as it is."""
    if func is torch.dropout:
        names, defaults = ("input", "p", "train"), {}
    elif func is F.dropout:
        names, defaults = ("input", "p", "training", "inplace"), {"p": 0.5, "training": True, "inplace": False}
    else:
        return None
    bound = defaults | dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    if bound.get("inplace"):
        return None
    x, p, train = bound.get("input"), bound.get("p"), bound.get("train", bound.get("training"))
    if not (is_deferred_tensor(x) and train and isinstance(p, (int, float)) and 0 < p < 1 and x.numel() > 0):
        return None
    if state_of(x).device.type not in _FUSED_DROPOUT_DEVICES:
        return None
    return lambda: torch.native_dropout(x, float(p), True)[0]


def _flatten_codes() -> list[types.CodeType]:
    code = torch.nn.RNNBase.flatten_parameters.__code__
    return [code, *(c for c in code.co_consts if isinstance(c, types.CodeType))]  # its comprehension


RAW_ACCESS_ANSWERS.update({code: 0 for code in _flatten_codes()})


_SDPA = torch._C._nn.scaled_dot_product_attention
#: composites whose CPU branch is not the meta one: traced as the CPU runs them (:func:`cpu_branch_call`)
_GROUP_NORMS = {torch.group_norm, F.group_norm}
_CPU_BRANCHING = {_SDPA, torch.lstm, torch.gru, torch.rnn_tanh, torch.rnn_relu, *_GROUP_NORMS}


def _target(tensors: list[Any]) -> torch.device | None:
    """The intended device of the first deferred tensor among ``tensors``."""
    return next((state_of(t).device for t in tensors if is_deferred_tensor(t)), None)


def cpu_branch_call(func: Any, args: tuple, kwargs: dict,
                    suspended: Callable[[], ContextManager[Any]]) -> Callable[[], Any] | None:
    """The ops eager runs for composite ``func`` of deferred inputs meant for the CPU, as a
    call that runs them on those inputs (recording them), or None to run ``func`` as it is.

    torch's own ``make_fx`` traces ``func`` on fake tensors that say ``cpu`` to C++, with the
    inputs' sizes, strides, dtypes and ``requires_grad``, under ``suspended`` (nothing of it
    is recorded): C++ picks the branch it picks for real CPU tensors (``_fused_sdp_choice``'s
    flash attention, with its handling of 3-d inputs where torch has one; oneDNN's LSTM) and
    the trace holds its ops. A composite that make_fx cannot trace runs as it is."""
    if func not in _CPU_BRANCHING or func in _GROUP_NORMS and args and args[0].is_contiguous():
        return None  # (a contiguous input takes one path everywhere)
    if _target(tree_flatten((args, kwargs))[0]) != torch.device("cpu"):
        return None
    return fake_cpu_trace(func, args, kwargs, suspended)


def fake_cpu_trace(func: Any, args: tuple, kwargs: dict,
                   suspended: Callable[[], ContextManager[Any]]) -> Callable[[], Any] | None:
    """``func(*args, **kwargs)`` traced by make_fx on fake tensors that say ``cpu`` to C++,
    in the places of the tensors among the arguments (under ``suspended``: nothing of it is
    recorded), as a call that runs the ops of that trace on those tensors; None where make_fx
    cannot trace it (values read, or invalid arguments: the call as it is raises eager's error)."""
    flat, spec = tree_flatten((args, kwargs))
    positions = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor)]

    def call(*tensors: torch.Tensor) -> Any:
        leaves = list(flat)
        for i, t in zip(positions, tensors):
            leaves[i] = t
        a, k = tree_unflatten(leaves, spec)
        return func(*a, **k)

    # Under inference_mode make_fx makes its fake tensors there, as inference tensors, whose views
    # C++ says need no gradient: a parameter made outside it has views that do, and C++ branches
    # on that (``matmul`` folds). Such a call is traced outside it, under no_grad (same branches).
    leave = torch.is_inference_mode_enabled() and any(
        flat[i].requires_grad and not flat[i].is_inference() for i in positions)
    with suspended(), torch.inference_mode(False) if leave else contextlib.nullcontext(), \
            torch.no_grad() if leave else contextlib.nullcontext():
        try:
            probes = [_probe(flat[i]) for i in positions]
            traced = make_fx(call, decomposition_table=cpp_composites(), tracing_mode="fake")(*probes)
        except Exception:  # noqa: BLE001
            return None
    return lambda: traced(*(flat[i] for i in positions))


def _probe(t: torch.Tensor) -> torch.Tensor:
    """An uninitialized CPU tensor with ``t``'s layout (pages untouched: free at any size), an
    inference tensor where ``t`` is one (C++ takes other branches for those: ``matmul``'s)."""
    with torch.inference_mode(t.is_inference()):
        probe = FACTORIES.empty_strided(t.size(), t.stride(), dtype=t.dtype)
        return probe.requires_grad_() if t.requires_grad else probe


@functools.cache
def cpp_composites() -> dict[Any, Callable[..., Any]]:
    """For make_fx: each composite op (a ``CompositeImplicitAutograd`` kernel) that torch also
    decomposes in Python, run by its C++ kernel, as eager's dispatch runs it. Under
    ``inference_mode`` such ops reach make_fx's tracer whole, and it would run the Python one,
    which is not eager's (torch's ``lstm`` there never applies dropout between layers; its
    ``upsample_bicubic2d`` rounds otherwise)."""
    import torch._decomp  # noqa: F401  (registers torch's Python decompositions, as make_fx does)

    key = torch._C.DispatchKey.CompositeImplicitAutograd
    table = {}
    for packet in list(vars(torch.ops.aten).values()):  # (an op with a Python kernel was looked up: it is here)
        if isinstance(packet, torch._ops.OpOverloadPacket):
            for op in list(vars(packet).values()):
                if isinstance(op, torch._ops.OpOverload) and key in op.py_kernels \
                        and torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), key):
                    table[op] = functools.partial(op._op_dk, key)
    return table


_CUDNN_RNNS = {torch.lstm: "lstm", torch.gru: "gru", torch.rnn_tanh: "rnn_tanh", torch.rnn_relu: "rnn_relu"}
_FUSED_CELLS = {torch.lstm_cell: "lstm_cell", torch.gru_cell: "gru_cell"}
_CUDNN_OPS = {torch.batch_norm: "batch_norm", torch.instance_norm: "instance_norm", F.batch_norm: "batch_norm",
              F.instance_norm: "instance_norm", torch.grid_sampler: "grid_sampler", F.grid_sample: "grid_sampler",
              torch.ctc_loss: "ctc_loss", F.ctc_loss: "ctc_loss"}
# where each takes its dtype= when given by position
_SOFTMAXES = {torch.softmax: ("softmax", 2), torch.log_softmax: ("log_softmax", 2), torch.Tensor.softmax: ("softmax", 2),
              torch.Tensor.log_softmax: ("log_softmax", 2), torch.special.softmax: ("softmax", 2),
              torch.special.log_softmax: ("log_softmax", 2), F.softmax: ("softmax", 3), F.log_softmax: ("log_softmax", 3)}


_MHA_SIGNATURE = inspect.signature(F.multi_head_attention_forward)
_MHA_FORWARD = torch.nn.MultiheadAttention.forward.__code__


def _attention_inside(args: tuple, kwargs: dict) -> str | None:
    """Why ``F.multi_head_attention_forward`` on the CPU runs a kernel the capture does not see,
    or None. Its attention is ``scaled_dot_product_attention`` where ``need_weights=False``
    (``nn.TransformerEncoderLayer``'s), the CPU's flash kernel, called from Python below the
    capture's function mode; and where ``nn.MultiheadAttention.forward`` called it only because
    a deferred tensor has ``__torch_function__`` (its ``why_not_fast_path`` says so) eager's took
    its fast path (``_native_multi_head_attention``), unless autograd needs the result."""
    if not _MHA_SIGNATURE.bind(*args, **kwargs).arguments.get("need_weights", True):
        return "F.multi_head_attention_forward(need_weights=False) runs the CPU's flash attention kernel"
    frame = sys._getframe(1)
    for _ in range(8):
        if frame is None or frame.f_code is _MHA_FORWARD:
            break
        frame = frame.f_back
    if frame is None or frame.f_code is not _MHA_FORWARD:
        return None  # not nn.MultiheadAttention's: no fast path
    reason, tensors = frame.f_locals.get("why_not_fast_path", ""), frame.f_locals.get("tensor_args", ())
    if "has_torch_function" in reason and not (
            torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in tensors)):
        return "nn.MultiheadAttention evaluating without autograd runs its fast path on the CPU"
    return None


def inexact_branch(func: Any, args: tuple, kwargs: dict) -> str | None:
    """Why eager, on the target device of ``func``'s deferred inputs, runs a kernel other than
    the one fxinit records (the meta path), or None: see the module doc."""
    name = _CUDNN_RNNS.get(func) or _FUSED_CELLS.get(func) or _CUDNN_OPS.get(func) or _SOFTMAXES.get(func, (None,))[0]
    if name is None and func is not _SDPA and func is not F.multi_head_attention_forward and func not in _GROUP_NORMS:
        return None
    tensors = [x for a in (*args, *kwargs.values()) for x in (a if isinstance(a, (list, tuple)) else (a,))]
    target = _target(tensors)
    if target is None or target.type == "meta":
        return None
    if target.type == "cpu":
        if func in _CUDNN_RNNS and not isinstance(args[1], torch.Tensor):  # (packed sequences do not branch)
            return f"aten::{name} computes every step's input projection at once on the CPU (or runs oneDNN's LSTM)"
        if func is F.multi_head_attention_forward:
            return _attention_inside(args, kwargs)
        if func in _GROUP_NORMS and args and not args[0].is_contiguous():  # (where make_fx could not trace it)
            return "aten::group_norm keeps a channels-last input so on the CPU, and sums in another order"
        return None
    if func in _SOFTMAXES:
        at = _SOFTMAXES[func][1]
        dtype = kwargs.get("dtype", args[at] if len(args) > at else None)
        if target.type == "cuda" and args[0].dtype == torch.float16 and dtype == torch.float32:
            return f"aten::{name} of a float16 tensor with dtype=float32 runs _{name}(half_to_float=True) on CUDA"
        return None
    if func is _SDPA:
        if target.type == "cuda" and not (torch.backends.cuda.flash_sdp_enabled()
                                          or torch.backends.cuda.mem_efficient_sdp_enabled()
                                          or torch.backends.cuda.cudnn_sdp_enabled()):
            return None  # math only: the path recorded
        return f"aten::scaled_dot_product_attention runs a fused attention kernel chosen by the {target.type} device"
    if func in _FUSED_CELLS:
        return f"aten::{name} runs a fused kernel (_thnn_fused_{name}) on {target.type}"
    if func in _CUDNN_OPS and target.type == "cuda" and not torch.backends.cudnn.enabled:
        return None
    return f"aten::{name} runs cuDNN's kernel (or a fused cell) on {target.type}"
