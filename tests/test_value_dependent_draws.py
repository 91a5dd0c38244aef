"""Samplers whose CPU kernels draw as many numbers as their inputs' values ask for (rejection
samplers: gamma, Poisson, binomial, Dirichlet; ``rrelu``, which draws for the elements that
are not positive). Capture runs them for real to move the generator as eager does, and must
give them their inputs' exact values there: on stand-ins (ones where a value was costly to
know, or the garbage of a tensor the op overwrites) the generator ended elsewhere and every
later draw of the model differed, silently. Binomial and Dirichlet have no meta kernel in
torch; they were refused."""

from __future__ import annotations

from typing import Callable

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from conftest import assert_same_as_eager
from fxinit.capture import shadows

D = torch.distributions
N = 6000  # more elements than a shadow is kept for


def _seeded() -> torch.Generator:
    return torch.Generator().manual_seed(3)


def _holding(make: Callable[[], torch.Tensor]) -> Callable[[], nn.Module]:
    """A module holding ``make()`` and a parameter drawn after it (which a generator left
    elsewhere shows)."""
    def build() -> nn.Module:
        m = nn.Module()
        m.register_buffer("sample", make())
        m.after = nn.Parameter(torch.randn(5))
        return m
    return build


SAMPLES = {
    "gamma": lambda: torch._standard_gamma(torch.linspace(0.05, 3.0, N)),
    "gamma_distribution": lambda: D.Gamma(torch.full((N,), 0.5), 2.0, validate_args=False).sample(),
    "poisson": lambda: torch.poisson(torch.linspace(0.0, 40.0, N)),
    "binomial": lambda: torch.binomial(torch.full((N,), 30.0), torch.linspace(0.0, 1.0, N)),
    "binomial_broadcast": lambda: torch.binomial(torch.full((3, 1), 7.0), torch.rand(3, 4)),
    "binomial_distribution": lambda: D.Binomial(10, torch.full((5,), 0.3)).sample((2,)),
    "dirichlet": lambda: torch._sample_dirichlet(torch.linspace(0.1, 2.0, N).reshape(-1, 4)),
    "beta": lambda: D.Beta(torch.ones(4), 2.0).sample((3,)),
    "lkj_cholesky": lambda: D.LKJCholesky(3, 0.5).sample((2,)),
    "rrelu": lambda: F.rrelu(torch.linspace(-1.0, 1.0, N), training=True),
    "rrelu_in_place": lambda: F.rrelu(torch.linspace(-1.0, 1.0, 100), training=True, inplace=True),
    "rrelu_module_in_place": lambda: nn.RReLU(inplace=True).train()(torch.randn(100)),
    # a generator of the caller's: these samplers take it positionally, where torch's dispatcher
    # passes it among the arguments (it was left out: the default generator's snapshot was taken,
    # and the replay passed two generators)
    "poisson_generator": lambda: torch.poisson(torch.rand(N) * 4, generator=_seeded()),
    "binomial_generator": lambda: torch.binomial(torch.full((N,), 9.0), torch.rand(N), generator=_seeded()),
    "gamma_generator": lambda: torch._standard_gamma(torch.rand(N) + 0.1, generator=_seeded()),
    "dirichlet_generator": lambda: torch._sample_dirichlet(torch.rand(N // 4, 4) + 0.1, generator=_seeded()),
}


@pytest.fixture(params=[False, True], ids=["values_cheap", "values_costly"])
def costly_values(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    """With ``True``, no value is cheap enough to compute while recording but the ones the
    draws need (as for a model's worth of inputs)."""
    if request.param:
        monkeypatch.setattr(shadows, "EVAL_BUDGET", 64)
    return request.param


@pytest.mark.parametrize("name", SAMPLES)
def test_draws_that_depend_on_values_leave_the_generator_where_eager_does(name: str, costly_values: bool) -> None:
    assert_same_as_eager(_holding(SAMPLES[name]), seeds=(0,))
