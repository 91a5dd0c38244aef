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
from functools import lru_cache
from typing import Any, Callable, Mapping

import numpy as np
import torch
import torch.fx as fx

from fxinit.ops import positional_generator
from fxinit.passes.batched_fills import BatchedFill
from fxinit.passes.cast_fusion import FusedCast
from fxinit.passes import intervals
from fxinit.passes.fills import FillCall, Ranges, fill_call, native_kind
from fxinit.rng import Snapshot, mt19937, private_generator, swapped_default_generators
from fxinit.rng.fills import native_fill, native_fill_batch, native_fill_runs
from fxinit.rng.pieces import CHUNK, chunk_bounds, splittable, widen
from fxinit.rng.portable import fills_are_serial
from fxinit.rng.snapshot import RngSnapshot, resolve

# Code that draws from the default generators implicitly must not overlap with other
# such code: the swap of the process-wide generator state would be seen by both.
_DEFAULT_GENERATORS = threading.Lock()

aten = torch.ops.aten
#: Elements of a fill cast chunk by chunk when ``rng.fills`` draws: fewer, larger pieces, as
#: each starts from a generator state moved past the pieces before it.
NATIVE_CHUNK = 1 << 21
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
        call = fill_call(node)
        native = native_kind(call) if call is not None and call.bounds is None else None
        if native is not None and isinstance(args[call.index], torch.Tensor):
            tensor = args[call.index]
            if native_fill(native[0], tensor, self.snapshots[call.key].state, native[1], threads=self._threads()):
                return tensor
        return self.with_generators(node.target, args, kwargs, node.meta["generators"])

    def fill_batch(self, fills: list[tuple[fx.Node, BatchedFill, torch.Tensor]]) -> None:
        """Run batched fills (``passes.batched_fills``) in one call to ``rng.fills``; any it
        cannot run (a check it failed, a state that is not a CPU generator's) runs alone."""
        done = native_fill_batch([(f.kind, t, self.snapshots[f.key].state, f.params) for _, f, t in fills],
                                 self._threads())
        for node, f, t in fills[done:]:
            args = tuple(t if i == f.index else a for i, a in enumerate(node.args))
            self.call(node, args, {k: v for k, v in node.kwargs.items() if k != "generator"})

    @staticmethod
    def _threads() -> int | None:
        return 1 if fills_are_serial() else None

    def with_generators(self, fn: Callable[..., Any], args: tuple, kwargs: dict, keys: Mapping[str, str]) -> Any:
        """Call ``fn`` drawing from the recorded snapshots: a private generator passed in,
        and the default generators temporarily set for code that draws from them implicitly."""
        if "gen" in keys:
            gen = private_generator(self.snapshots[keys["gen"]])
            at = positional_generator(fn)
            if at is not None and at < len(args):  # recorded positionally: ``torch.poisson(x, generator=g)``
                args = (*args[:at], gen, *args[at + 1:])
            else:
                kwargs["generator"] = gen
        defaults = {k: self.snapshots[v] for k, v in keys.items() if k.startswith("default:")}
        if not defaults:
            return fn(*args, **kwargs)
        with _DEFAULT_GENERATORS, swapped_default_generators(defaults):
            return fn(*args, **kwargs)

    def fill_pieces(self, node: fx.Node, args: tuple, kwargs: dict, pieces: Ranges) -> None:
        """Fill only ``pieces`` of the tensor ``node`` fills (flat element ranges, widened to
        the sampler's blocks by the plan), as the whole fill would. One generator state goes
        from piece to piece: past the elements between two pieces it is moved without
        generating them (``mt19937.advance_in_place``: a few microseconds, plus a fraction of
        a nanosecond a word)."""
        call = self._call(node)
        flat = args[call.index].view(-1)
        if call.bounds is not None and not rejection_in_pieces(flat.dtype):
            self.with_generators(node.target, args, kwargs, node.meta["generators"])  # whole, by torch
            return
        self._pieces(call, flat.dtype, flat.numel(), pieces, lambda lo, hi: flat[lo:hi], None)

    def fill_chunks(self, node: fx.Node, args: tuple, kwargs: dict) -> None:
        """Fill all of the tensor ``node`` fills with the bits of one whole call: at once by
        ``rng.fills``, else in cache-sized chunks continuing one generator, so that two-pass
        samplers (``normal_``: uniforms, then Box-Muller) read their second pass from cache."""
        self.fill_pieces(node, args, kwargs, [(0, args[self._call(node).index].numel())])

    def fill_runs(self, node: fx.Node, runs: np.ndarray, out: torch.Tensor) -> None:
        """Elements ``runs[i, 0] .. runs[i, 1]`` of fill ``node`` (its whole target, as one
        call draws it) into the elements ``runs[i, 2] ..`` of ``out`` (flat): a copy's draws
        (``plan.forwards``). By ``rng.fills`` straight into ``out``; else in pieces drawn into
        a scratch buffer and copied; else (a bounded fill torch must run whole) whole."""
        call = self._call(node)
        spec = node.args[call.index].meta["spec"]
        n, dtype, state = spec.numel, spec.dtype, self.snapshots[call.key].state
        native = native_kind(call) if call.bounds is None else None
        if native is not None and native_fill_runs(native[0], out, state, native[1], runs, n, self._threads()):
            return
        if call.bounds is not None and not rejection_in_pieces(dtype):
            whole = torch.empty(n, dtype=dtype)
            args = tuple(whole if i == call.index else a for i, a in enumerate(node.args))
            self.with_generators(node.target, args, dict(node.kwargs), node.meta["generators"])
            _scatter(out, runs, lambda lo, hi: whole[lo:hi])
            return
        _, tail = self._split(call, n, dtype)
        pieces = intervals.as_list(intervals.of([widen(lo, hi, n, tail) for lo, hi, _ in runs.tolist()]))
        pieces = [(lo + a, lo + b) for lo, hi in pieces
                  for a, b in chunk_bounds(hi - lo, bool(tail) and hi == n, NATIVE_CHUNK)]
        scratch = torch.empty(min(NATIVE_CHUNK, max((hi - lo for lo, hi in pieces), default=0)) + 32, dtype=dtype)

        def scatter(lo: int, hi: int, piece: torch.Tensor) -> None:
            inside = runs[(runs[:, 1] > lo) & (runs[:, 0] < hi)]
            _scatter(out, inside, lambda a, b: piece[a - lo:b - lo], (lo, hi))

        self._pieces(call, dtype, n, pieces, lambda lo, hi: scratch[:hi - lo], scatter)

    def fill_cast(self, fused: FusedCast, out: torch.Tensor) -> None:
        """The fill of ``fused`` chunk by chunk in a scratch buffer, each chunk cast into ``out``."""
        spec = fused.alloc.meta["spec"]
        call = self._call(fused.fill)
        size = NATIVE_CHUNK if native_kind(call) is not None else CHUNK
        scratch = torch.empty(size + 32, dtype=spec.dtype)
        flat = out.view(-1)
        _, tail = self._split(call, spec.numel, spec.dtype)
        self._pieces(call, spec.dtype, spec.numel, chunk_bounds(spec.numel, bool(tail), size),
                     lambda lo, hi: scratch[:hi - lo], lambda lo, hi, piece: flat[lo:hi].copy_(piece))

    def _pieces(self, call: FillCall, dtype: torch.dtype, n: int, pieces: Ranges,
                view: Callable[[int, int], torch.Tensor],
                sink: Callable[[int, int, torch.Tensor], Any] | None, start: torch.Tensor | None = None) -> None:
        """Elements ``pieces`` of the fill ``call`` of ``n`` elements of ``dtype`` (drawing from
        ``start``, default its snapshot), each written into ``view(lo, hi)`` and handed to
        ``sink``: by ``rng.fills`` from the generator state at the piece's start, else by torch
        in cache-sized chunks; then, for a bounded call, redrawn where out of bounds."""
        a, tail = self._split(call, n, dtype)
        native = native_kind(call)
        state, at = (self.snapshots[call.key].state if start is None else start).clone(), 0
        for lo, hi in pieces:
            mt19937.advance_in_place(state, a * (lo - at))
            at = lo
            values = view(lo, hi)
            # a piece starting at lo is the start of a whole fill of n - lo elements (lo is block-aligned)
            if native is None or not native_fill(native[0], values, state, native[1], total=n - lo,
                                                 threads=self._threads()):
                gen = private_generator(RngSnapshot(device="cpu", state=state.clone()))
                for first, last in chunk_bounds(hi - lo, bool(tail)):
                    call.op(values[first:last], *call.rest, **call.kwargs, generator=gen)
            if call.bounds is not None:
                self._redraw_rejected(call, dtype, n, lo, values)
            if sink is not None:
                sink(lo, hi, values)

    def _redraw_rejected(self, call: FillCall, dtype: torch.dtype, n: int, lo: int, values: torch.Tensor) -> None:
        """``trunc_normal_``'s rejection rounds for ``values``, elements ``lo ..`` of the fill:
        round ``k`` is a whole fill drawn from the state ``k`` whole fills after the first,
        and an element keeps its first draw within the bounds. That holds element by element,
        so a piece needs only the blocks of its own elements that were rejected."""
        a, tail = self._split(call, n, dtype)
        words = a * n + (tail if n % 16 else 0)  # one whole fill
        low, high = call.bounds
        plain = call._replace(bounds=None)
        out = (values < low) | (values > high)
        k = 0
        while bool(out.any()):
            k += 1
            state = mt19937.advance(self.snapshots[call.key].state, k * words)
            rejected = out.nonzero().view(-1).numpy() + lo
            if len(rejected) * 16 * 64 > values.numel():  # dense: redraw the whole piece
                redraw = [(lo, lo + values.numel())]
            else:
                redraw = intervals.as_list(intervals.of([widen(int(i), int(i) + 1, n, tail) for i in rejected]))

            def keep(rlo: int, rhi: int, drawn: torch.Tensor) -> None:
                mask, seg = out[rlo - lo:rhi - lo], values[rlo - lo:rhi - lo]
                drawn = drawn[:rhi - rlo]
                seg[mask] = drawn[mask]
                mask &= (drawn < low) | (drawn > high)

            self._pieces(plain, dtype, n, redraw, lambda rlo, rhi: torch.empty(rhi - rlo, dtype=dtype), keep, state)

    @staticmethod
    def _call(node: fx.Node) -> FillCall:
        call = fill_call(node)
        if call is None:  # the plan decided from the same facts
            raise AssertionError(f"fxinit: {node.name} was planned in pieces but is not a sampler call")
        return call

    @staticmethod
    def _split(call: FillCall, n: int, dtype: torch.dtype) -> tuple[int, int]:
        split = splittable(call.op, call.rest, call.kwargs, dtype, n)
        if split is None:  # the plan decided from the same facts
            raise AssertionError(f"fxinit: {call.op} was planned in pieces but cannot be split")
        return split


def _scatter(out: torch.Tensor, runs: np.ndarray, drawn: Callable[[int, int], torch.Tensor],
             window: tuple[int, int] | None = None) -> None:
    """``out[at + lo' - lo .. ] = drawn(lo', hi')`` for each run ``(lo, hi, at)`` (clipped to
    ``window`` of fill positions)."""
    for lo, hi, at in runs.tolist():
        a, b = (max(lo, window[0]), min(hi, window[1])) if window is not None else (lo, hi)
        out[at + a - lo:at + b - lo].copy_(drawn(a, b))


@lru_cache(maxsize=None)
def rejection_in_pieces(dtype: torch.dtype) -> bool:
    """Whether pieces of a bounded ``trunc_normal_`` (``ExactSampler._redraw_rejected``) equal
    the installed torch's whole call, probed with many rejections across sizes and pieces."""
    try:
        for n, (a, b), pieces in ((100, (-1.0, 1.5), [(0, 100)]), (1007, (-0.5, 2.0), [(16, 400), (512, 1007)]),
                                  (4096, (-3.0, 3.0), [(0, 4096)]), (20000, (-1.0, 1.0), [(160, 9600)])):
            gen = torch.Generator().manual_seed(n)
            state = gen.get_state()
            want = torch.empty(n, dtype=dtype)
            torch.nn.init.trunc_normal_(want, 0.0, 1.0, a, b, generator=gen)
            low, high = (torch.tensor(x, dtype=dtype).item() for x in (a, b))
            sampler = ExactSampler({"probe": RngSnapshot(device="cpu", state=state)})
            got = torch.full((n,), float("nan"), dtype=dtype)
            call = FillCall(aten.normal_.default, 0, (0.0, 1.0), {}, "probe", (low, high))
            sampler._pieces(call, dtype, n, pieces, lambda lo, hi: got[lo:hi], None)
            for lo, hi in pieces:
                if not torch.equal(got[lo:hi].view(torch.uint8), want[lo:hi].view(torch.uint8)):
                    return False
        return True
    except Exception:
        return False
