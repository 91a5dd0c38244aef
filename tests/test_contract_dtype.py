"""``materialize(m, dtype=)`` is eager construction followed by ``m.to(dtype)``: the module's own
``to`` and ``_apply``, real tensors, parts materialized before, each against eager bit for bit."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxinit
from test_contract import _assert_equal


def test_dtype_casts_the_real_tensors_too(tmp_path: Any) -> None:
    """``materialize(dtype=)`` is eager + ``Module.to(dtype)`` for real tensors kept as they
    were (legacy ``torch.Tensor([...])`` data, ``torch.load``), as for deferred ones."""
    torch.save(torch.randn(3), tmp_path / "w.pt")

    class Mixed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.inited = nn.Buffer(torch.Tensor([True]))
            self.loaded = nn.Parameter(torch.load(tmp_path / "w.pt"))
            self.register_buffer("steps", torch.tensor(3))

    torch.manual_seed(0)
    eager = Mixed().to(torch.bfloat16)
    torch.manual_seed(0)
    traced = fxinit.trace_init(Mixed)
    fxinit.materialize(traced, dtype=torch.bfloat16)
    _assert_equal(eager, traced)


class _BandsInFloat32(nn.Module):
    """timm's rotary embeddings: ``_apply`` rebuilds ``bands`` in float32 after a downcast."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("bands", 1.0 / 10000 ** (torch.arange(8).float() / 8), persistent=False)
        self.proj = nn.Linear(4, 4)

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        module = super()._apply(fn, *args, **kwargs)
        if self.bands.dtype != torch.float32:
            self.register_buffer("bands", 1.0 / 10000 ** (torch.arange(8).float() / 8), persistent=False)
        return module


class _DtypeInStep(nn.Module):
    """timm's tasks: ``_apply`` keeps a ``dtype`` attribute in step with the module's tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.dtype = torch.float32
        self.lin = nn.Linear(3, 3)
        self.rope = _BandsInFloat32()

    def _apply(self, fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        self.dtype = fn(torch.empty(0, dtype=self.dtype)).dtype
        return super()._apply(fn, *args, **kwargs)


def test_dtype_runs_a_modules_own_apply_as_to_does() -> None:
    """Found by a sweep of open_clip (EVA02's and PE-Core's timm rotary embeddings): eager's
    ``.to(dtype)`` runs a module's own ``_apply``, and fxinit's cast bypassed it (``bands``
    bfloat16 where eager keeps float32; a ``dtype`` attribute left behind). Such a module is
    cast by its own code; torch's RNNs, FSDP2's and torchtitan's modules, whose overrides
    change no value, keep fxinit's cast (never the float32 model whole)."""
    from fxinit.module_to import casting_themselves

    class Outer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.head = nn.Linear(3, 3)
            self.rnn = nn.LSTM(3, 3)
            self.inner = _DtypeInStep()

    torch.manual_seed(0)
    eager = Outer().to(torch.bfloat16)
    torch.manual_seed(0)
    traced = fxinit.trace_init(Outer)
    assert casting_themselves(traced) == [traced.inner]
    fxinit.materialize(traced, dtype=torch.bfloat16)
    _assert_equal(eager, traced)
    assert traced.inner.rope.bands.dtype == torch.float32 and traced.inner.dtype == torch.bfloat16
    assert eager.inner.dtype == torch.bfloat16


class _DtypeTracking(nn.Module):
    """Lightning's ``DeviceDtypeModuleMixin``: a ``to`` of its own notes the dtype, and
    ``forward`` builds tensors of it (pytorch-forecasting's TFT)."""

    def __init__(self) -> None:
        super().__init__()
        self._dtype = torch.get_default_dtype()
        self.lin = nn.Linear(4, 4)

    def to(self, *args: Any, **kwargs: Any) -> nn.Module:
        _, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            self._dtype = dtype
        return super().to(*args, **kwargs)


def test_dtype_runs_the_models_own_to_as_to_does() -> None:
    """Found by a sweep of neuralforecast and pytorch-forecasting: ``materialize(m, dtype=)`` cast
    the tensors, but ``m``'s own ``to`` (Lightning's) never ran, so ``m._dtype`` stayed float32."""
    torch.manual_seed(0)
    eager = _DtypeTracking().to(torch.bfloat16)
    torch.manual_seed(0)
    traced = fxinit.materialize(fxinit.trace_init(_DtypeTracking), dtype=torch.bfloat16)
    _assert_equal(eager, traced)
    assert traced._dtype == eager._dtype == torch.bfloat16


class _ReadsInItsTo(nn.Module):
    """A ``to`` of its own that reads a weight before casting (into an integer buffer, which
    ``.to(dtype)`` leaves as it is)."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("steps", torch.zeros(4, dtype=torch.int64))

    def to(self, *args: Any, **kwargs: Any) -> nn.Module:
        with torch.no_grad():
            self.steps.copy_((self.lin.weight[0] * 1000).to(torch.int64))
        return super().to(*args, **kwargs)


def test_dtype_runs_a_to_that_reads_tensors_on_eagers_values() -> None:
    """Found by the review: the model's own ``to`` ran after fxinit's cast, reading bfloat16
    weights where eager's reads float32 ones."""
    torch.manual_seed(0)
    eager = _ReadsInItsTo().to(torch.bfloat16)
    torch.manual_seed(0)
    _assert_equal(eager, fxinit.materialize(fxinit.trace_init(_ReadsInItsTo), dtype=torch.bfloat16))


def test_dtype_casts_what_was_materialized_before_too() -> None:
    """``materialize(m, dtype=)`` is eager construction + ``m.to(dtype)`` also for the parts
    of ``m`` that are real already: a part materialized before, or a module materialized from
    another trace and handed to the constructor (they kept their float32: fxinit's mark of
    what it had materialized outlived the call that made them). A real buffer under two names
    gets a cast tensor in each slot, as ``Module.to`` gives."""
    class Wrapper(nn.Module):
        def __init__(self, backbone: nn.Module) -> None:
            super().__init__()
            self.backbone = backbone
            self.head = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 2))
            self.register_buffer("scale", torch.ones(2))
            self.register_buffer("scale_again", self.scale)

    torch.manual_seed(0)
    eager = Wrapper(nn.Linear(3, 3)).to(torch.bfloat16)
    torch.manual_seed(0)
    backbone = fxinit.materialize(fxinit.trace_init(nn.Linear, 3, 3))
    traced = fxinit.trace_init(Wrapper, backbone)
    fxinit.materialize(traced.head[0])
    fxinit.materialize(traced.scale)
    fxinit.materialize(traced, dtype=torch.bfloat16)
    _assert_equal(eager, traced)
    assert traced.backbone.weight.dtype == traced.head[0].weight.dtype == torch.bfloat16
    assert traced.scale is not traced.scale_again and traced.scale.dtype == torch.bfloat16 == eager.scale_again.dtype
    fxinit.materialize(traced, dtype=torch.float64)  # all real: as .to(float64) again
    _assert_equal(eager.to(torch.float64), traced)


class _WrappedTo(nn.Module):
    """A ``to`` of its own wrapped as ``Module.to`` (``functools.wraps``, as transformers' is),
    which keeps a parameter in float32."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        self.lin = nn.Linear(3, 3)

    @functools.wraps(nn.Module.to)
    def to(self, *args: Any, **kwargs: Any) -> nn.Module:
        out = super().to(*args, **kwargs)
        self.w.data = self.w.data.float()
        return out


def test_dtype_runs_a_to_wrapped_as_modules_own() -> None:
    """Found by the review: the model's own ``to`` was told from ``Module.to`` by its name, which
    ``functools.wraps`` copies, so it never ran (``w`` cast where eager keeps it float32)."""
    torch.manual_seed(0)
    eager = _WrappedTo().to(torch.float64)
    torch.manual_seed(0)
    traced = fxinit.materialize(fxinit.trace_init(_WrappedTo), dtype=torch.float64)
    _assert_equal(eager, traced)
    assert traced.w.dtype == torch.float32 and traced.lin.weight.dtype == torch.float64


def test_dtype_of_a_part_leaves_a_pruned_layer_elsewhere_as_it_is() -> None:
    """Found by a review: a pruned layer elsewhere in the model goes with any materialize call
    (its ``weight``'s ``grad_fn`` holds its parameter and mask), and ``dtype=`` of the part asked
    for cast it too: float64 beside eager's float32, then a crash in its forward."""
    import torch.nn.utils.prune as prune

    def build() -> nn.Module:
        m = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
        prune.l1_unstructured(m[0], "weight", 0.5)
        return m

    torch.manual_seed(0)
    eager = build()
    eager[1].to(torch.float64)
    torch.manual_seed(0)
    traced = fxinit.trace_init(build)
    fxinit.materialize(traced[1], dtype=torch.float64)
    fxinit.materialize(traced)
    _assert_equal(eager, traced)
    assert traced[0].weight_orig.dtype == torch.float32 and traced[1].weight.dtype == torch.float64


class _TwoFromOneParameter(nn.Module):
    """A buffer and a plain attribute computed from one parameter; a buffer object also held by
    a submodule and a plain attribute; an ``nn.Buffer``."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.register_buffer("b", self.w * 3)
        self.e = self.w.exp()
        f = torch.arange(4.0)
        self.register_buffer("a", f)
        self.c = nn.Module()
        self.c.register_buffer("x", f)
        self.c.kept = f
        self.inv = nn.Buffer(torch.linspace(0, 1, 4))


def _backward(m: nn.Module) -> tuple[torch.Tensor, list[torch.dtype]]:
    calls: list[torch.dtype] = []
    m.w.register_hook(lambda g: calls.append(g.dtype))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(5)).to(m.w.dtype)
    ((x @ m.w).float().sum() + (m.b.float() * torch.arange(4.0)).sum() + m.e.float().sum()).backward()
    return m.w.grad, calls


def test_dtype_keeps_one_accumulator_per_parameter_and_casts_as_to_does() -> None:
    """Found by a hunt on ``materialize(dtype=)``: each kept tensor's replay gave the parameter its
    own (cast) data back, so the next one started another ``AccumulateGrad``: a backward added the
    gradients in another order (one bf16 element differed) and a hook on the parameter ran twice.
    A buffer object also held outside the module given was cast there too (eager's ``m.c.to``
    replaces ``c``'s slot only), and a cast ``nn.Buffer`` kept its mark."""
    torch.manual_seed(0)
    eager = _TwoFromOneParameter().to(torch.bfloat16)
    torch.manual_seed(0)
    traced = fxinit.trace_init(_TwoFromOneParameter)
    fxinit.materialize(traced, dtype=torch.bfloat16)
    _assert_equal(eager, traced)
    assert type(traced.e.grad_fn) is type(eager.e.grad_fn) and type(traced.b.grad_fn) is type(eager.b.grad_fn)
    assert isinstance(traced.inv, nn.Buffer) == isinstance(eager.inv, nn.Buffer) is False
    (got, got_calls), (want, want_calls) = _backward(traced), _backward(eager)
    assert torch.equal(got, want) and got_calls == want_calls, (got_calls, want_calls)

    torch.manual_seed(0)
    eager = _TwoFromOneParameter()
    eager.c.to(torch.bfloat16)
    torch.manual_seed(0)
    traced = fxinit.trace_init(_TwoFromOneParameter)
    fxinit.materialize(traced.c, dtype=torch.bfloat16)
    fxinit.materialize(traced)
    _assert_equal(eager, traced)
    assert (traced.a.dtype, traced.c.kept is traced.a, traced.c.x is traced.a) == (torch.float32, True, False)


def test_dtype_casts_a_buffer_materialized_before_with_autograd() -> None:
    """A buffer computed from a parameter, materialized before ``materialize(m, dtype=)``: cast
    under ``no_grad``, it lost ``requires_grad`` and its ``ToCopyBackward0``, and a backward
    through it raised where eager's reaches the parameter (``Module._apply`` casts buffers with
    autograd on, parameters without)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("b", self.lin.weight * 3)

    torch.manual_seed(0)
    eager = M().to(torch.bfloat16)
    torch.manual_seed(0)
    traced = fxinit.trace_init(M)
    fxinit.materialize(traced.lin)
    fxinit.materialize(traced, dtype=torch.bfloat16)
    _assert_equal(eager, traced)
    assert type(traced.b.grad_fn).__name__ == type(eager.b.grad_fn).__name__ == "ToCopyBackward0"
    for m in (traced, eager):
        m.b.float().sum().backward()
    assert torch.equal(traced.lin.weight.grad, eager.lin.weight.grad)


@pytest.mark.parametrize("flag", ["set_overwrite_module_params_on_conversion", "set_swap_module_params_on_conversion"])
def test_dtype_under_torchs_future_conversion_flags(flag: str) -> None:
    """With ``torch.__future__``'s flags eager's ``.to`` puts new parameter objects in the model
    (untying ``lm_head`` from the embedding) or swaps them: fxinit cast the objects in place."""
    def build() -> nn.Module:
        m = nn.Sequential(nn.Embedding(5, 4), nn.Linear(4, 5, bias=False))
        m[1].weight = m[0].weight
        return m

    getattr(torch.__future__, flag)(True)
    try:
        torch.manual_seed(0)
        eager = build()
        before = eager[0].weight
        eager.to(torch.bfloat16)
        torch.manual_seed(0)
        traced = fxinit.trace_init(build)
        held = traced[0].weight
        fxinit.materialize(traced, dtype=torch.bfloat16)
    finally:
        getattr(torch.__future__, flag)(False)
    _assert_equal(eager, traced)
    assert (traced[0].weight is traced[1].weight) == (eager[0].weight is eager[1].weight)
    assert (traced[0].weight is held) == (eager[0].weight is before)


def test_an_integer_dtype_is_refused_as_module_to_refuses_it() -> None:
    with pytest.raises(TypeError) as eager:
        nn.Linear(2, 2).to(torch.int32)
    with pytest.raises(TypeError, match="floating-point or complex"):
        fxinit.materialize(fxinit.trace_init(nn.Linear, 2, 2), dtype=torch.int32)
    assert "floating point or complex" in str(eager.value)
