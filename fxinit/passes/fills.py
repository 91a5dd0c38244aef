"""How a random fill of a slice can run, decided from the graph before anything runs.

A random op filling a tensor can sometimes run in pieces (only the element ranges a
slice reads, ``passes.ranges``) or in cache-sized chunks (a whole fill, or a fill cast
chunk by chunk, ``passes.cast_fusion``) with the bits of one whole call:

* exact mode: when the installed torch's sampler can be split (``rng.pieces``: a
  calibrated draw model and a probe) and the fill draws from one explicit generator;
* portable mode: when the op is a plain in-place sampler (``IN_PLACE_SAMPLERS``), whose
  element ``i`` is the stream's element ``i`` whatever the split.
"""

from __future__ import annotations

import math
from typing import Any, Mapping, NamedTuple

import torch
import torch.fx as fx

from fxinit.rng.draws import MIN_ELEMENTS
from fxinit.ops import filled_argument, per_node
from fxinit.rng.pieces import CHUNK, splittable, trunc_normal_is_normal, widen
from fxinit.spec import TensorSpec

aten = torch.ops.aten

Ranges = list[tuple[int, int]]  # sorted, disjoint, half-open element ranges

#: Gaps between read ranges shorter than this are drawn rather than skipped. Exact mode: a
#: skip costs ~3 us of generator handling plus a sampler call of ~5 us, drawing ~3.5 ns an
#: element (measured, CPU mt19937 normal_): gaps this short cost about as much either way,
#: and skipping them keeps what a rank draws at its own elements.
EXACT_SKIP_MIN = 1 << 9
PORTABLE_SKIP_MIN = 1 << 13

#: The in-place samplers of portable mode: op -> (distribution, [(schema argument, parameter, default)]).
IN_PLACE_SAMPLERS: dict[Any, tuple[str, list[tuple[str, str, Any]]]] = {
    aten.uniform_: ("uniform", [("from", "low", 0.0), ("to", "high", 1.0)]),
    aten.normal_: ("normal", [("mean", "mean", 0.0), ("std", "std", 1.0)]),
    aten.bernoulli_: ("bernoulli", [("p", "p", 0.5)]),
    aten.exponential_: ("exponential", [("lambd", "lambd", 1.0)]),
    aten.cauchy_: ("cauchy", [("median", "median", 0.0), ("sigma", "sigma", 1.0)]),
    aten.log_normal_: ("log_normal", [("mean", "mean", 1.0), ("std", "std", 2.0)]),
    aten.geometric_: ("geometric", [("p", "p", 0.5)]),
    aten.random_: ("random", [("from", "low", 0.0), ("to", "high", None)]),
}


#: ``nn.init.trunc_normal_`` by the names an opaque node records.
TRUNC_NORMAL = frozenset({"torch.nn.init.trunc_normal_", "torch.nn.init._no_grad_trunc_normal_"})
#: No value of torch's CPU ``normal_`` lies further than this many std from the mean: it is
#: Box-Muller of uniforms of at most 53 bits, ``|z| <= sqrt(-2 ln 2**-53) ~ 8.57``.
NORMAL_REACH = 9.0


class FillCall(NamedTuple):
    """A random fill as a call of an in-place sampler: ``op(tensor, *rest, **kwargs,
    generator=...)``, the tensor being argument ``index`` of the node, drawing from the
    generator snapshot ``key``. With ``bounds`` (``trunc_normal_``'s, in the tensor's dtype)
    it is repeated: round ``k`` draws a whole fill from the state ``k`` whole fills later,
    and an element keeps its first draw within the bounds (``backends.exact``)."""

    op: Any
    index: int
    rest: tuple
    kwargs: dict
    key: str
    bounds: tuple[float, float] | None = None


#: Fills with compiled copies (``rng.fills``): op -> (kind, its two parameters' names and defaults).
NATIVE_FILLS = {aten.normal_.default: ("normal", ("mean", 0.0), ("std", 1.0)),
                aten.uniform_.default: ("uniform", ("from", 0.0), ("to", 1.0))}


def native_kind(call: FillCall | None) -> tuple[str, tuple[float, float]] | None:
    """``(kind, parameters)`` of a fill ``rng.fills`` may run (``normal_``/``uniform_`` with
    plain numbers), else None."""
    entry = NATIVE_FILLS.get(call.op) if call is not None else None
    if entry is None or set(call.kwargs) - {name for name, _ in entry[1:]}:
        return None
    kind, *names = entry
    params = []
    for i, (name, default) in enumerate(names):
        value = call.rest[i] if len(call.rest) > i else call.kwargs.get(name, default)
        if type(value) not in (int, float):
            return None
        params.append(float(value))
    return kind, (params[0], params[1])


@per_node
def fill_call(node: fx.Node) -> FillCall | None:
    """``node`` as a sampler call exact mode can split or run compiled: an in-place aten
    sampler with plain arguments and one generator, or a ``trunc_normal_`` whose bounds lie
    beyond every value ``normal_`` can draw, on a torch where it then is ``normal_``
    (``rng.pieces.trunc_normal_is_normal``); else None."""
    generators = node.meta.get("generators") or {}
    if node.meta.get("opaque") in TRUNC_NORMAL:
        return _trunc_normal_call(node, generators)
    if set(generators) != {"gen"} or filled_argument(node) != 0 or not _plain_arguments(node):
        return None
    return FillCall(node.target, 0, tuple(node.args[1:]), {k: v for k, v in node.kwargs.items() if k != "generator"},
                    generators["gen"])


def _trunc_normal_call(node: fx.Node, generators: Mapping[str, str]) -> FillCall | None:
    if len(node.args) != 2 or not isinstance(node.args[1], fx.Node) or not _plain_arguments(node):
        return None
    spec = node.args[1].meta.get("spec")
    params = [node.kwargs.get(k, d) for k, d in (("mean", 0.0), ("std", 1.0), ("a", -2.0), ("b", 2.0))]
    if spec is None or spec.device.type != "cpu" or not all(type(p) in (int, float) for p in params):
        return None
    mean, std, a, b = (float(p) for p in params)
    key = generators.get("gen") or generators.get("default:cpu")
    if key is None or not std > 0 or not trunc_normal_is_normal(spec.dtype):
        return None
    reach = NORMAL_REACH * std
    if a < mean - reach and mean + reach < b:  # no value of normal_ is out of bounds
        return FillCall(aten.normal_.default, 1, (mean, std), {}, key)
    if _accepted_share(mean, std, a, b) <= 0.3:  # torch samples this case from uniforms instead
        return None
    low, high = (torch.tensor(x, dtype=spec.dtype).item() for x in (a, b))  # as torch compares
    return FillCall(aten.normal_.default, 1, (mean, std), {}, key, (low, high))


def _accepted_share(mean: float, std: float, a: float, b: float) -> float:
    """The share of normal draws within ``[a, b]``, computed as ``trunc_normal_`` does."""
    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    return cdf((b - mean) / std) - cdf((a - mean) / std)


def _target_spec(node: fx.Node, device_map: Mapping[torch.device, torch.device]) -> TensorSpec | None:
    """The spec of the tensor in-place fill ``node`` writes, on the device it runs on (None
    for an op that writes no argument: a factory such as ``randn``)."""
    index = filled_argument(node)
    target = node.args[index] if index is not None and len(node.args) > index else None
    spec = target.meta.get("spec") if isinstance(target, fx.Node) else None
    if spec is None or not device_map:
        return spec
    return spec._replace(device=device_map.get(spec.device, spec.device))


def _plain_arguments(node: fx.Node) -> bool:
    """No tensor among the fill's other arguments (a tensor ``p`` or ``mean``)."""
    return not any(isinstance(a, fx.Node) for a in (*node.args[1 + (filled_argument(node) or 0):],
                                                     *node.kwargs.values()))


def _exact_split(node: fx.Node, spec: TensorSpec | None, at_start: bool = True) -> tuple[int, int] | None:
    """``rng.pieces.splittable`` for exact fill ``node`` of a contiguous CPU tensor ``spec``
    (at the start of its storage if ``at_start``: element ranges are storage ranges)."""
    call = fill_call(node)
    if call is None or spec is None or spec.device.type != "cpu":
        return None
    if (at_start and spec.storage_offset != 0) or not spec.is_contiguous():
        return None
    return splittable(call.op, call.rest, call.kwargs, spec.dtype, spec.numel)


def is_in_place_sampler(node: fx.Node) -> bool:
    """A portable in-place sampler with plain arguments (``normal_(w, 0.0, 0.02)``)."""
    return getattr(node.target, "overloadpacket", None) in IN_PLACE_SAMPLERS and _plain_arguments(node)


def exact_pieces(node: fx.Node, ranges: Ranges, device_map: Mapping[torch.device, torch.device] = {}
                 ) -> Ranges | None:
    """The pieces (widened to the sampler's blocks, merged) exact fill ``node`` fills to
    cover ``ranges`` of its target, or None when it must fill the whole tensor (the split
    is not exact, or the pieces are about the whole)."""
    spec = _target_spec(node, device_map)
    split = _exact_split(node, spec)
    if split is None:
        return None
    assert spec is not None
    if not ranges:
        return []
    n, tail = spec.numel, split[1]
    pieces = _close_gaps([widen(lo, hi, n, tail) for lo, hi in ranges], EXACT_SKIP_MIN)
    if sum(hi - lo for lo, hi in pieces) < MIN_ELEMENTS or pieces == [(0, n)]:
        return None
    return pieces


def draws_alone(node: fx.Node, rng: str, device_map: Mapping[torch.device, torch.device] = {}) -> bool:
    """Whether any piece of fill ``node`` (a whole storage: positions are storage elements)
    can be drawn alone, with the whole fill's bits, wherever its elements were copied to
    (``passes.origins``)."""
    spec = _target_spec(node, device_map)
    if rng == "portable":
        return is_in_place_sampler(node) and spec is not None and spec.storage_offset == 0 and spec.is_contiguous()
    return _exact_split(node, spec) is not None


def portable_pieces(node: fx.Node, ranges: Ranges, device_map: Mapping[torch.device, torch.device] = {}
                    ) -> Ranges | None:
    """The pieces portable fill ``node`` fills to cover ``ranges`` of its target (contiguous),
    or None when it must fill the whole tensor (not a plain in-place sampler)."""
    spec = _target_spec(node, device_map)
    if not is_in_place_sampler(node) or spec is None or not spec.is_contiguous():
        return None
    return _close_gaps(ranges, PORTABLE_SKIP_MIN)


def _close_gaps(ranges: Ranges, skip_min: int) -> Ranges:
    """``ranges`` (sorted) with the gaps shorter than ``skip_min`` filled in."""
    pieces: Ranges = []
    for lo, hi in ranges:
        if pieces and lo - pieces[-1][1] < skip_min:  # drawing a short gap costs less than skipping it
            pieces[-1] = (pieces[-1][0], max(hi, pieces[-1][1]))
        else:
            pieces.append((lo, hi))
    return pieces


def exact_chunks(node: fx.Node, numel: int | None = None,
                 device_map: Mapping[torch.device, torch.device] = {}) -> bool:
    """Whether exact fill ``node`` (of ``numel`` elements, default its target's) can run in
    ``CHUNK``-sized pieces continuing one generator, with the bits of one whole call."""
    spec = _target_spec(node, device_map)
    if spec is None or (numel if numel is not None else spec.numel) < 2 * CHUNK:
        return False
    return _exact_split(node, spec, at_start=False) is not None
