"""How many generator words a random op consumes, learned from the installed torch.

Capture must leave every generator where eager construction would, without drawing a
model's worth of random numbers. For a CPU op whose consumption is a *pure advance*
of the MT19937 state that depends only on the number of elements, the count is
``a*m + b + t*[n % 16 != 0]`` where ``m`` is ``n`` rounded up to a multiple of ``r``
(per-element draws, a fixed prefix, the normal sampler's tail block, which float32
redraws and reduced precisions round up to). Rather than trusting a table written for one torch version, each kind of
call is measured once per process on small probe tensors, from two different starting
states, and the formula is used only if it predicts every probe exactly. Anything
else (small or strided tensors, samplers that keep a cached value, ops whose count
depends on data) returns None, and the caller runs the op for real.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._pytree import tree_flatten

from fxinit.rng.mt19937 import distance

MIN_ELEMENTS = 64
_PROBES = (64, 65, 80, 81, 95, 96, 1000, 1001, 4097, 4112)
_Model = tuple[int, int, int, int]  # a, r, b, t
_models: dict[Any, _Model | None] = {}


def cpu_draws(func: Any, args: tuple, kwargs: dict, target: torch.Tensor) -> int | None:
    """Words of the CPU generator that ``func(*args, **kwargs)`` consumes, or None.

    ``target`` is the tensor the op fills (its in-place argument or its output).
    """
    model = draw_model(func, args, kwargs, target)
    return None if model is None else _predict(model, target.numel())


def draw_model(func: Any, args: tuple, kwargs: dict, target: torch.Tensor) -> _Model | None:
    """The calibrated ``(a, r, b, t)`` of this kind of call, or None (see the module doc)."""
    if target.numel() < MIN_ELEMENTS or not target.is_contiguous():
        return None
    quick = call_key(func, args, kwargs, target)
    if quick is not None and quick in _by_call:
        return _by_call[quick]
    made = _probe_maker(func, args, kwargs, target)
    if made is None:
        model = None
    else:
        key, probe = made
        if key not in _models:
            _models[key] = _calibrate(probe)
        model = _models[key]
    if quick is not None:
        _by_call[quick] = model
    return model


# Capture asks for the model of every random op; the arguments of a call (all but the
# tensor it fills) are a cheaper key to the same answer than binding them to the schema.
_by_call: dict[tuple, _Model | None] = {}


def call_key(func: Any, args: tuple, kwargs: dict, target: torch.Tensor) -> tuple | None:
    """``(func, target dtype, the other arguments, whether a generator was given)``: what a
    call's draw count and argument checks depend on, hashable; None where a tensor or a list
    is among the arguments."""
    rest = args[1:] if args and args[0] is target else args
    options = tuple((k, v if k != "generator" else v is not None) for k, v in kwargs.items())
    key = func, target.dtype, rest, options
    try:
        hash(key)
    except TypeError:
        return None  # lists (sizes): the full analysis decides
    for v in (*rest, *kwargs.values()):
        if isinstance(v, torch.Tensor):
            return None  # hashable, but its values matter
    return key


def _predict(model: _Model, n: int) -> int:
    a, r, b, t = model
    return a * (-(-n // r) * r) + b + (t if n % 16 else 0)


def _probe_maker(func: Any, args: tuple, kwargs: dict,
                 target: torch.Tensor) -> tuple[Any, Callable[[int, torch.Generator], None]] | None:
    schema = func._schema.arguments
    names = [a.name for a in schema]
    bound = {names[i]: v for i, v in enumerate(args)}
    bound.update(kwargs)
    inplace = bool(schema) and schema[0].alias_info is not None and schema[0].alias_info.is_write
    size_arg = next((n for n in ("size", "n") if n in bound), None)
    if not inplace and size_arg is None:
        return None
    key_parts: list[Any] = [func, target.dtype]
    for name, value in bound.items():
        if name in ("generator", "device", "layout", "pin_memory", "memory_format"):
            continue
        if inplace and name == names[0]:
            continue
        if name == size_arg:
            continue
        flat, _ = tree_flatten(value)
        if any(isinstance(x, torch.Tensor) for x in flat):
            return None  # a tensor operand (bernoulli_(p_tensor)...): counts may depend on it
        key_parts.append((name, repr(value)))
    dtype = target.dtype

    def probe(k: int, gen: torch.Generator) -> None:
        call = dict(bound)
        if "device" in call:
            call["device"] = torch.device("cpu")
        if inplace:
            call[names[0]] = torch.empty(k, dtype=dtype)
        else:
            call[size_arg] = [k] if size_arg == "size" else k
            if "dtype" in names:
                call["dtype"] = dtype
        if "generator" in names:
            call["generator"] = gen
            func(**call)
            return
        default = torch.default_generator  # ops such as aten.rand.default draw from it
        saved = default.get_state()
        try:
            default.set_state(gen.get_state())
            func(**call)
            gen.set_state(default.get_state())
        finally:
            default.set_state(saved)

    return tuple(key_parts), probe


def _calibrate(probe: Callable[[int, torch.Generator], None]) -> _Model | None:
    try:
        counts = {k: _measure(probe, k) for k in _PROBES}
    except Exception:
        return None
    if any(c is None for c in counts.values()):
        return None
    for r in (1, 16):
        a16 = counts[80] - counts[64]
        if a16 % 16:
            continue
        a = a16 // 16
        b = counts[64] - 64 * a
        t = counts[65] - a * (-(-65 // r) * r) - b
        model = (a, r, b, t)
        if all(_predict(model, k) == c for k, c in counts.items()):
            return model
    return None


def _measure(probe: Callable[[int, torch.Generator], None], k: int) -> int | None:
    """Words consumed for ``k`` elements; None unless it is the same pure advance from a
    fresh state and from one holding cached normal samples."""
    found = set()
    for warm in (False, True):
        gen = torch.Generator()
        gen.manual_seed(12345 + k)
        if warm:  # leave a cached second sample in both normal samplers
            torch.empty(1, dtype=torch.float64).normal_(generator=gen)
            torch.empty(1, dtype=torch.float32).normal_(generator=gen)
        before = gen.get_state()
        probe(k, gen)
        found.add(distance(before, gen.get_state(), max_twists=64))
    if len(found) != 1:
        return None
    return found.pop()
