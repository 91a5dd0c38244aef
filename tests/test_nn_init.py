"""Every function of ``torch.nn.init``, called inside a constructor and called on a deferred
parameter after ``trace_init`` (the re-init pattern), with and without an explicit generator,
against eager construction (+ the same call) bit for bit."""

from __future__ import annotations

import inspect
import math
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.init as init

import fxinit
from conftest import assert_bits, assert_same_as_eager, rng_state

# (case id, init function, shape, dtype, kwargs). Shapes are small; every random function is
# also used on a shape whose numel is >= 16 and not a multiple of 16 (normal_'s vectorized
# path with a tail) and most on one < 16 (the scalar path with a cached second sample).
CASES: list[tuple[str, callable, tuple, torch.dtype, dict]] = [
    ("uniform_", init.uniform_, (5, 7), torch.float32, {"a": -0.5, "b": 2.0}),
    ("uniform_-f64", init.uniform_, (5, 7), torch.float64, {}),
    ("uniform_-bf16", init.uniform_, (3, 5), torch.bfloat16, {"a": -1.0, "b": 1.0}),
    ("normal_-vectorized_tail", init.normal_, (5, 7), torch.float32, {"mean": 1.0, "std": 0.02}),
    ("normal_-scalar", init.normal_, (5,), torch.float32, {}),
    ("normal_-f64", init.normal_, (4, 5), torch.float64, {"std": 3.0}),
    ("normal_-f16", init.normal_, (3, 7), torch.float16, {}),
    ("trunc_normal_-small_std", init.trunc_normal_, (6, 7), torch.float32, {"std": 0.02}),
    ("trunc_normal_-rejection_loop", init.trunc_normal_, (8, 9), torch.float32, {"std": 1.0, "a": -1.0, "b": 1.0}),
    ("trunc_normal_-bounds_near_mean", init.trunc_normal_, (6, 7), torch.float32, {"std": 1.0, "a": -0.2, "b": 0.2}),
    ("trunc_normal_-tail", init.trunc_normal_, (4, 5), torch.float32, {"mean": 0.0, "std": 1.0, "a": 1.5, "b": 3.0}),
    ("trunc_normal_-bf16", init.trunc_normal_, (6, 7), torch.bfloat16, {"std": 0.5, "a": -0.7, "b": 0.7}),
    ("constant_", init.constant_, (3, 4), torch.float32, {"val": 0.25}),
    ("ones_", init.ones_, (3, 4), torch.float32, {}),
    ("zeros_", init.zeros_, (3, 4), torch.bfloat16, {}),
    ("eye_", init.eye_, (3, 5), torch.float32, {}),
    ("dirac_", init.dirac_, (4, 2, 3), torch.float32, {}),
    ("dirac_-groups", init.dirac_, (6, 2, 3, 3), torch.float32, {"groups": 3}),
    ("xavier_uniform_", init.xavier_uniform_, (5, 7), torch.float32, {"gain": 2.0}),
    ("xavier_normal_", init.xavier_normal_, (4, 3, 3), torch.float32, {"gain": init.calculate_gain("tanh")}),
    ("kaiming_uniform_", init.kaiming_uniform_, (5, 7), torch.float32, {"a": math.sqrt(5)}),
    ("kaiming_uniform_-fan_out_relu", init.kaiming_uniform_, (4, 2, 3), torch.float32,
     {"mode": "fan_out", "nonlinearity": "relu"}),
    ("kaiming_normal_", init.kaiming_normal_, (5, 7), torch.float32, {}),
    ("kaiming_normal_-fan_out_leaky", init.kaiming_normal_, (4, 2, 3), torch.float32,
     {"a": 0.1, "mode": "fan_out", "nonlinearity": "leaky_relu"}),
    ("kaiming_normal_-selu", init.kaiming_normal_, (3, 8), torch.float64, {"nonlinearity": "selu"}),
    ("kaiming_uniform_-tanh", init.kaiming_uniform_, (3, 8), torch.float32, {"nonlinearity": "tanh"}),
    ("orthogonal_-tall", init.orthogonal_, (6, 3), torch.float32, {}),
    ("orthogonal_-wide_gain", init.orthogonal_, (3, 6), torch.float32, {"gain": 2.0}),
    ("orthogonal_-conv", init.orthogonal_, (4, 2, 3), torch.float64, {}),
    ("sparse_", init.sparse_, (6, 4), torch.float32, {"sparsity": 0.5}),
    ("sparse_-std", init.sparse_, (5, 7), torch.float32, {"sparsity": 0.3, "std": 0.5}),
]

# The deprecated aliases without the trailing underscore still exist; they forward to the above.
DEPRECATED_CASES: list[tuple[str, callable, tuple, dict]] = [
    ("uniform", init.uniform, (3, 5), {}),
    ("normal", init.normal, (3, 7), {}),
    ("constant", init.constant, (3, 2), {"val": 2.0}),
    ("eye", init.eye, (3, 3), {}),
    ("dirac", init.dirac, (2, 2, 3), {}),
    ("xavier_uniform", init.xavier_uniform, (3, 5), {}),
    ("xavier_normal", init.xavier_normal, (3, 5), {}),
    ("kaiming_uniform", init.kaiming_uniform, (3, 5), {}),
    ("kaiming_normal", init.kaiming_normal, (3, 5), {}),
    ("orthogonal", init.orthogonal, (4, 3), {}),
    ("sparse", init.sparse, (4, 3), {"sparsity": 0.5}),
]

NOT_INIT_FUNCTIONS = {"calculate_gain"}


def _takes_generator(fn) -> bool:
    return "generator" in inspect.signature(fn).parameters


def test_every_init_function_is_covered() -> None:
    public = {n for n, f in vars(init).items()
              if callable(f) and not n.startswith("_") and inspect.isfunction(f)
              and getattr(f, "__module__", None) == "torch.nn.init"}
    covered = {c[1].__name__ for c in CASES} | {c[0] for c in DEPRECATED_CASES} | NOT_INIT_FUNCTIONS
    missing = sorted(public - covered)
    assert not missing, f"torch.nn.init functions with no case in {__file__}: {missing}"


class InitInCtor(nn.Module):
    """Parameters around the init call so that the RNG stream position before and after it matters."""

    def __init__(self, fn, shape, dtype, kwargs, gen_seed=None) -> None:
        super().__init__()
        self.before = nn.Parameter(torch.randn(3))
        self.w = nn.Parameter(torch.empty(shape, dtype=dtype))
        if gen_seed is not None:
            kwargs = {**kwargs, "generator": torch.Generator().manual_seed(gen_seed)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(self.w, **kwargs)
        self.after = nn.Parameter(torch.rand(17))
        self.lin = nn.Linear(3, 2)


def _ids(cases):
    return [c[0] for c in cases]


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_init_inside_constructor(case) -> None:
    _, fn, shape, dtype, kwargs = case
    assert_same_as_eager(InitInCtor, fn, shape, dtype, kwargs)


@pytest.mark.parametrize("case", [c for c in CASES if _takes_generator(c[1])],
                         ids=_ids([c for c in CASES if _takes_generator(c[1])]))
def test_init_inside_constructor_with_generator(case) -> None:
    _, fn, shape, dtype, kwargs = case
    assert_same_as_eager(InitInCtor, fn, shape, dtype, kwargs, gen_seed=11)


class Holder(nn.Module):
    """A module whose parameter the test re-initializes after construction."""

    def __init__(self, shape, dtype) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 3)
        self.w = nn.Parameter(torch.empty(shape, dtype=dtype))
        nn.init.uniform_(self.w)  # a first init that the re-init overwrites
        self.register_buffer("b", torch.zeros(shape[0]))


@pytest.mark.parametrize("case", CASES, ids=_ids(CASES))
def test_reinit_after_trace(case) -> None:
    """eager: construct, then call the init function; fxinit: trace, call, materialize."""
    _, fn, shape, dtype, kwargs = case

    def post(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(m.w, **kwargs)
            fn(m.lin.weight, **kwargs) if fn not in (init.dirac_,) and len(shape) == 2 else None

    assert_same_as_eager(Holder, shape, dtype, post=post)


@pytest.mark.parametrize("case", [c for c in CASES if _takes_generator(c[1])],
                         ids=_ids([c for c in CASES if _takes_generator(c[1])]))
def test_reinit_after_trace_with_generator(case) -> None:
    _, fn, shape, dtype, kwargs = case

    def post(m):
        g = torch.Generator().manual_seed(5)
        fn(m.w, **kwargs, generator=g)
        init.normal_(m.lin.weight, generator=g)  # the same generator, further along its stream

    assert_same_as_eager(Holder, shape, dtype, post=post)


@pytest.mark.parametrize("case", DEPRECATED_CASES, ids=_ids(DEPRECATED_CASES))
def test_deprecated_aliases(case) -> None:
    _, fn, shape, kwargs = case
    assert_same_as_eager(InitInCtor, fn, shape, torch.float32, kwargs, seeds=(0,), orders=("whole", "random"))

    def post(m):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fn(m.w, **kwargs)

    assert_same_as_eager(Holder, shape, torch.float32, post=post, seeds=(0,), orders=("whole",))


def test_module_apply_init_fn_after_trace() -> None:
    """The transformers pattern: ``model.apply(_init_weights)`` on the deferred model."""

    def init_weights(mod):
        if isinstance(mod, nn.Linear):
            init.trunc_normal_(mod.weight, std=0.02)
            if mod.bias is not None:
                init.zeros_(mod.bias)
        elif isinstance(mod, nn.Embedding):
            init.normal_(mod.weight, std=0.02)
            mod.weight.data[0].zero_()
        elif isinstance(mod, nn.LayerNorm):
            init.ones_(mod.weight)
            init.zeros_(mod.bias)

    def factory():
        return nn.Sequential(nn.Embedding(11, 6), nn.LayerNorm(6), nn.Linear(6, 5), nn.Linear(5, 6, bias=False))

    assert_same_as_eager(factory, post=lambda m: m.apply(init_weights))


# ----------------------------------------------------------------------------- explicit generators
class UsesGivenGenerator(nn.Module):
    def __init__(self, g: torch.Generator) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.empty(5, 7))
        init.normal_(self.a, generator=g)
        self.b = nn.Parameter(torch.empty(4, 4))
        init.orthogonal_(self.b, generator=g)
        self.c = nn.Parameter(torch.empty(4, 5))
        init.trunc_normal_(self.c, std=0.5, a=-0.6, b=0.6, generator=g)
        self.d = nn.Parameter(torch.randn(3, generator=g))
        self.e = nn.Parameter(torch.randn(3))  # the global generator


def test_generator_from_outside_is_advanced_like_eager_and_not_touched_by_materialize() -> None:
    torch.manual_seed(0)
    g_ref = torch.Generator().manual_seed(123)
    ref = UsesGivenGenerator(g_ref)
    eager_rng = rng_state()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(123)
    m = fxinit.trace_init(UsesGivenGenerator, g)
    assert torch.equal(g.get_state(), g_ref.get_state()), "the user's generator is not where eager construction leaves it"
    assert torch.equal(rng_state(), eager_rng)
    g.manual_seed(999)  # the user goes on using the generator before materializing
    g_before = g.get_state()
    fxinit.materialize(m.b)
    fxinit.materialize(m)
    assert torch.equal(g.get_state(), g_before), "materialize changed the user's generator"
    for name in "abcde":
        assert_bits(getattr(m, name), getattr(ref, name), name)


def test_generator_used_after_trace_on_deferred_and_real_tensors() -> None:
    """One generator shared by a re-init of deferred parameters and by real tensors in between."""
    torch.manual_seed(0)
    ref = nn.Linear(6, 5)
    g = torch.Generator().manual_seed(7)
    init.kaiming_normal_(ref.weight, generator=g)
    real_ref = torch.randn(4, generator=g)
    init.uniform_(ref.bias, generator=g)

    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 6, 5)
    g = torch.Generator().manual_seed(7)
    init.kaiming_normal_(m.weight, generator=g)
    real = torch.randn(4, generator=g)
    init.uniform_(m.bias, generator=g)
    assert_bits(real, real_ref, "real tensor drawn between two deferred inits")
    fxinit.materialize(m)
    assert_bits(m.weight, ref.weight, "weight")
    assert_bits(m.bias, ref.bias, "bias")
