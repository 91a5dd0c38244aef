"""Random ops whose draws capture cannot predict, run for real so that each generator ends
where eager's does (``capture.stepping`` calls ``draw_for_real`` where ``rng.draws`` has no
count), and the meta results of random ops torch gives none.

On the CPU some samplers draw as many numbers as their *values* ask for: rejection samplers
(``_standard_gamma``, ``poisson``, ``binomial``, ``_sample_dirichlet``: Distributions.cpp) and
``rrelu_with_noise``, which draws only for the elements that are not positive. Run on
stand-in values, they would leave MT19937 elsewhere than eager's run does, and every later draw
of the model would differ. They get the exact values of their inputs, whatever the cost. On a
CUDA device each kernel reserves a fixed Philox offset, so stand-ins are exact there.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit.capture.deferred import is_deferred_tensor, state_of
from fxinit.capture.devices import META
from fxinit.capture.schema import mutated_arg_indices, schema_value
from fxinit.capture.trees import map_tree

aten = torch.ops.aten

#: Samplers whose CPU kernels draw a number of words that depends on their inputs' values.
VALUE_DEPENDENT_DRAWS = frozenset(getattr(aten, name) for name in (
    "_standard_gamma", "poisson", "binomial", "_sample_dirichlet", "rrelu_with_noise", "rrelu_with_noise_",
    "rrelu_with_noise_functional") if hasattr(aten, name))


def values_decide_draws(func: Any, device: torch.device) -> bool:
    """Whether ``func`` on ``device`` draws as many numbers as its inputs' values ask for."""
    return device.type == "cpu" and getattr(func, "overloadpacket", None) in VALUE_DEPENDENT_DRAWS


def draw_for_real(recorder: Any, func: Any, args: tuple, kwargs: dict, device: torch.device) -> None:
    """Run random op ``func`` for real on scratch tensors: it draws what eager would. Inputs
    hold their exact values where the draws depend on them, else where they are cheap to know
    (probabilities, means: a sampler checks them), else ones; a tensor the op only overwrites
    holds nothing."""
    exact = values_decide_draws(func, device)
    mutated = {id(schema_value(func, args, kwargs, i)) for i in mutated_arg_indices(func)}

    def real(x: Any) -> Any:
        if not is_deferred_tensor(x):
            return x
        if id(x) in mutated and not exact:
            return FACTORIES.empty_strided(x.size(), x.stride(), dtype=x.dtype, device=state_of(x).device)
        value = recorder.value_of(x, bounded=not exact)
        if value is not None:
            return value.to(state_of(x).device)
        assert not exact, "an unbounded value_of gives a value"
        return FACTORIES.ones(x.size(), dtype=x.dtype, device=state_of(x).device)

    with recorder.suspended(), torch.no_grad():
        rargs = map_tree(real, args)
        rkwargs = map_tree(real, kwargs)
        if "device" in rkwargs:
            rkwargs["device"] = device
        func(*rargs, **rkwargs)


def _binomial(count: torch.Tensor, prob: torch.Tensor, generator: Any = None) -> torch.Tensor:
    # a tensor of count's dtype, resized to the broadcast shape (Distributions.cpp, TensorIterator)
    return FACTORIES.empty(torch.broadcast_shapes(count.shape, prob.shape), dtype=count.dtype, device=META)


def _like_alpha(alpha: torch.Tensor, generator: Any = None) -> torch.Tensor:
    return FACTORIES.empty(alpha.shape, dtype=alpha.dtype, device=META)


#: Meta results of random ops that have no meta kernel in torch (``_standard_gamma`` before
#: torch 2.13; its meta kernel since keeps its input's strides): contiguous, as their CPU and
#: CUDA kernels allocate them.
META_RESULTS = {aten.binomial.default: _binomial, aten._sample_dirichlet.default: _like_alpha,
                aten._standard_gamma.default: _like_alpha}
