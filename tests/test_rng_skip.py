"""Skipping random draws without drawing them: the CPU generator state arithmetic and the
per-op draw counts must agree with what the installed torch really does."""

from __future__ import annotations

import contextlib
import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn

import fxinit
from fxinit.capture.deferred import state_of
from fxinit.rng import mt19937, native
from fxinit.rng.draws import cpu_draws
from tests.conftest import compare_modules

aten = torch.ops.aten


def _gen(seed: int, pre: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed(seed)
    if pre:
        torch.empty(pre).uniform_(generator=g)  # `pre` words
    return g


def _same_future(a: torch.Generator, b: torch.Generator) -> bool:
    return torch.equal(torch.rand(700, generator=a), torch.rand(700, generator=b)) and torch.equal(
        torch.randn(3, dtype=torch.float64, generator=a), torch.randn(3, dtype=torch.float64, generator=b))


@pytest.fixture(params=["native", "numpy"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch):
    if request.param == "numpy":
        monkeypatch.setenv("FXINIT_NO_NATIVE", "1")
    native.library.cache_clear()
    yield request.param
    native.library.cache_clear()


def test_native_kernel_builds_here() -> None:
    assert native.library() is not None  # CI has gcc: the fast path must not silently fall back


@pytest.mark.parametrize("pre", [0, 1, 623, 624, 625, 1000])
@pytest.mark.parametrize("n", [0, 1, 5, 623, 624, 625, 1248, 1249, 5000, 100_003])
def test_advance_equals_drawing(backend: str, pre: int, n: int) -> None:
    drawn, skipped = _gen(n, pre), torch.Generator()
    start = drawn.get_state()
    if n:
        torch.empty(n).uniform_(generator=drawn)  # one word each
    skipped.set_state(mt19937.advance(start, n))
    assert mt19937.distance(start, drawn.get_state(), max_twists=200) == n
    assert _same_future(drawn, skipped)


def test_advance_keeps_the_cached_normal_samples() -> None:
    g = torch.Generator()
    g.manual_seed(3)
    torch.randn(1, dtype=torch.float64, generator=g)  # leaves a cached second sample
    state = g.get_state()
    skipped = torch.Generator()
    skipped.set_state(mt19937.advance(state, 10_000))
    torch.empty(10_000).uniform_(generator=g)
    assert _same_future(g, skipped)


def test_distance_refuses_what_is_not_a_pure_advance() -> None:
    g = torch.Generator()
    g.manual_seed(0)
    before = g.get_state()
    torch.randn(1, dtype=torch.float64, generator=g)  # changes the cached sample
    assert mt19937.distance(before, g.get_state()) is None
    g.manual_seed(1)
    assert mt19937.distance(before, g.get_state()) is None


_nothing = contextlib.nullcontext

_INPLACE = [
    (aten.uniform_.default, (-0.5, 0.5)),
    (aten.normal_.default, (0.0, 0.02)),
    (aten.bernoulli_.float, (0.3,)),
    (aten.exponential_.default, (1.5,)),
    (aten.random_.default, ()),
    (aten.random_.to, (1000,)),
    (getattr(aten.random_, "from"), (-5, 2**40)),
    (aten.cauchy_.default, ()),
    (aten.geometric_.default, (0.3,)),
    (aten.log_normal_.default, ()),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
@pytest.mark.parametrize("op,extra", _INPLACE, ids=lambda x: str(x))
def test_inplace_draw_counts_match_torch(op, extra, dtype: torch.dtype) -> None:
    for n in (64, 100, 1024, 4099, 65_541):
        target = torch.empty(n, dtype=dtype, device="meta")
        draws = cpu_draws(op, (target, *extra), {}, target)
        if draws is None:  # the caller then draws for real; only for samplers that cache values
            with pytest.raises(RuntimeError) if op is not aten.log_normal_.default else _nothing():
                op(torch.empty(n, dtype=dtype), *extra)  # ... or calls eager rejects too
            continue
        real, skipped = _gen(n, 17), torch.Generator()
        skipped.set_state(mt19937.advance(real.get_state(), draws))
        op(torch.empty(n, dtype=dtype), *extra, generator=real)
        assert _same_future(real, skipped), (op, dtype, n, draws)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("op,args", [
    (aten.rand.default, ([9, 13],)), (aten.randn.default, ([9, 13],)),
    (aten.randint.low, (0, 10, [9, 13])), (aten.randperm.default, (117,)),
], ids=lambda x: str(x))
def test_factory_draw_counts_match_torch(op, args, dtype: torch.dtype) -> None:
    kwargs = {"device": torch.device("cpu")}
    if op in (aten.rand.default, aten.randn.default):
        kwargs["dtype"] = dtype
    out = op(*args, **{**kwargs, "device": "meta"})
    draws = cpu_draws(op, args, kwargs, out)
    assert draws is not None
    torch.manual_seed(5)
    start = torch.get_rng_state()
    op(*args, **kwargs)
    skipped = torch.Generator()
    skipped.set_state(mt19937.advance(start, draws))
    assert _same_future(torch.default_generator, skipped)


def test_small_or_strided_tensors_are_drawn_for_real() -> None:
    small = torch.empty(10, device="meta")
    assert cpu_draws(aten.normal_.default, (small, 0.0, 1.0), {}, small) is None
    strided = torch.empty(64, 64, device="meta").t()
    assert cpu_draws(aten.normal_.default, (strided, 0.0, 1.0), {}, strided) is None


class Big(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(512, 1024)  # kaiming_uniform_ + uniform_ bias
        self.b = nn.Embedding(3000, 64)  # normal_
        self.c = nn.Parameter(torch.empty(10))  # small: drawn for real
        nn.init.normal_(self.c)


def test_trace_skips_large_draws_and_leaves_the_rng_where_eager_does() -> None:
    torch.manual_seed(0)
    eager = Big()
    after_eager = torch.get_rng_state()
    torch.manual_seed(0)
    m = fxinit.trace_init(Big)
    assert torch.equal(torch.get_rng_state(), after_eager)
    rec = state_of(m.a.weight).recorder
    assert rec.generators.random_ops == {"skipped": 3, "drawn": 1}
    fxinit.materialize(m)
    for name, t in eager.state_dict().items():
        assert torch.equal(t, m.state_dict()[name]), name


@pytest.mark.parametrize("quantum", [1, 7, 1024])
@pytest.mark.parametrize("n", [624 * 5 + 3, 10_000_019, 50_000_000])
def test_polynomial_jump_equals_twisting(monkeypatch: pytest.MonkeyPatch, n: int, quantum: int) -> None:
    start = _gen(1, 300).get_state()
    monkeypatch.setattr(mt19937, "JUMP_MIN_TWISTS", 1 << 62)
    twisted = torch.Generator()
    twisted.set_state(mt19937.advance(start, n))
    monkeypatch.setattr(mt19937, "JUMP_MIN_TWISTS", 1)
    monkeypatch.setattr(mt19937, "JUMP_QUANTUM", quantum)
    jumped = torch.Generator()
    jumped.set_state(mt19937.advance(start, n))
    assert _same_future(twisted, jumped)


def test_written_characteristic_polynomial_is_the_one_berlekamp_massey_finds() -> None:
    lib = native.library()
    if lib is None:
        pytest.fail("the native kernels did not build; jumps need them")
    assert lib.fxinit_mt_charpoly_matches() == 1


@pytest.mark.parametrize("read", ["get_state", "clone_state", "deepcopy"])
def test_a_state_read_from_the_generator_itself_in_a_constructor_is_eagers(read: str) -> None:
    """``torch.default_generator.get_state()`` (or ``clone_state()``, ``copy.deepcopy``)
    right after a large draw, which the capture skips lazily: the copy held fxinit's placeholder,
    and used after the trace (a draw from the clone, the state put back) it drew other numbers
    than eager's, silently (an RNG hunt found it). The generator type's reads now set the true
    state first, during the capture only."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("big", torch.randn(1000))  # skipped lazily
            gen = torch.default_generator
            if read == "get_state":
                self.saved = gen.get_state()
            elif read == "clone_state":
                self.saved = gen.clone_state()
            else:
                self.saved = copy.deepcopy(gen)
            self.lin = nn.Linear(4, 4)

    def after(m: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        if isinstance(m.saved, torch.Tensor):
            torch.default_generator.set_state(m.saved)
            return torch.randn(5), torch.get_rng_state()
        return torch.randn(5, generator=m.saved), torch.get_rng_state()

    torch.manual_seed(0)
    eager = after(M())
    torch.manual_seed(0)
    traced = fxinit.trace_init(M)
    got = after(traced)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])
    assert type(torch._C.Generator.__dict__["get_state"]).__name__ == "method_descriptor"  # torch's own again
    fxinit.materialize(traced)
    torch.manual_seed(0)
    assert torch.equal(traced.big, M().big)


@pytest.mark.parametrize("how", ["pickle the generator", "torch.load a state", "set_state of a loaded state"])
def test_a_state_unpickled_or_loaded_in_a_constructor_is_taken_by_the_generator(how: str) -> None:
    """A state tensor that a constructor unpickles or ``torch.load``-s is a deferred constant
    there (``capture.real.set_from_storage``): torch's ``Generator.__setstate__`` and
    ``set_state`` took it for a wrong type, a crash where eager works (``SystemError`` from
    unpickling a generator; ``TypeError`` from ``torch.set_rng_state``)."""
    saved = io.BytesIO()
    torch.manual_seed(5)
    torch.save(torch.get_rng_state(), saved)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("big", torch.randn(1000))  # skipped lazily
            if how == "pickle the generator":
                gen = pickle.loads(pickle.dumps(torch.default_generator))
            else:
                state = torch.load(io.BytesIO(saved.getvalue()))
                gen = torch.Generator()
                if how == "torch.load a state":
                    torch.set_rng_state(state)
                else:
                    gen.set_state(state)
            self.drawn = nn.Parameter(torch.randn(3, generator=gen))
            self.lin = nn.Linear(4, 4)

    torch.manual_seed(0)
    eager = M()
    after = torch.get_rng_state()
    torch.manual_seed(0)
    traced = fxinit.trace_init(M)
    assert torch.equal(torch.get_rng_state(), after)
    fxinit.materialize(traced)
    assert compare_modules(traced, eager) == []
