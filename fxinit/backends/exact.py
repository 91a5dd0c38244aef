"""Exact random ops: each draws from a private generator restored from its snapshot.

The user's generators are neither read nor changed, any subset of random ops can run
alone, and pieces or chunks of a fill continue one private generator from the state the
whole fill would have reached there (``rng.pieces``), so they give the whole fill's bits.
``uniform_`` and ``normal_`` run as fxinit's compiled copies of torch's CPU kernels
(``rng.fills``: the same bits, several times faster, written in parallel straight into the
tensor) wherever those passed their check against the installed torch; else torch's own.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from fxinit.passes.cast_fusion import FusedCast
from fxinit.passes.fills import Ranges
from fxinit.rng import Snapshot, mt19937, private_generator, swapped_default_generators
from fxinit.rng.fills import native_fill
from fxinit.rng.pieces import CHUNK, chunk_bounds, splittable
from fxinit.rng.portable import fills_are_serial
from fxinit.rng.snapshot import RngSnapshot, resolve

# Code that draws from the default generators implicitly must not overlap with other
# such code: the swap of the process-wide generator state would be seen by both.
_DEFAULT_GENERATORS = threading.Lock()

aten = torch.ops.aten
#: Elements of a fill cast chunk by chunk when ``rng.fills`` draws: fewer, larger pieces, as
#: each starts from a generator state moved past the pieces before it.
NATIVE_CHUNK = 1 << 21
#: Fills with compiled copies (``rng.fills``): op -> (kind, its two parameters' names and defaults).
NATIVE_FILLS = {aten.normal_.default: ("normal", ("mean", 0.0), ("std", 1.0)),
                aten.uniform_.default: ("uniform", ("from", 0.0), ("to", 1.0))}


def native_kind(node: fx.Node, args: tuple, kwargs: dict) -> tuple[str, tuple[float, float]] | None:
    """``(kind, parameters)`` of a fill ``rng.fills`` may run: ``normal_``/``uniform_`` with
    plain numbers, drawing from one generator; else None."""
    entry = NATIVE_FILLS.get(node.target)
    if entry is None or set(node.meta.get("generators") or {}) != {"gen"}:
        return None
    kind, *names = entry
    params = []
    for i, (name, default) in enumerate(names, 1):
        value = args[i] if len(args) > i else kwargs.get(name, default)
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            return None
        params.append(float(value))
    if set(kwargs) - {"generator", *(name for name, _ in names)}:
        return None
    return kind, (params[0], params[1])


class ExactSampler:
    """Runs random nodes from the generator snapshots recorded at capture."""

    rng = "exact"

    def __init__(self, snapshots: Mapping[str, Snapshot]) -> None:
        self.snapshots = snapshots

    def prepare(self, random_nodes: list[fx.Node]) -> None:
        """Compute the snapshots' states in program order, one short jump each."""
        resolve([self.snapshots[k] for n in random_nodes for k in n.meta["generators"].values()])

    def call(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        """Run random ``node`` whole (``args`` evaluated)."""
        native = native_kind(node, args, kwargs)
        if native is not None and isinstance(args[0], torch.Tensor):
            state = self.snapshots[node.meta["generators"]["gen"]].state
            if native_fill(native[0], args[0], state, native[1], threads=self._threads()):
                return args[0]
        return self.with_generators(node.target, args, kwargs, node.meta["generators"])

    @staticmethod
    def _threads() -> int | None:
        return 1 if fills_are_serial() else None

    def with_generators(self, fn: Callable[..., Any], args: tuple, kwargs: dict, keys: Mapping[str, str]) -> Any:
        """Call ``fn`` drawing from the recorded snapshots: a private generator passed in,
        and the default generators temporarily set for code that draws from them implicitly."""
        if "gen" in keys:
            kwargs["generator"] = private_generator(self.snapshots[keys["gen"]])
        defaults = {k: self.snapshots[v] for k, v in keys.items() if k.startswith("default:")}
        if not defaults:
            return fn(*args, **kwargs)
        with _DEFAULT_GENERATORS, swapped_default_generators(defaults):
            return fn(*args, **kwargs)

    def fill_pieces(self, node: fx.Node, args: tuple, kwargs: dict, pieces: Ranges) -> None:
        """Fill only ``pieces`` of ``args[0]`` (flat element ranges, widened to the sampler's
        blocks by the plan), as the whole fill would. One generator state goes from piece to
        piece: past the elements between two pieces it is moved without generating them
        (``mt19937.advance_in_place``: a few microseconds, plus a fraction of a nanosecond a word)."""
        flat = args[0].view(-1)
        self._pieces(node, tuple(args[1:]), kwargs, flat.dtype, flat.numel(), pieces, lambda lo, hi: flat[lo:hi],
                     None)

    def fill_chunks(self, node: fx.Node, args: tuple, kwargs: dict) -> None:
        """Fill all of ``args[0]`` with the bits of one whole call: at once by ``rng.fills``,
        else in cache-sized chunks continuing one generator, so that two-pass samplers
        (``normal_``: uniforms, then Box-Muller) read their second pass from cache."""
        flat = args[0].view(-1)
        self._pieces(node, tuple(args[1:]), kwargs, flat.dtype, flat.numel(), [(0, flat.numel())],
                     lambda lo, hi: flat[lo:hi], None)

    def fill_cast(self, fused: FusedCast, out: torch.Tensor) -> None:
        """The fill of ``fused`` chunk by chunk in a scratch buffer, each chunk cast into ``out``."""
        spec = fused.alloc.meta["spec"]
        node, rest = fused.fill, tuple(fused.fill.args[1:])
        size = NATIVE_CHUNK if native_kind(node, (None, *rest), dict(node.kwargs)) is not None else CHUNK
        scratch = torch.empty(size + 32, dtype=spec.dtype)
        flat = out.view(-1)
        _, tail = self._split(node, (None, *rest), dict(node.kwargs), spec.numel, spec.dtype)
        self._pieces(node, rest, dict(node.kwargs), spec.dtype, spec.numel,
                     chunk_bounds(spec.numel, bool(tail), size), lambda lo, hi: scratch[:hi - lo],
                     lambda lo, hi, piece: flat[lo:hi].copy_(piece))

    def _pieces(self, node: fx.Node, rest: tuple, kwargs: dict, dtype: torch.dtype, n: int, pieces: Ranges,
                view: Callable[[int, int], torch.Tensor],
                sink: Callable[[int, int, torch.Tensor], Any] | None) -> None:
        """Elements ``pieces`` of ``node``'s fill of ``n`` elements of ``dtype``, each written
        into ``view(lo, hi)`` and handed to ``sink``: by ``rng.fills`` from the generator
        state at the piece's start, else by torch in cache-sized chunks."""
        a, tail = self._split(node, (None, *rest), kwargs, n, dtype)
        native = native_kind(node, (None, *rest), kwargs)
        state, at = self.snapshots[node.meta["generators"]["gen"]].state.clone(), 0
        for lo, hi in pieces:
            mt19937.advance_in_place(state, a * (lo - at))
            at = lo
            values = view(lo, hi)
            # a piece starting at lo is the start of a whole fill of n - lo elements (lo is block-aligned)
            if native is None or not native_fill(native[0], values, state, native[1], total=n - lo,
                                                 threads=self._threads()):
                gen = private_generator(RngSnapshot(device="cpu", state=state.clone()))
                for first, last in chunk_bounds(hi - lo, bool(tail)):
                    node.target(values[first:last], *rest, **{**kwargs, "generator": gen})
            if sink is not None:
                sink(lo, hi, values)

    @staticmethod
    def _split(node: fx.Node, args: tuple, kwargs: dict, n: int, dtype: torch.dtype | None = None
               ) -> tuple[int, int]:
        split = splittable(node.target, tuple(args[1:]), kwargs, dtype or args[0].dtype, n)
        if split is None:  # the plan decided from the same facts
            raise AssertionError(f"fxinit: {node.name} was planned in pieces but cannot be split")
        return split
