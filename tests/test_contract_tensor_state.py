"""What a constructor sets on tensors besides their values, against eager: gradients from a
``backward()`` in ``__init__``, ``retain_grad`` and hooks on kept tensors, shared memory,
tensor subclasses made by ``as_subclass`` / ``_make_subclass``, and the device torch's
foreach paths group deferred tensors by (``clip_grad_norm_``)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype

import fxinit
from fxinit.capture import foreach_groups
from conftest import same_bits
from test_contract_sharing import _both_unwarned


def _both(cls: type[nn.Module]) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    eager = cls()
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing here is lost, so nothing is warned
        deferred = fxinit.materialize(fxinit.trace_init(cls))
    return eager, deferred


def _same_state(a: nn.Module, b: nn.Module) -> None:
    sa, sb = a.state_dict(keep_vars=True), b.state_dict(keep_vars=True)
    assert sa.keys() == sb.keys()
    for k in sa:
        assert type(sa[k]) is type(sb[k]) and torch.equal(sa[k], sb[k]), k


@pytest.mark.parametrize("foreach", [None, False, True])
def test_clip_grad_norm_in_init_clips_as_eager(foreach: bool | None) -> None:
    """torch groups tensors by device in C++, where a deferred tensor is meta: the clip
    coefficient was built on meta (no value) and the in-place ``mul_`` took it as nothing;
    ``foreach=True`` refused meta tensors."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))
            self.v = nn.Parameter(torch.randn(2, 3))
            (self.w * 10).sum().backward()
            (self.v * 3).sum().backward()
            nn.utils.clip_grad_norm_([self.w, self.v], 1.0, foreach=foreach)
            with torch.no_grad():
                self.w.sub_(self.w.grad)
                self.v.sub_(self.v.grad)

    eager, deferred = _both(M)
    _same_state(eager, deferred)
    assert torch.equal(eager.w.grad, deferred.w.grad) and torch.equal(eager.v.grad, deferred.v.grad)


def test_foreach_groups_name_the_intended_device_only_while_capturing() -> None:
    m = fxinit.trace_init(nn.Linear, 2, 2)
    with fxinit.recording(m):
        assert [d.type for d, _ in _group_tensors_by_device_and_dtype([[m.weight, m.bias]])] == ["cpu"]
    assert torch._C._group_tensors_by_device_and_dtype is foreach_groups._GROUP  # torch's own (torch.compile's rule)


def test_gradients_set_in_init_are_materialized_as_grad() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))
            (self.w * self.w).sum().backward()
            with torch.no_grad():
                self.w.sub_(0.1 * self.w.grad)
            self.b = nn.Parameter(torch.randn(4))
            self.b.grad = torch.zeros(4)  # a gradient buffer allocated up front

    eager, deferred = _both(M)
    _same_state(eager, deferred)
    for name in ("w", "b"):
        g, h = getattr(eager, name).grad, getattr(deferred, name).grad
        assert h is not None and not fxinit.is_deferred(h) and torch.equal(g, h), name


@pytest.mark.parametrize("kind", ["retain_grad", "hook"])
def test_a_kept_tensor_computed_from_a_parameter_keeps_retain_grad_and_hooks(kind: str) -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))
            self.k = self.w * 2
            if kind == "retain_grad":
                self.k.retain_grad()
                assert self.k.retains_grad
            else:
                self.k.register_hook(lambda g: g * 10)

    eager, deferred = _both(M)
    for m in (eager, deferred):
        m.k.sum().backward()
    assert torch.equal(eager.w.grad, deferred.w.grad)
    assert deferred.k.retains_grad == eager.k.retains_grad
    if kind == "retain_grad":
        assert torch.equal(eager.k.grad, deferred.k.grad)


def test_share_memory_in_init_and_before_materialize() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.lin.weight.share_memory_()
            assert self.lin.weight.is_shared()

    eager, deferred = _both(M)
    _same_state(eager, deferred)
    assert deferred.lin.weight.is_shared() and not deferred.lin.bias.is_shared()
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 3, 3)
    m.share_memory()  # Hogwild's step, before materialize
    fxinit.materialize(m)
    assert all(p.is_shared() for p in m.parameters())


class Tagged(torch.Tensor):
    pass


class Flagged(nn.Parameter):
    pass


def test_tensor_subclasses_made_in_init() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("b", torch.randn(3).as_subclass(Tagged))
            self.q = nn.Parameter(torch.randn(3).as_subclass(Tagged))  # a Tagged parameter, as in eager
            self.p = torch.Tensor._make_subclass(Flagged, torch.randn(3), True)  # bitsandbytes' Params4bit
            self.v = self.lin.weight.as_subclass(Tagged)  # an alias, attached to autograd
            assert isinstance(self.b, Tagged) and isinstance(self.p, Flagged)

    eager, deferred = _both(M)
    _same_state(eager, deferred)
    assert type(deferred.v) is Tagged and type(deferred.v.grad_fn) is type(eager.v.grad_fn)
    assert deferred.q._is_param and [n for n, _ in deferred.named_parameters()] == ["q", "p", "lin.weight", "lin.bias"]
    # fxinit's doors stay after the trace (a layer swap, a deep copy) and leave real tensors to torch
    real = torch.Tensor._make_subclass(Flagged, torch.ones(2), True)
    assert type(real) is Flagged and type(torch.ones(2).as_subclass(Tagged)) is Tagged and real.requires_grad


def test_a_meta_copy_of_a_parameter_kept_on_the_module_keeps_its_grad_fn() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.template = self.lin.weight.to("meta")  # a shape and dtype kept for later

    eager, deferred = _both(M)
    assert deferred.template.is_meta and type(deferred.template.grad_fn) is type(eager.template.grad_fn)
    assert fxinit.check(M).status == "equal"


class DataOfAnArgument(nn.Module):
    """A real parameter handed in, a buffer computed from it (its gradient graph reaches the
    parameter's ``AccumulateGrad``), then the parameter's ``.data`` set to a new tensor."""

    def __init__(self, p: nn.Parameter) -> None:
        super().__init__()
        self.register_buffer("picked", p[p > 0])
        p.data = torch.zeros(2, 2)


def test_data_of_a_real_argument_set_after_a_graph_reached_it_keeps_its_gradient() -> None:
    """Eager's ``.data =`` keeps the parameter's ``AccumulateGrad``; a swap of the Python object
    would have poisoned it (found by ``tools/fuzz_capture.py --small-thresholds --seed 13``)."""
    grads, values = [], []
    for trace in (False, True):
        torch.manual_seed(1234)
        p = nn.Parameter(torch.randn(2, 2))
        torch.manual_seed(0)
        m = fxinit.trace_init(DataOfAnArgument, p) if trace else DataOfAnArgument(p)
        if trace:
            fxinit.materialize(m)
        m.picked.sum().backward()
        grads.append(p.grad)
        values.append((m.picked.detach(), p.detach()))
    assert torch.equal(grads[0], grads[1])
    assert all(torch.equal(a, b) for a, b in zip(*values))


class KeptFromParameters(nn.Module):
    """Buffers computed with autograd from two parameters, one of them written under no_grad
    in between (``b2`` reads the written value)."""

    def __init__(self, data_in_init: bool = False) -> None:
        super().__init__()
        self.w0 = nn.Parameter(torch.randn(3))
        self.w1 = nn.Parameter(torch.randn(2))
        self.register_buffer("b1", self.w0 * 2 + self.w1.sum())
        with torch.no_grad():
            self.w0.mul_(2)
        self.register_buffer("b2", self.w0.exp())
        if data_in_init:
            self.w0.data = torch.ones(3)


@pytest.mark.parametrize("where", ["after_trace", "in_init", "in_init_and_after"])
@pytest.mark.parametrize("order", ["whole", "buffers_first"])
def test_data_set_to_a_real_tensor_keeps_the_gradients_of_tensors_computed_before(where: str, order: str) -> None:
    """``vector_to_parameters`` after the trace (or ``.data = real`` in ``__init__``) makes a
    deferred parameter real; the buffers computed from it before keep eager's ``grad_fn``, and
    a backward through them reaches the parameter the model holds (found by
    ``tools/fuzz_capture.py --small-thresholds --include-known-holes --seed 14``)."""
    results = []
    for trace in (False, True):
        torch.manual_seed(0)
        cls = KeptFromParameters
        m = fxinit.trace_init(cls, where != "after_trace") if trace else cls(where != "after_trace")
        if where != "in_init":
            nn.utils.vector_to_parameters(torch.linspace(-1, 1, 5), m.parameters())
        if trace:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # nothing is lost
                if order == "buffers_first":
                    fxinit.materialize(m.b2)
                    fxinit.materialize(m.b1)
                fxinit.materialize(m)
        assert all(type(b.grad_fn).__name__ in ("AddBackward0", "ExpBackward0") for b in m.buffers())
        (m.b1 * torch.tensor([1.0, 2.0, 3.0]) + m.b2 * torch.tensor([5.0, 7.0, 11.0])).sum().backward()
        results.append([t.detach().clone() for t in (*m.buffers(), *m.parameters())]
                       + [p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*results))


class DataOfAComputedBuffer(nn.Module):
    """A buffer computed with autograd from a real parameter handed in, then given the
    ``.data`` of a tensor made in the constructor (deferred)."""

    def __init__(self, p: nn.Parameter) -> None:
        super().__init__()
        self.register_buffer("b0", p.clone())
        self.b0.data = torch.zeros(())


def test_data_of_a_tensor_with_a_grad_fn_set_to_a_deferred_one_keeps_the_grad_fn() -> None:
    """Eager's ``.data =`` keeps ``b0``'s ``CloneBackward0``, which leads to ``p``; making ``b0``
    a deferred alias had made it a leaf (found by ``tools/fuzz_capture.py --small-thresholds
    --seed 17``)."""
    values = []
    for trace in (False, True):
        torch.manual_seed(1234)
        p = nn.Parameter(torch.randn(2, 2))
        m = fxinit.trace_init(DataOfAComputedBuffer, p) if trace else DataOfAComputedBuffer(p)
        if trace:
            fxinit.materialize(m)
        assert type(m.b0.grad_fn).__name__ == "CloneBackward0" and not m.b0.is_leaf
        assert m.b0.grad_fn.next_functions[0][0].variable is p
        values.append(m.b0.detach())
    assert torch.equal(*values)


class _WeightDropout(nn.Module):
    """fastai's AWD-LSTM ``WeightDropout``: the LSTM's weight becomes a clone of a raw parameter,
    which ``RNNBase.__setattr__`` also puts among its flat weights (held by weak references)."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(2, 2)
        w = self.lstm.weight_hh_l0
        self.register_parameter("weight_hh_l0_raw", nn.Parameter(w.data))
        del self.lstm._parameters["weight_hh_l0"]
        setattr(self.lstm, "weight_hh_l0", self.weight_hh_l0_raw.clone())


@pytest.mark.filterwarnings("error::UserWarning")
def test_an_rnns_flat_weight_computed_from_a_parameter_keeps_its_grad_fn() -> None:
    """Found by a sweep of fastai: the clone kept eager's value but lost its ``grad_fn`` with a
    warning (``swap_tensors`` refuses a tensor the RNN holds weak references to)."""
    eager, deferred = _both(_WeightDropout)
    got, want = deferred.lstm.weight_hh_l0, eager.lstm.weight_hh_l0
    assert torch.equal(got, want) and type(got.grad_fn).__name__ == type(want.grad_fn).__name__ == "CloneBackward0"
    assert deferred.lstm._flat_weights[1] is got
    # the weak reference is to the parameter the clone replaced, dead as in eager: the LSTM's next
    # forward reads its weights again (``_weights_have_changed``)
    assert deferred.lstm._flat_weight_refs[1]() is None and eager.lstm._flat_weight_refs[1]() is None
    got.sum().backward()
    assert torch.equal(deferred.weight_hh_l0_raw.grad, torch.ones(8, 2))


class _TimesADetachedValue(nn.Module):
    """botorch's ``PairwiseGP``: a kept tensor computed from a parameter and a detached value
    computed from it (``covar * outputscale.detach()``), and from a detached parameter."""

    def __init__(self) -> None:
        super().__init__()
        self.raw = nn.Parameter(torch.rand(3))
        self.covar = self.raw * self.raw.exp().detach()
        self.square = self.raw * self.raw.detach()


@pytest.mark.filterwarnings("error::UserWarning")
def test_a_kept_tensor_of_a_detached_value_keeps_its_grad_fn() -> None:
    """Found by a sweep of botorch: a detach of a tensor that requires grad was the same node as
    its input, so the rebuilt graph passed gradients where eager's stops, did not match eager's,
    and the tensor kept its value as a leaf, with a warning."""
    eager, deferred = _both(_TimesADetachedValue)
    for name in ("covar", "square"):
        got, want = getattr(deferred, name), getattr(eager, name)
        assert torch.equal(got, want) and type(got.grad_fn).__name__ == type(want.grad_fn).__name__ == "MulBackward0"
    deferred.covar.sum().backward()
    eager.covar.sum().backward()
    assert torch.equal(deferred.raw.grad, eager.raw.grad)


@pytest.mark.parametrize("where", ["before_a_write", "before_and_after_a_write", "on_a_temporary", "on_a_kept_one_read"])
def test_gradient_hooks_registered_where_eager_registers_them(where: str) -> None:
    """A hook on a tensor computed with autograd stays with the ``grad_fn`` the tensor had when
    it was registered: ``self.k.register_hook(h)``, then ``self.k.mul_(2)`` with autograd on,
    runs ``h`` on the gradient of ``k`` before the write (torch's rule), and a hook on a
    temporary ``k`` was computed from runs in ``k``'s backward. Both were lost: the replay
    carried only the hooks a kept tensor holds at the end (a review found it)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            tmp = torch.sigmoid(self.lin.bias)
            if where == "on_a_temporary":
                tmp.register_hook(lambda g: g * 10 + 1)
            if where == "on_a_kept_one_read":
                self.b0 = tmp
                self.b0.register_hook(lambda g: g * 10 + 1)
            self.k = tmp * 2
            if where.startswith("before"):
                self.k.register_hook(lambda g: g * 10 + 1)
            self.k.mul_(3)
            if where == "before_and_after_a_write":
                self.k.register_hook(lambda g: g * g)

    eager, deferred = _both(M)
    for m in (eager, deferred):
        loss = (m.k * torch.arange(3.0)).sum() + (m.b0.sum() if where == "on_a_kept_one_read" else 0)
        loss.backward()
    assert same_bits(deferred.lin.bias.grad, eager.lin.bias.grad), where


def test_a_hook_on_a_view_whose_function_eager_regenerated_does_not_run() -> None:
    """``b1 = bias.t()`` kept, a hook on it, then ``b1.copy_(...)`` under no_grad: eager regenerates
    ``b1``'s function, and the hook stays with the one before, which no backward reaches; the
    replay registered it on its ``TBackward0``, and the gradient doubled, silently (a review)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.b1 = self.lin.bias.t()
            self.b1.register_hook(lambda g: g * 2)
            with torch.no_grad():
                self.b1.copy_(torch.ones(3))

    eager, deferred = _both(M)
    grads = [torch.autograd.grad(m.b1.sum(), m.lin.bias)[0] for m in (eager, deferred)]
    assert same_bits(grads[1], grads[0])


def test_a_hook_that_runs_on_parts_of_a_gradient_is_said_aloud() -> None:
    """A temporary written in place with autograd on, a hook on it, two kept tensors read it: each
    is rebuilt with its own copy of the temporary's nodes, so the hook runs on each part of the
    gradient where eager's runs once on the sum: the same for a linear hook, another gradient for
    ``g / g.norm()``; materialize says so."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            t = self.lin.weight * 2
            t.mul_(2)
            t.register_hook(lambda g: g / g.norm())
            self.b = t + 1
            self.c = t.exp()

    torch.manual_seed(0)
    m = fxinit.trace_init(M)
    with pytest.warns(UserWarning, match="runs on each one's part of the gradient"):
        fxinit.materialize(m)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_hooks_and_retain_grad_of_a_kept_buffer_stay_before_a_dtype_cast(dtype: torch.dtype) -> None:
    """``materialize(dtype=)`` is eager's ``Module.to`` after construction, which gives a buffer another
    tensor (``ToCopyBackward0``): the hook registered in the constructor stays on the graph before
    the cast and sees a float32 gradient, and the new buffer retains no gradient. fxinit put the hook
    on the cast and kept ``retain_grad``, silently (a review)."""
    seen: list[torch.dtype] = []

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("b", self.lin.weight * 2)
            self.b.register_hook(lambda g: seen.append(g.dtype))
            self.register_buffer("r", self.lin.bias * 2)
            self.r.retain_grad()

    eager, traced = _both_unwarned(M, dtype)
    for m in (eager, traced):
        (m.b.float() * torch.linspace(0.1, 0.9, 9).view(3, 3)).sum().backward()
    assert seen == [torch.float32, torch.float32] and traced.r.retains_grad == eager.r.retains_grad
    assert same_bits(traced.lin.weight.grad, eager.lin.weight.grad)
