"""Random short programs of fills, views taken before and after them, in-place writes through
views, copies between tensors and kept derived tensors: materialized whole and leaf by leaf in
reverse, in float32 and with ``dtype=bfloat16``, against eager construction bit for bit.

This is where the storage analyses meet: batched fills must run before anything reaches their
storage (``passes.batched_fills``), casts must wait for the last write to a storage
(``passes.cast_fusion.cast_points``), and demand, forwarding and CSE must see writes through
views. Two reviews found a wrong value here each (a view taken before a batched fill; a
``split`` piece cast before its tensor's fill)."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
import torch.nn as nn

import fxinit
from tests.conftest import assert_same_as_eager, built_both, compare_modules, named_tensors

STEPS = ("normal", "uniform", "slice", "unbind", "split", "scale", "copy", "clone", "plus_one", "transpose",
         "refill", "zero")


def _program(seed: int) -> list[tuple[str, int, int, float]]:
    rng = random.Random(seed)
    return [(rng.choice(STEPS), rng.randrange(4), rng.randrange(4), rng.random()) for _ in range(rng.randint(3, 10))]


def _module(steps: list[tuple[str, int, int, float]]) -> type[nn.Module]:
    class Program(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            ws = [torch.empty(4, 16).normal_() for _ in range(4)]
            views: list[list[torch.Tensor]] = [[] for _ in range(4)]
            derived = []
            for step, i, j, x in steps:
                w = ws[i]
                last = views[i][-1] if views[i] else w
                if step == "normal":
                    w.normal_(0, 1 + x)
                elif step == "uniform":
                    w.uniform_(-x, 1)
                elif step == "slice":
                    views[i].append(w[1:3])
                elif step == "unbind":
                    views[i].append(w.unbind(0)[j])
                elif step == "split":
                    views[i].append(w.split(2)[j % 2])
                elif step == "scale":
                    last.mul_(1.5)
                elif step == "copy":
                    src = views[j][-1] if views[j] else ws[j]
                    if src.shape == last.shape:
                        last.copy_(src)
                elif step == "clone":
                    derived.append(last.clone())
                elif step == "plus_one":
                    derived.append(last + 1)
                elif step == "transpose":
                    derived.append(last.t())
                elif step == "refill":
                    ws[i], views[i] = torch.empty(4, 16).uniform_(), []
                elif views[i]:  # zero
                    views[i][-1].zero_()
            self.ws = nn.ParameterList(nn.Parameter(w) for w in ws)
            self.views = nn.ParameterList(nn.Parameter(v) for vs in views for v in vs)
            self.derived = nn.ParameterList(nn.Parameter(d) for d in derived)

    return Program


@pytest.mark.parametrize("dtype", [None, torch.bfloat16], ids=["float32", "bfloat16"])
def test_programs_of_views_and_fills_equal_eager(dtype: torch.dtype | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Whole, leaf by leaf in reverse, and with batched fills run as soon as each is queued."""
    from fxinit.backends import interpreter

    failures = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in range(150):
            program = _module(_program(seed))
            torch.manual_seed(seed)
            eager = program() if dtype is None else program().to(dtype)
            for order in ("whole", "reverse", "launch each"):
                torch.manual_seed(seed)
                m = fxinit.trace_init(program)
                mods = [m] if order != "reverse" else [mod for _, mod in reversed(list(m.named_modules()))]
                with monkeypatch.context() as patch:
                    if order == "launch each":
                        patch.setattr(interpreter, "LAUNCH_ELEMENTS", 1)
                    for mod in mods:
                        fxinit.materialize(mod, dtype=dtype)
                bad = compare_modules(m, eager)
                if bad:
                    failures.append(f"seed {seed} {order}: {_program(seed)}: {bad[:2]}")
    assert not failures, "\n".join(failures[:5])


def test_programs_of_views_and_fills_are_one_stream_in_portable_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """Portable mode has no eager to compare with: whole, leaf by leaf in reverse, without
    batched fills (one C call per fill), with batches run as soon as a fill is queued, and
    every fifth program batched through fxinit's Triton kernel (its table of fills, under
    Triton's interpreter) must all agree."""
    from fxinit.backends import interpreter
    from fxinit.passes import batched_fills

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    failures = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in range(100):
            program = _module(_program(seed))
            results = []
            ways = ["whole", "reverse", "unbatched", "launch each", *(["triton"] if seed % 5 == 0 else [])]
            for way in ways:
                torch.manual_seed(seed)
                m = fxinit.trace_init(program)
                mods = [m] if way != "reverse" else [mod for _, mod in reversed(list(m.named_modules()))]
                with monkeypatch.context() as patch:
                    if way == "unbatched":
                        patch.setattr(batched_fills.portable, "batchable", lambda *a: False)
                    if way == "launch each":
                        patch.setattr(interpreter, "LAUNCH_ELEMENTS", 1)
                    for mod in mods:
                        fxinit.materialize(mod, rng="portable", seed=seed, compile="triton" if way == "triton" else None)
                results.append(m)
            for way, other in zip(ways[1:], results[1:]):
                bad = compare_modules(other, results[0])
                if bad:
                    failures.append(f"seed {seed} {way}: {_program(seed)}: {bad[:2]}")
    assert not failures, "\n".join(failures[:5])


class LikeOfSizeOneDims(nn.Module):
    """``*_like`` of a tensor whose size-one dimensions have odd strides (``w.t()`` of a (1, 2)
    tensor is contiguous, strides (1, 2)): eager keeps those strides, torch's meta kernel
    recomputes them (found by tools/fuzz_capture.py: strides (1, 1) here, (1, 2) in eager)."""

    def __init__(self) -> None:
        super().__init__()
        x = nn.Parameter(torch.eye(1, 2)).t().contiguous()
        self.zeros = nn.Parameter(torch.zeros_like(x, device="cpu"))
        self.normal = nn.Parameter(torch.randn_like(x))
        self.filled = nn.Parameter(torch.empty_like(torch.ones(1, 3).t()).fill_(2))
        self.permuted = nn.Parameter(torch.full_like(torch.ones(4, 3).t(), 3.0))


def test_like_factories_keep_eagers_strides() -> None:
    assert_same_as_eager(LikeOfSizeOneDims)


def _resized_buffers() -> dict:
    def constant_grown_then_copied():  # torch.ao's observers: min_val = torch.tensor([]), resize_, copy_
        b = torch.tensor([])
        b.resize_(3)
        return b.copy_(torch.arange(3.0))

    def empty_grown_then_copied():
        return torch.empty(0).resize_(3).copy_(torch.arange(3.0))

    def shrunk_filled_regrown():
        b = torch.randn(4)
        b.resize_(2)
        b.fill_(0.0)
        return b.resize_(4)

    def zeros_grown_half_written():
        b = torch.zeros(2).resize_(4)
        b[2:].fill_(3.0)
        return b

    def grown_as_then_drawn():
        b = torch.randn(2)
        b.resize_as_(torch.empty(3, 2))
        return b.uniform_()

    return {f.__name__: f for f in (constant_grown_then_copied, empty_grown_then_copied, shrunk_filled_regrown,
                                    zeros_grown_half_written, grown_as_then_drawn)}


@pytest.mark.parametrize("make", list(_resized_buffers()))
def test_storages_resized_in_the_constructor_are_eagers(make: str) -> None:
    """``resize_`` changes the elements a storage holds (found by a hunt through torchvision's
    quantized models): a known value kept for a small constant no longer covers it, and the
    element analyses keep that storage's fills and copies whole (``roots.shared_roots``)."""
    fn = _resized_buffers()[make]

    class Resized(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("b", fn())

    assert fxinit.check(Resized).ok
    torch.manual_seed(0)
    eager = Resized()
    torch.manual_seed(0)
    m = fxinit.trace_init(Resized)
    fxinit.materialize(m.lin)
    fxinit.materialize(m)
    assert torch.equal(m.b, eager.b) and torch.equal(m.lin.weight, eager.lin.weight)


class AddsExpanded(nn.Module):
    """A real tensor whose elements share memory (``expand``) given to the constructor."""

    def __init__(self, bias: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 3))
        with torch.no_grad():
            self.w.add_(bias)
        self.register_buffer("e", bias * 2)


class ScatterByExpandedIndex(nn.Module):
    """PyG's ``scatter``/``softmax``: ``index.view(-1, 1).expand_as(src)``, in a lazy dry run."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.LazyLinear(2)

    def forward(self, x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        y = self.lin(x)
        return y.new_zeros(3, 2).scatter_reduce_(0, index.view(-1, 1).expand_as(y), y, reduce="amax",
                                                 include_self=False)


def test_real_tensors_whose_elements_share_memory() -> None:
    """A graph constant is copied with its strides; a stride of 0 made that copy write
    overlapping elements, which torch refuses: trace_init and dry_run crashed (found by a sweep
    of PyTorch Geometric, whose lazy convolutions scatter by an expanded index). The copy now
    keeps the memory the elements share."""
    bias = torch.arange(3.0).expand(4, 3)
    assert fxinit.check(AddsExpanded, bias).ok
    torch.manual_seed(0)
    m = fxinit.trace_init(AddsExpanded, bias)
    graph = fxinit.init_graph(m)
    torch.manual_seed(0)
    eager = AddsExpanded(bias)
    assert all(torch.equal(v, eager.state_dict()[k]) for k, v in graph.materialize().items())
    x, index = torch.randn(5, 4), torch.tensor([0, 1, 2, 0, 1])
    torch.manual_seed(0)
    eager = ScatterByExpandedIndex()
    want = eager(x, index)
    torch.manual_seed(0)
    m = fxinit.trace_init(ScatterByExpandedIndex)
    fxinit.dry_run(m, x, index)
    fxinit.materialize(m)
    assert torch.equal(m.lin.weight, eager.lin.weight) and torch.equal(m(x, index), want)


class _ComplexWeights(nn.Module):
    """Spectral layers (neuraloperator, torch-harmonics) keep complex parameters, and views of
    them that are lazy conjugates: their bits and their conj flag are eager's."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4, dtype=torch.cfloat) * 0.5)
        with torch.no_grad():
            torch.view_as_real(self.w)[..., 1].uniform_(-1, 1)
            self.w.imag[0].zero_()
        self.register_buffer("conj", self.w.detach().conj())
        self.register_buffer("spectrum", torch.fft.rfft(torch.randn(8)))


@pytest.mark.parametrize("post", [None, "cdouble"])
def test_complex_weights_and_conjugate_views(post: str | None) -> None:
    assert_same_as_eager(_ComplexWeights, post=None if post is None else lambda m: m.to(torch.cdouble))
    m = fxinit.trace_init(_ComplexWeights)
    fxinit.materialize(m)
    assert m.conj.is_conj() and m.conj.untyped_storage().data_ptr() == m.w.untyped_storage().data_ptr()


class _KeptViews(nn.Module):
    """Views a constructor keeps: of a buffer (a cache and its slice), of a temporary it drops
    (twice), of a detached alias, of ``.data``, made under ``no_grad`` (of a buffer and of a
    parameter), ``view_as_real``, ``view_as_complex``, a conjugate view, an output of ``unbind``
    and a view made under ``inference_mode``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("cache", torch.zeros(2, 4, 3))
        self.k = self.cache[0]
        tmp = torch.randn(8)
        self.t1, self.t2 = tmp[2:], tmp[:4]
        alias = self.lin.weight.detach()
        self.register_buffer("row", alias[1])
        self.col = self.lin.weight.data[:, 2]
        with torch.no_grad():
            self.head = self.cache[1, :2]
            self.register_buffer("w_view", self.lin.weight[0])
        self.register_buffer("z", torch.randn(4, dtype=torch.cfloat))
        self.z_real = torch.view_as_real(self.z)
        self.z_conj = self.z.conj()
        self.register_buffer("pairs", torch.randn(3, 4))
        self.as_complex = torch.view_as_complex(self.pairs.view(3, 2, 2))
        self.unbound = self.pairs.unbind(0)[2]
        with torch.inference_mode():
            self.in_inference = self.pairs[0, 1:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.k[1] = self.lin(x)
        return self.cache.sum()


def test_kept_views_are_views_of_eagers_bases_after_materialize() -> None:
    """Materialize swapped each kept view in as a tensor of its own on the right memory: the
    first write with autograd to ``k`` (a cache filled in forward) stayed on ``k``, and a backward
    through ``cache`` reached nothing (or lost the gradient, silently). Each view is a view of
    the tensor eager's is a view of again, made in the same grad mode (``kept_views``)."""
    for order in ("whole", "reverse"):
        torch.manual_seed(0)
        eager = _KeptViews()
        torch.manual_seed(0)
        m = fxinit.trace_init(_KeptViews)
        if order == "whole":
            fxinit.materialize(m)
        else:
            for _, _, t in reversed(named_tensors(m)):
                fxinit.materialize(t)
        assert compare_modules(m, eager) == []  # (views and the names of their bases included)
        for name in ("k", "t1", "t2", "row", "col", "head", "w_view", "z_real", "z_conj", "as_complex", "unbound",
                     "in_inference"):
            got, want = getattr(m, name), getattr(eager, name)
            assert got._is_view() and want._is_view(), name
            assert torch._C._autograd._get_creation_meta(got) == torch._C._autograd._get_creation_meta(want), name
            assert (got.requires_grad, got.is_leaf) == (want.requires_grad, want.is_leaf), name
        assert m.t1._base is m.t2._base and m.row._base is not m.lin.weight and m.w_view._base is m.lin.weight
        x = torch.ones(3)
        m(x).backward()
        eager(x).backward()
        assert torch.equal(m.lin.weight.grad, eager.lin.weight.grad)
        for mod in (m, eager):  # a write through ``.data``'s view leaves the parameter's version alone
            before = mod.lin.weight._version
            mod.col.add_(0)
            assert mod.lin.weight._version == before
        with pytest.raises(RuntimeError, match="no_grad mode"):  # as eager's refuses
            m.head.mul_(m.lin.weight[0, :3].sum())


def test_kept_views_after_requires_grad_and_a_checkpoint() -> None:
    """Found by a second hunt: ``requires_grad_()`` on a kept view or on its base between trace
    and materialize left the view a tensor of its own (a backward filled its ``.grad`` where eager's
    view is a leaf view); and a buffer that is the only kept view of a dropped temporary lost its
    storage offset when loaded (``materialize(state_dict=...)``, eager's ``load_state_dict``)."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("cache", torch.zeros(2, 4))
            self.k = self.cache[0]
            self.register_buffer("t", torch.randn(4)[1:])

    for step in (lambda m: m.k.requires_grad_(), lambda m: m.cache.requires_grad_()):
        eager, m = built_both(M, step)
        assert compare_modules(m, eager) == []
        assert (m.k._is_view(), m.k._base is m.cache, m.k.is_leaf) == (True, True, True)
    state = {"cache": torch.ones(2, 4), "t": torch.arange(3.0)}
    eager = M()
    eager.load_state_dict(state)
    m = fxinit.trace_init(M)
    fxinit.materialize(m, state_dict=state)
    assert compare_modules(m, eager) == []
    assert (m.t.storage_offset(), m.t.untyped_storage().nbytes()) == (1, 16)
