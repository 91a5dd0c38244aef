"""Portable random ops: each draws from the counter-based stream of its key.

The plan names every random op (``passes.stream_keys``); ``PortableSampler`` runs a random
node with the samplers of ``fxinit.rng.portable`` on the stream of its key under a seed.
Non-random ops run as in exact mode.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch
import torch.fx as fx

from fxinit.errors import DeferredInitError
from fxinit.ops import call_init_function
from fxinit.passes.batched_fills import BatchedFill
from fxinit.passes.cast_fusion import FusedCast
from fxinit.passes.fills import IN_PLACE_SAMPLERS, Ranges
from fxinit.rng import portable
from fxinit.rng.pieces import CHUNK
from fxinit.rng.portable import affine, fill_, randperm, sample, stream_key

aten = torch.ops.aten


class PortableSampler:
    """Runs random nodes on the portable streams of their keys under ``seed``."""

    rng = "portable"

    def __init__(self, seed: int, keys: Mapping[fx.Node, str]) -> None:
        self.seed = seed
        self.streams = {node: stream_key(seed, key) for node, key in keys.items()}

    def prepare(self, random_nodes: list[fx.Node]) -> None:
        """Nothing to do before running: streams are stateless."""

    def call(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        """Run random ``node`` whole (``args`` evaluated)."""
        stream = self.streams[node]
        kwargs = {k: v for k, v in kwargs.items() if k not in ("generator", "default_device")}
        if node.target is call_init_function:
            qualname, tensor = args[0], args[1]
            fn = _OPAQUE.get(qualname.rsplit(".", 1)[-1])
            if fn is None:
                raise _unsupported(node, qualname)
            with torch.no_grad():
                fn(tensor, stream, *args[2:], **kwargs)
            return tensor
        packet = node.target.overloadpacket
        if packet in IN_PLACE_SAMPLERS:
            kind, params = _sampler(node, args[0], args[1:], kwargs)
            self.fill(args[0], kind, stream, 0, params)
            return args[0]
        if packet is aten.randperm:
            return randperm(stream, args[0], kwargs.get("device") or "cpu").to(kwargs.get("dtype") or torch.int64)
        factory = _FACTORIES.get(packet)
        if factory is None:
            raise _unsupported(node, str(node.target))
        out, kind, params = factory(args, kwargs)
        self.fill(out, kind, stream, 0, params)
        return out

    def fill_batch(self, fills: list[tuple[fx.Node, BatchedFill, torch.Tensor]]) -> None:
        """Run batched fills (``passes.batched_fills``) in one call to fxinit's C kernel; any it
        cannot run (no kernel built here) runs alone."""
        jobs = [(t, f.kind, self.streams[n], *batched_affine(f)) for n, f, t in fills]
        for node, f, t in fills[portable.fill_batch(jobs):]:
            self.call(node, (t, *node.args[1:]), {k: v for k, v in node.kwargs.items() if k != "generator"})

    def fill_pieces(self, node: fx.Node, args: tuple, kwargs: dict, pieces: Ranges) -> None:
        """Fill only ``pieces`` of ``args[0]`` (contiguous) with the stream's same elements."""
        kind, params = _sampler(node, args[0], args[1:], kwargs)
        flat = args[0].view(-1)
        for lo, hi in pieces:
            self.fill(flat[lo:hi], kind, self.streams[node], lo, params)

    def fill_runs(self, node: fx.Node, runs: np.ndarray, out: torch.Tensor) -> None:
        """Positions ``runs[i, 0] .. runs[i, 1]`` of in-place sampler ``node``'s stream into the
        elements ``runs[i, 2] ..`` of ``out`` (flat): a copy's draws (``plan.forwards``)."""
        spec = node.args[0].meta["spec"]
        kind, params = _sampler(node, torch.empty(0, dtype=spec.dtype), tuple(node.args[1:]), dict(node.kwargs))
        if portable.fill_runs(out, kind, self.streams[node], runs, **params):
            return
        for lo, hi, at in runs.tolist():
            self.fill(out[at:at + hi - lo], kind, self.streams[node], lo, params)

    def fill_chunks(self, node: fx.Node, args: tuple, kwargs: dict) -> None:
        """A whole fill: ``fill_`` splits it into chunks itself, on every core."""
        self.call(node, args, kwargs)

    def fill_cast(self, fused: FusedCast, out: torch.Tensor) -> None:
        """The fill of ``fused`` in chunks in a scratch buffer, each chunk cast into ``out``:
        elements ``lo .. hi`` of the fill are the stream's elements ``lo .. hi``."""
        spec = fused.alloc.meta["spec"]
        scratch = torch.empty(CHUNK, dtype=spec.dtype)
        kind, params = _sampler(fused.fill, scratch, tuple(fused.fill.args[1:]), dict(fused.fill.kwargs))
        flat = out.view(-1)
        for lo in range(0, spec.numel, CHUNK):
            piece = scratch[:min(CHUNK, spec.numel - lo)]
            self.fill(piece, kind, self.streams[fused.fill], lo, params)
            flat[lo:lo + piece.numel()].copy_(piece)

    def fill(self, target: torch.Tensor, kind: str, stream: int, first: int, params: dict[str, Any]) -> None:
        """Element ``k`` of ``target`` gets the stream's element ``first + k`` of ``kind``."""
        fill_(target, kind, stream, first=first, **params)


def batched_affine(fill: BatchedFill) -> tuple[float, float]:
    """``(scale, shift)`` of a batched uniform or normal fill (``rng.portable.affine``)."""
    a, b = fill.params
    return affine(fill.kind, {"mean": a, "std": b} if fill.kind == "normal" else {"low": a, "high": b})


def sampler_params(node: fx.Node, args: tuple, kwargs: dict) -> tuple[torch.Tensor, str, dict[str, float]]:
    """For a uniform or normal ``node`` (an in-place sampler or a random factory; ``args``
    evaluated): the tensor it fills (a factory's is new), its distribution, and that
    distribution's ``scale`` and ``shift`` (``rng.portable.affine``)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
    packet = node.target.overloadpacket
    if packet in IN_PLACE_SAMPLERS:
        out = args[0]
        kind, params = _sampler(node, out, args[1:], kwargs)
    else:
        out, kind, params = _FACTORIES[packet](args, kwargs)
    scale, shift = affine(kind, params)
    return out, kind, {"scale": scale, "shift": shift}


def _sampler(node: fx.Node, target: torch.Tensor, rest: tuple, kwargs: dict) -> tuple[str, dict[str, Any]]:
    """The distribution and parameters of in-place random ``node`` writing ``target``."""
    packet = node.target.overloadpacket
    kind, names = IN_PLACE_SAMPLERS[packet]
    params = _bind(node, (target, *rest), {k: v for k, v in kwargs.items() if k != "generator"}, names)
    if packet is aten.random_:
        params = _random_range(node, target, params)
    return kind, params


def _unsupported(node: fx.Node, what: str) -> DeferredInitError:
    return DeferredInitError(f"no portable implementation of {what}",
                             op=str(node.target), module=node.meta.get("module"),
                             hint="materialize with rng='exact', or report the init function you need")


def _bind(node: fx.Node, args: tuple, kwargs: dict, names: list[tuple[str, str, Any]]) -> dict[str, Any]:
    schema = [a.name for a in node.target._schema.arguments]
    bound = dict(zip(schema, args))
    bound.update(kwargs)
    params = {}
    for arg, param, default in names:
        value = bound.get(arg, default)
        if isinstance(value, torch.Tensor):
            raise _unsupported(node, f"{node.target} with a tensor argument {arg!r}")
        params[param] = value
    return params


def _random_range(node: fx.Node, target: torch.Tensor, params: dict[str, Any]) -> dict[str, Any]:
    """``random_``'s default range: [0, 2^mantissa] for floats, [0, max] for integers."""
    if params["high"] is None:
        if target.dtype.is_floating_point:
            params["high"] = (1 << (torch.finfo(target.dtype).nmant + 1)) + 1
        elif target.dtype == torch.bool:
            params["high"] = 2
        else:
            params["high"] = torch.iinfo(target.dtype).max + 1 if target.dtype != torch.int64 else (1 << 63) - 1
    return params


def _new(kwargs: dict, shape: Sequence[int], default: torch.dtype) -> torch.Tensor:
    dtype = kwargs.get("dtype") or default
    return torch.empty(tuple(shape), dtype=dtype, device=kwargs.get("device") or "cpu")


Fill = tuple[torch.Tensor, str, dict[str, Any]]  # a new tensor, and the distribution that fills it


def _rand(args: tuple, kwargs: dict) -> Fill:
    return _new(kwargs, args[0], torch.get_default_dtype()), "uniform", {"low": 0.0, "high": 1.0}


def _randn(args: tuple, kwargs: dict) -> Fill:
    return _new(kwargs, args[0], torch.get_default_dtype()), "normal", {"mean": 0.0, "std": 1.0}


def _randint(args: tuple, kwargs: dict) -> Fill:
    low, high, size = (0, *args[:2]) if len(args) == 2 else args[:3]
    return _new(kwargs, size, torch.int64), "random", {"low": low, "high": high}


def _normal_float_float(args: tuple, kwargs: dict) -> Fill:
    mean, std, size = args[:3]
    return _new(kwargs, size, torch.get_default_dtype()), "normal", {"mean": mean, "std": std}


def _like(kind: str, **params: float) -> Callable[[tuple, dict], Fill]:
    def make(args: tuple, kwargs: dict) -> Fill:
        src = args[0]
        out = torch.empty(src.shape, dtype=kwargs.get("dtype") or src.dtype, device=kwargs.get("device") or src.device)
        return out, kind, dict(params)
    return make


_FACTORIES: dict[Any, Callable[[tuple, dict], Fill]] = {
    aten.rand: _rand,
    aten.randn: _randn,
    aten.randint: _randint,
    aten.normal: _normal_float_float,
    aten.rand_like: _like("uniform", low=0.0, high=1.0),
    aten.randn_like: _like("normal", mean=0.0, std=1.0),
}


# ---------------------------------------------------------------- opaque init functions
def _trunc_normal(tensor: torch.Tensor, stream: int, mean: float = 0.0, std: float = 1.0,
                  a: float = -2.0, b: float = 2.0) -> None:
    """N(mean, std) truncated to [a, b]. For float32, bfloat16 and float16 tensors, by
    rejection: element ``i`` takes the portable normal of its stream (float32, ``* std +
    mean``), and while outside [a, b], that of a redraw stream at the same index. Each element
    depends on its index alone, and every step is one rounded float32 operation, so every
    device computes the same bits (as for ``normal_``). Where fewer than half the draws would
    land inside (tails), where an element is still outside after ``MAX_REDRAWS`` redraws (float32
    rounding can keep every value outside bounds narrower than its precision), and for
    float64: by inverse CDF in float64 through torch's ``ndtri``, whose last bit may differ
    between devices. The choice depends on the whole tensor's draws only: the same everywhere."""
    if not (tensor.dtype in (torch.float32, torch.bfloat16, torch.float16)
            and _acceptance(mean, std, a, b) >= _MIN_ACCEPTANCE
            and _trunc_normal_rejection(tensor, stream, mean, std, a, b)):
        _trunc_normal_inverse(tensor, stream, mean, std, a, b)
    tensor.clamp_(min=a, max=b)  # as torch's: a value rounded to a low precision stays inside


_MIN_ACCEPTANCE = 1 / 2
#: Redraws of an element before rejection gives up (at acceptance 1/2, 2^-64 of the elements).
MAX_REDRAWS = 64


def _acceptance(mean: float, std: float, a: float, b: float) -> float:
    """The probability that a draw of N(mean, std) lands in [a, b] (0 for a degenerate std)."""
    if not (std > 0 and math.isfinite(std)):
        return 0.0

    def cdf(x: float) -> float:
        return (1.0 + math.erf((x - mean) / (std * math.sqrt(2.0)))) / 2.0

    return cdf(b) - cdf(a)


def _trunc_normal_rejection(tensor: torch.Tensor, stream: int, mean: float, std: float, a: float, b: float) -> bool:
    """Rejection into ``tensor``; False (its values then meaningless) where some element stayed
    outside through ``MAX_REDRAWS`` redraws."""
    n, contiguous = tensor.numel(), tensor.is_contiguous()
    flat = tensor.view(-1) if contiguous else torch.empty(n, dtype=tensor.dtype, device=tensor.device)
    for start in range(0, n, portable.CHUNK):  # elements are independent: chunks cannot change a value
        size = min(portable.CHUNK, n - start)
        values = sample("normal", stream, start, size, torch.float32, tensor.device, mean=mean, std=std)
        outside = ((values < a) | (values > b)).nonzero().view(-1)
        redraw = 0
        while outside.numel():
            redraw += 1
            if redraw > MAX_REDRAWS:
                return False
            again = portable.normal24(outside + start, stream_key(stream, f"trunc_normal_ redraw {redraw}"))
            values[outside] = again.mul_(std).add_(mean)
            still = values[outside]
            outside = outside[(still < a) | (still > b)]
        flat[start:start + size] = values
    if not contiguous:
        tensor.copy_(flat.view(tensor.shape))
    return True


def _trunc_normal_inverse(tensor: torch.Tensor, stream: int, mean: float, std: float, a: float, b: float) -> None:
    def cdf(x: float) -> float:
        return (1.0 + math.erf(x / math.sqrt(2.0))) / 2.0

    lo, hi = cdf((a - mean) / std), cdf((b - mean) / std)
    n = tensor.numel()
    out = torch.empty(n, dtype=torch.float64, device=tensor.device)
    for start in range(0, n, portable.CHUNK):
        size = min(portable.CHUNK, n - start)
        u = sample("uniform", stream, start, size, torch.float64, tensor.device, low=lo, high=hi)
        out[start:start + size] = torch.special.ndtri(u.clamp(min=1e-300)) * std + mean
    tensor.copy_(out.clamp_(a, b).view(tensor.shape))


def _orthogonal(tensor: torch.Tensor, stream: int, gain: float = 1.0) -> None:
    """torch.nn.init.orthogonal_'s construction (QR of a normal matrix, signs fixed by R's
    diagonal) from a portable normal matrix."""
    if tensor.ndimension() < 2:
        raise ValueError("Only tensors with 2 or more dimensions are supported")
    if tensor.numel() == 0:
        return
    rows = tensor.size(0)
    cols = tensor.numel() // rows
    flat = fill_(torch.empty(rows, cols, dtype=torch.float32, device=tensor.device), "normal", stream,
                 mean=0.0, std=1.0)
    if rows < cols:
        flat = flat.t()
    q, r = torch.linalg.qr(flat)
    q *= torch.sign(torch.diag(r))
    if rows < cols:
        q = q.t()
    tensor.view_as(q).copy_(q)
    tensor.mul_(gain)


def _sparse(tensor: torch.Tensor, stream: int, sparsity: float, std: float = 0.01) -> None:
    if tensor.ndimension() != 2:
        raise ValueError("Only tensors with 2 dimensions are supported")
    rows, cols = tensor.shape
    num_zeros = int(math.ceil(sparsity * rows))
    fill_(tensor, "normal", stream, mean=0.0, std=std)
    for col in range(cols):
        zero_rows = randperm(stream_key(stream, f"sparse column {col}"), rows, tensor.device)[:num_zeros]
        tensor[zero_rows, col] = 0


def _dirac(tensor: torch.Tensor, stream: int, groups: int = 1) -> None:
    torch.nn.init.dirac_(tensor, groups)  # draws nothing


_OPAQUE: dict[str, Callable[..., None]] = {
    "trunc_normal_": _trunc_normal,
    "_no_grad_trunc_normal_": _trunc_normal,
    "orthogonal_": _orthogonal,
    "sparse_": _sparse,
    "dirac_": _dirac,
}
