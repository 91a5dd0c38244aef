"""Exact random ops: each draws from a private generator restored from its snapshot.

The user's generators are neither read nor changed, any subset of random ops can run
alone, and pieces or chunks of a fill continue one private generator from the state the
whole fill would have reached there (``rng.pieces``), so they give the whole fill's bits.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Mapping

import torch
import torch.fx as fx

from fxinit.passes.cast_fusion import FusedCast
from fxinit.passes.fills import Ranges
from fxinit.rng import RngSnapshot, Snapshot, mt19937, private_generator, swapped_default_generators
from fxinit.rng.pieces import CHUNK, chunk_bounds, splittable
from fxinit.rng.snapshot import resolve

# Code that draws from the default generators implicitly must not overlap with other
# such code: the swap of the process-wide generator state would be seen by both.
_DEFAULT_GENERATORS = threading.Lock()


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
        return self.with_generators(node.target, args, kwargs, node.meta["generators"])

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
        blocks by the plan), as the whole fill would. One private generator goes from piece
        to piece: past the elements between two pieces it is advanced without generating
        them (``mt19937.advance``, a fraction of the cost)."""
        flat = args[0].view(-1)
        a, tail = self._split(node, args, kwargs, flat.numel())
        state, at = self.snapshots[node.meta["generators"]["gen"]].state, 0
        for lo, hi in pieces:
            gen = private_generator(RngSnapshot(device="cpu", state=mt19937.advance(state, a * (lo - at))))
            for first, last in chunk_bounds(hi - lo, bool(tail)):  # cache-sized (lo is block-aligned)
                node.target(flat[lo + first:lo + last], *args[1:], **{**kwargs, "generator": gen})
            state, at = gen.get_state(), hi

    def fill_chunks(self, node: fx.Node, args: tuple, kwargs: dict) -> None:
        """Fill all of ``args[0]`` in cache-sized chunks continuing one generator, with the
        bits of one whole call. Pieces that fit in the cache make two-pass samplers
        (``normal_``: uniforms, then Box-Muller) read their second pass from cache."""
        flat = args[0].view(-1)
        self._chunks(node, args[1:], kwargs, flat.dtype, flat.numel(), lambda lo, hi: flat[lo:hi], None)

    def fill_cast(self, fused: FusedCast, out: torch.Tensor) -> None:
        """The fill of ``fused`` chunk by chunk in a scratch buffer, each chunk cast into ``out``."""
        spec = fused.alloc.meta["spec"]
        scratch = torch.empty(CHUNK + 32, dtype=spec.dtype)
        flat = out.view(-1)
        self._chunks(fused.fill, tuple(fused.fill.args[1:]), dict(fused.fill.kwargs), spec.dtype, spec.numel,
                     lambda lo, hi: scratch[:hi - lo], lambda lo, hi, piece: flat[lo:hi].copy_(piece))

    def _chunks(self, node: fx.Node, rest: tuple, kwargs: dict, dtype: torch.dtype, n: int,
                piece: Callable[[int, int], torch.Tensor],
                sink: Callable[[int, int, torch.Tensor], Any] | None) -> None:
        _, tail = self._split(node, (None, *rest), kwargs, n, dtype)
        gen = private_generator(self.snapshots[node.meta["generators"]["gen"]])
        for lo, hi in chunk_bounds(n, bool(tail)):
            values = piece(lo, hi)
            node.target(values, *rest, **{**kwargs, "generator": gen})
            if sink is not None:
                sink(lo, hi, values)

    @staticmethod
    def _split(node: fx.Node, args: tuple, kwargs: dict, n: int, dtype: torch.dtype | None = None
               ) -> tuple[int, int]:
        split = splittable(node.target, tuple(args[1:]), kwargs, dtype or args[0].dtype, n)
        if split is None:  # the plan decided from the same facts
            raise AssertionError(f"fxinit: {node.name} was planned in pieces but cannot be split")
        return split
