"""Composite ops whose C++ picks a kernel by the input's device (``capture/branches.py``).

A deferred tensor is meta underneath, where ``scaled_dot_product_attention`` has no backend
choice (math) and ``lstm`` no oneDNN: eager's CPU construction took flash attention and
oneDNN's LSTM, fxinit recorded the meta path, and materialize gave other bits, silently
(found by ``tools/ops_differential.py`` on torch 2.14, whose OpInfo samples reach the CPU's
flash branch with 3-d inputs). For a CPU target the call is now traced with ``make_fx`` on
fake CPU tensors, as C++ runs it there. Where eager's branch is a kernel fxinit does not
rebuild (cuDNN, fused CUDA cells), the recorded ops are marked and a materialize whose
values need them refuses by name."""

from __future__ import annotations

import contextlib

from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fxinit
from conftest import assert_modules_equal, eager_and_traced, same_bits


class Attention(nn.Module):
    """Attention computed in ``__init__`` from parameters and random inputs, kept as buffers."""

    def __init__(self, shape: tuple[int, ...], mask: str, causal: bool = False, gqa: bool = False,
                 dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.q = nn.Parameter(torch.randn(shape, dtype=dtype))
        kv_shape = (*shape[:-3], shape[-3] // 2, *shape[-2:]) if gqa else shape
        k, v = torch.randn(kv_shape, dtype=dtype), torch.randn(kv_shape, dtype=dtype)
        L = shape[-2]
        attn_mask = {"none": None, "bool": torch.rand(L, L) > 0.3, "float": torch.randn(L, L, dtype=dtype)}[mask]
        self.register_buffer("out", F.scaled_dot_product_attention(self.q, k, v, attn_mask=attn_mask,
                                                                   is_causal=causal, enable_gqa=gqa))
        with torch.no_grad():
            self.register_buffer("frozen", F.scaled_dot_product_attention(self.q * 2, k, v, scale=0.3,
                                                                          enable_gqa=gqa))


@pytest.mark.parametrize("shape, mask, causal, gqa, dtype", [
    ((2, 4, 8, 16), "none", False, False, torch.float32),
    ((2, 4, 8, 16), "bool", False, False, torch.float32),
    ((2, 4, 8, 16), "float", False, False, torch.float32),
    ((1, 2, 16, 8), "none", True, False, torch.float32),
    ((2, 4, 8, 16), "none", False, True, torch.float32),
    ((3, 8, 16), "none", False, False, torch.float32),  # 3-d: torch 2.14 unsqueezes into flash attention
    ((2, 4, 8, 16), "bool", False, False, torch.bfloat16),
    ((2, 4, 8, 16), "none", False, False, torch.float64),
])
def test_attention_in_a_constructor_runs_the_cpus_kernel(shape, mask, causal, gqa, dtype) -> None:
    ref, m, eager_rng, traced_rng = eager_and_traced(Attention, shape, mask, causal, gqa, dtype)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)
    assert torch.equal(eager_rng, traced_rng)
    assert type(m.out.grad_fn).__name__ == type(ref.out.grad_fn).__name__
    (grad,), (want,) = torch.autograd.grad(m.out.sum(), [m.q]), torch.autograd.grad(ref.out.sum(), [ref.q])
    assert same_bits(grad, want)


def test_the_flash_kernel_is_what_was_recorded() -> None:
    """The recorded graph holds the CPU's flash attention op, not the math path's softmax."""
    m = fxinit.trace_init(Attention, (2, 4, 8, 16), "bool")
    targets = {str(n.target) for n in fxinit.init_graph(m).graph.nodes}
    assert "aten._scaled_dot_product_flash_attention_for_cpu.default" in targets
    assert not any("softmax" in t for t in targets)


class Recurrent(nn.Module):
    def __init__(self, kind: str, keep: bool, **kwargs: Any) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(8, 16, batch_first=True, **kwargs)
        out = self.rnn(torch.randn(2, 5, 8))[0]
        if keep:  # a buffer computed by the layer
            self.register_buffer("summary", out.detach().mean(1))
        self.head = nn.Linear(out.shape[-1], 4)  # a forward run to size the next layer


@pytest.mark.parametrize("kind, kwargs", [
    ("LSTM", {}),
    ("LSTM", dict(num_layers=2, bidirectional=True)),
    ("LSTM", dict(proj_size=4)),
    ("GRU", dict(num_layers=2)),
    ("RNN", {}),
])
def test_recurrent_layers_run_in_a_constructor(kind, kwargs) -> None:
    """eager's CPU LSTM is oneDNN's (``mkldnn_rnn_layer``): the meta path gave other bits."""
    for keep in (True, False):
        ref, m, eager_rng, traced_rng = eager_and_traced(Recurrent, kind, keep, **kwargs)
        fxinit.materialize(m)
        assert_modules_equal(m, ref)
        assert torch.equal(eager_rng, traced_rng)


_GRAD_MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}


class RunUnder(nn.Module):
    """A recurrent layer run in ``__init__`` under a grad mode, its output kept, and a draw after;
    ``whole``: the whole constructor runs under it (parameters made under ``inference_mode``
    are inference tensors, whose views C++ says need no gradient: ``matmul`` folds otherwise)."""

    def __init__(self, kind: str, mode: str, batch_first: bool = False, **kwargs: Any) -> None:
        super().__init__()
        self.rnn = getattr(nn, kind)(3, 4, batch_first=batch_first, **kwargs)
        with _GRAD_MODES[mode]():
            out = self.rnn(torch.randn(4, 2, 3, dtype=self.rnn.weight_hh_l0.dtype))[0]
        self.register_buffer("out", out.detach().clone())
        self.after = nn.Parameter(torch.randn(3))


@pytest.mark.parametrize("whole", ["inference_mode", "no_grad", None])
@pytest.mark.parametrize("kind", ["RNN", "GRU", "LSTM"])
def test_batch_first_recurrent_layers_under_inference_mode_are_eagers(kind: str, whole: str | None) -> None:
    """Found by the review: traced outside inference_mode, the calls of a constructor built whole
    under it took ``matmul``'s other branch (1 unit in the last place off, silently)."""
    with _GRAD_MODES[whole]() if whole else contextlib.nullcontext():
        ref, m, eager_rng, traced_rng = eager_and_traced(RunUnder, kind, "inference_mode", True, num_layers=2,
                                                         dropout=0.3)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)
    assert torch.equal(eager_rng, traced_rng)


@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
@pytest.mark.parametrize("kind, kwargs", [
    ("RNN", {}),
    ("RNN", dict(num_layers=2, dropout=0.3, nonlinearity="relu")),
    ("GRU", dict(num_layers=2, dropout=0.3)),
    ("LSTM", dict(num_layers=2, dropout=0.3)),
    ("LSTM", dict(num_layers=2, dropout=0.3, dtype=torch.float64)),  # not oneDNN's: the native CPU path
])
def test_recurrent_layers_run_under_any_grad_mode_are_eagers(kind, kwargs, mode) -> None:
    """On the CPU, torch's C++ RNNs project every step's input in one matrix product (on other
    devices, one per step: the meta path recorded that, 1 unit in the last place off). Under
    inference_mode the op reached the capture whole, and torch's Python decomposition ran
    there, which drops the dropout between layers (and so every draw after it)."""
    ref, m, eager_rng, traced_rng = eager_and_traced(RunUnder, kind, mode, **kwargs)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)
    assert torch.equal(eager_rng, traced_rng)


class GroupNormed(nn.Module):
    def __init__(self, mode: str, how: str) -> None:
        super().__init__()
        self.gn = nn.GroupNorm(2, 64)
        x = torch.randn(2, 64, 7, 7).contiguous(memory_format=torch.channels_last)
        with {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "grad": torch.enable_grad}[mode]():
            y = self.gn(x) if how == "module" else torch.group_norm(x, 2, self.gn.weight, self.gn.bias)
        self.register_buffer("out", y.detach().clone(memory_format=torch.preserve_format))


@pytest.mark.parametrize("how", ["module", "torch"])
@pytest.mark.parametrize("mode", ["inference_mode", "no_grad", "grad"])
def test_group_norm_of_a_channels_last_input_is_eagers(mode: str, how: str) -> None:
    """Found by an audit of torch's composites: on the CPU ``group_norm`` keeps a channels-last
    input so (its kernel sums in another order, its output is channels-last); on meta it made
    the input contiguous: other bits and strides, silently."""
    ref, m, _, _ = eager_and_traced(GroupNormed, mode, how)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


class Attending(nn.Module):
    def __init__(self, kind: str, evaluating: bool, keep: bool) -> None:
        super().__init__()
        x = torch.randn(2, 3, 8)
        if kind == "encoder layer":
            self.layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
            run = lambda: self.layer(x)  # noqa: E731
        else:  # (eager's fast path needs batch_first)
            self.layer = nn.MultiheadAttention(8, 2, batch_first=kind != "weights, sequence first")
            run = lambda: self.layer(x, x, x, need_weights=kind.startswith("weights"))[0]  # noqa: E731
        self.layer.train(not evaluating)
        with torch.no_grad() if evaluating else contextlib.nullcontext():
            out = run()
        if keep:
            self.register_buffer("out", out.detach())
        self.head = nn.Linear(out.shape[-1], 2)  # a forward run to size the next layer


@pytest.mark.parametrize("kind, evaluating, inexact", [
    ("encoder layer", False, True), ("encoder layer", True, True), ("no weights", False, True),
    ("weights", False, False), ("weights", True, True), ("weights, sequence first", True, False)])
def test_attention_inside_multi_head_attention_is_marked(kind: str, evaluating: bool, inexact: bool) -> None:
    """Found by the same audit: ``nn.MultiheadAttention`` without weights (every
    ``TransformerEncoderLayer``) calls the CPU's flash attention from Python, below the capture's
    function mode, and evaluating without autograd it takes its fast path in eager: the meta path
    was recorded, 1e-7 off, silently. Now marked: a kept value is refused by name, a forward run
    for a shape is not."""
    ref, m, _, _ = eager_and_traced(Attending, kind, evaluating, True)
    if inexact:
        with pytest.raises(fxinit.DeferredInitError, match="fxinit cannot give eager's values here"):
            fxinit.materialize(m)
    else:
        fxinit.materialize(m)
        assert_modules_equal(m, ref)
    ref, m, _, _ = eager_and_traced(Attending, kind, evaluating, False)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


class KeptWithAutograd(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(4, 6, num_layers=2, batch_first=True)
        self.register_buffer("out", self.rnn(torch.randn(2, 3, 4))[0])  # grad on: a grad_fn to the weights


def test_an_lstm_output_kept_with_autograd() -> None:
    """oneDNN's LSTM picks another primitive under no_grad (other bits): the replay runs it in
    the grad mode it was recorded in (``ops.reads_grad_mode``). Its ``batch_first`` output is a
    view of a temporary, rebuilt with eager's ``grad_fn``."""
    ref, m, _, _ = eager_and_traced(KeptWithAutograd)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)
    assert type(m.out.grad_fn).__name__ == type(ref.out.grad_fn).__name__ == "TransposeBackward0"
    got = torch.autograd.grad(m.out.sum(), list(m.rnn.parameters()))
    want = torch.autograd.grad(ref.out.sum(), list(ref.rnn.parameters()))
    assert all(same_bits(a, b) for a, b in zip(got, want))


def test_lstm_with_onednn_off_is_the_native_path() -> None:
    with torch.backends.mkldnn.flags(enabled=False):
        ref, m, _, _ = eager_and_traced(Recurrent, "LSTM", True)
        targets = {str(n.target) for n in fxinit.init_graph(m).graph.nodes}
    fxinit.materialize(m)
    assert_modules_equal(m, ref)
    assert "aten.mkldnn_rnn_layer.default" not in targets


# ----------------------------------------------------------------- CUDA targets (no GPU needed)

def _marked(build: Callable[[], nn.Module]) -> set[str]:
    with torch.device("cuda"):
        m = fxinit.trace_init(build)
    return {n.meta["inexact"].split(" ")[0] for n in fxinit.init_graph(m).graph.nodes if n.meta.get("inexact")}


_RECURRENT = {"lstm": nn.LSTM, "gru": nn.GRU, "lstm_cell": nn.LSTMCell, "gru_cell": nn.GRUCell}


class ForCuda(nn.Module):
    def __init__(self, what: str) -> None:
        super().__init__()
        x = torch.randn(2, 4, 8, 8)
        if what == "batch_norm":
            self.register_buffer("o", nn.BatchNorm2d(4)(x))
        elif what == "instance_norm":
            self.register_buffer("o", F.instance_norm(x))
        elif what == "grid_sampler":
            self.register_buffer("o", F.grid_sample(x, torch.rand(2, 3, 3, 2), align_corners=True))
        elif what == "softmax":
            self.register_buffer("o", F.softmax(x.half(), -1, dtype=torch.float32))
        elif what == "log_softmax":
            self.register_buffer("o", x.half().log_softmax(-1, dtype=torch.float32))
        elif what in _RECURRENT:
            self.register_buffer("o", _RECURRENT[what](8, 8)(x[0, 0])[0])
        elif what == "scaled_dot_product_attention":
            self.register_buffer("o", F.scaled_dot_product_attention(x, x, x))
        self.register_buffer("plain", x.softmax(-1))  # no branch: not marked


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks recording for a CUDA that is absent")
@pytest.mark.parametrize("what", ["batch_norm", "instance_norm", "grid_sampler", "softmax", "log_softmax", "lstm", "gru",
                                  "lstm_cell", "gru_cell", "scaled_dot_product_attention"])
def test_kernels_fxinit_does_not_rebuild_on_cuda_are_marked(what) -> None:
    assert _marked(lambda: ForCuda(what)) == {f"aten::{what}"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks recording for a CUDA that is absent")
def test_turning_the_fused_kernels_off_leaves_the_recorded_path_exact() -> None:
    with sdpa_kernel(SDPBackend.MATH):
        assert _marked(lambda: ForCuda("scaled_dot_product_attention")) == set()
    with torch.backends.cudnn.flags(enabled=False):
        assert _marked(lambda: ForCuda("batch_norm")) == set()
        assert _marked(lambda: ForCuda("lstm_cell")) == {"aten::lstm_cell"}  # a fused cell, not cuDNN


def test_a_marked_value_is_refused_where_needed_and_nowhere_else(monkeypatch, tmp_path) -> None:
    """On the CPU, with make_fx unable to trace the LSTM, its ops are marked: a buffer that
    needs them is refused by name, a forward run only for a shape is not; artifacts keep the mark."""
    import fxinit.capture.branches as branches

    def untraceable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no make_fx here")

    monkeypatch.setattr(branches, "make_fx", untraceable)
    shape_only = fxinit.trace_init(Recurrent, "LSTM", False)
    fxinit.materialize(shape_only)
    assert not fxinit.is_deferred(shape_only)
    m = fxinit.trace_init(Recurrent, "LSTM", True)
    graph = fxinit.init_graph(m)
    graph.save(tmp_path / "init.pt")
    assert any(n.meta.get("inexact") for n in fxinit.load_graph(tmp_path / "init.pt").graph.nodes)
    with pytest.raises(fxinit.DeferredInitError, match=r"oneDNN's LSTM[\s\S]*source: .*test_device_branches.py"):
        fxinit.materialize(m)
    fxinit.materialize(m.head)  # a part that does not need it


class _NormedForAShape(nn.Module):
    def __init__(self, keep: bool) -> None:
        super().__init__()
        self.gn = nn.GroupNorm(2, 8)
        y = self.gn(torch.randn(2, 8, 3, 3).contiguous(memory_format=torch.channels_last))
        if keep:
            self.register_buffer("out", y.detach().clone())
        self.head = nn.Linear(y.shape[1], 2)


def test_a_channels_last_group_norm_make_fx_cannot_trace_is_marked(monkeypatch) -> None:
    """Where make_fx cannot trace it (the second review: that fallback was silent for group
    norm, which had no mark), a kept value is refused by name; a forward for a shape is not."""
    import fxinit.capture.branches as branches

    def untraceable(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("no make_fx here")

    monkeypatch.setattr(branches, "make_fx", untraceable)
    fxinit.materialize(fxinit.trace_init(_NormedForAShape, False))
    with pytest.raises(fxinit.DeferredInitError, match="aten::group_norm keeps a channels-last input"):
        fxinit.materialize(fxinit.trace_init(_NormedForAShape, True))
