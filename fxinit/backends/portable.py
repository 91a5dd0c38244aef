"""Portable replay of random ops: each draws from the counter-based stream of its key.

``stream_keys`` names every random op of a graph once, from the whole captured graph (so
a subset or another order gives the same names); ``call_portable`` runs one random node
with the portable samplers of ``fxinit.rng.portable``. Non-random ops run as in exact mode.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.errors import DeferredInitError
from fxinit.backends.partial import CHUNK
from fxinit.ops import call_init_function
from fxinit.rng import portable
from fxinit.rng.portable import fill_, randperm, sample, stream_key

aten = torch.ops.aten
_SKIP_MIN = 1 << 13  # elements


def stream_keys(nodes: Sequence[fx.Node], storage_names: Mapping[int, str]) -> dict[fx.Node, str]:
    """``{random node: key}``: ``"<name of the tensor it writes>/<k>"`` for the k-th random op
    writing that tensor's storage, else ``"<module path>:<op>/<k>"`` for temporaries."""
    counters: dict[str, int] = defaultdict(int)
    keys: dict[fx.Node, str] = {}
    for n in nodes:
        if not n.meta.get("generators"):
            continue
        written = [storage_names[s] for s in n.meta.get("mutates", ()) if s in storage_names]
        if written:
            base = min(written)
        else:
            op = getattr(getattr(n.target, "overloadpacket", n.target), "__name__", "op")
            base = f"{n.meta.get('module') or ''}:{n.meta.get('opaque') or op}"
        keys[n] = f"{base}/{counters[base]}"
        counters[base] += 1
    return keys


def streams_for(nodes: Sequence[fx.Node], storage_names: Mapping[int, str], seed: int) -> dict[fx.Node, int]:
    return {n: stream_key(seed, key) for n, key in stream_keys(nodes, storage_names).items()}


def call_portable(node: fx.Node, args: tuple, kwargs: dict, stream: int) -> Any:
    """Run random ``node`` on the portable stream ``stream`` (args already evaluated)."""
    kwargs = {k: v for k, v in kwargs.items() if k != "generator"}
    if node.target is call_init_function:
        qualname, tensor = args[0], args[1]
        fn = _OPAQUE.get(qualname.rsplit(".", 1)[-1])
        if fn is None:
            raise _unsupported(node, qualname)
        with torch.no_grad():
            fn(tensor, stream, *args[2:], **kwargs)
        return tensor
    packet = node.target.overloadpacket
    if packet in _INPLACE:
        kind, params = _sampler(node, args[0], args[1:], kwargs)
        return fill_(args[0], kind, stream, **params)
    factory = _FACTORIES.get(packet)
    if factory is not None:
        return factory(node, args, kwargs, stream)
    raise _unsupported(node, str(node.target))


def fill_piece_portable(node: fx.Node, args: tuple, kwargs: dict, stream: int, ranges: list[tuple[int, int]]) -> bool:
    """Fill the elements in ``ranges`` of in-place random ``node``'s contiguous target with
    the stream's same elements; False when the op is not a plain in-place sampler."""
    target = args[0]
    if getattr(node.target, "overloadpacket", None) not in _INPLACE or not isinstance(target, torch.Tensor) \
            or not target.is_contiguous():
        return False
    kind, params = _sampler(node, target, args[1:], kwargs)
    flat = target.view(-1)
    pieces: list[tuple[int, int]] = []
    for lo, hi in ranges:  # a call per range costs ~10 us: short gaps are drawn, not skipped
        if pieces and lo - pieces[-1][1] < _SKIP_MIN:
            pieces[-1] = (pieces[-1][0], hi)
        else:
            pieces.append((lo, hi))
    for lo, hi in pieces:
        fill_(flat[lo:hi], kind, stream, first=lo, **params)
    return True


def fills_pieces_portable(node: fx.Node) -> bool:
    """Whether ``fill_piece_portable`` can fill pieces of random ``node``'s target (a plain
    in-place sampler on a contiguous target), decided from the graph alone."""
    target = node.args[0] if node.args else None
    spec = target.meta.get("spec") if isinstance(target, fx.Node) else None
    if getattr(node.target, "overloadpacket", None) not in _INPLACE or spec is None:
        return False
    meta = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")
    return meta.is_contiguous() and not any(isinstance(a, fx.Node) for a in (*node.args[1:], *node.kwargs.values()))


def fill_in_chunks_portable(node: fx.Node, rest: tuple, kwargs: dict, stream: int, dtype: torch.dtype, n: int,
                            sink: Callable[[int, int, torch.Tensor], None] | None = None) -> bool:
    """``backends.partial.fill_in_chunks_exact`` on the portable stream: elements ``lo .. hi``
    of the fill are the stream's elements ``lo .. hi``, so any split is exact."""
    if getattr(node.target, "overloadpacket", None) not in _INPLACE:
        return False
    if sink is None:
        return True
    scratch = torch.empty(CHUNK, dtype=dtype)
    kind, params = _sampler(node, scratch, rest, kwargs)
    for lo in range(0, n, CHUNK):
        piece = scratch[:min(CHUNK, n - lo)]
        fill_(piece, kind, stream, first=lo, **params)
        sink(lo, lo + piece.numel(), piece)
    return True


def _sampler(node: fx.Node, target: torch.Tensor, rest: tuple, kwargs: dict) -> tuple[str, dict[str, Any]]:
    """The distribution and parameters of in-place random ``node`` writing ``target``."""
    packet = node.target.overloadpacket
    kind, names = _INPLACE[packet]
    params = _bind(node, (target, *rest), {k: v for k, v in kwargs.items() if k != "generator"}, names)
    if packet is aten.random_:
        params = _random_range(node, target, params)
    return kind, params


def _unsupported(node: fx.Node, what: str) -> DeferredInitError:
    return DeferredInitError(f"no portable implementation of {what}",
                             op=str(node.target), module=node.meta.get("module"),
                             hint="materialize with rng='exact', or report the init function you need")


# in-place samplers: packet -> (distribution, [(schema argument, parameter, default)])
_INPLACE: dict[Any, tuple[str, list[tuple[str, str, float]]]] = {
    aten.uniform_: ("uniform", [("from", "low", 0.0), ("to", "high", 1.0)]),
    aten.normal_: ("normal", [("mean", "mean", 0.0), ("std", "std", 1.0)]),
    aten.bernoulli_: ("bernoulli", [("p", "p", 0.5)]),
    aten.exponential_: ("exponential", [("lambd", "lambd", 1.0)]),
    aten.cauchy_: ("cauchy", [("median", "median", 0.0), ("sigma", "sigma", 1.0)]),
    aten.log_normal_: ("log_normal", [("mean", "mean", 1.0), ("std", "std", 2.0)]),
    aten.geometric_: ("geometric", [("p", "p", 0.5)]),
    aten.random_: ("random", [("from", "low", 0.0), ("to", "high", None)]),  # type: ignore[list-item]
}


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


def _new(node: fx.Node, kwargs: dict, shape: Sequence[int], default: torch.dtype) -> torch.Tensor:
    dtype = kwargs.get("dtype") or default
    return torch.empty(tuple(shape), dtype=dtype, device=kwargs.get("device") or "cpu")


def _rand(node: fx.Node, args: tuple, kwargs: dict, stream: int) -> torch.Tensor:
    return fill_(_new(node, kwargs, args[0], torch.get_default_dtype()), "uniform", stream, low=0.0, high=1.0)


def _randn(node: fx.Node, args: tuple, kwargs: dict, stream: int) -> torch.Tensor:
    return fill_(_new(node, kwargs, args[0], torch.get_default_dtype()), "normal", stream, mean=0.0, std=1.0)


def _randint(node: fx.Node, args: tuple, kwargs: dict, stream: int) -> torch.Tensor:
    low, high, size = (0, *args[:2]) if len(args) == 2 else args[:3]
    return fill_(_new(node, kwargs, size, torch.int64), "random", stream, low=low, high=high)


def _randperm(node: fx.Node, args: tuple, kwargs: dict, stream: int) -> torch.Tensor:
    perm = randperm(stream, args[0], kwargs.get("device") or "cpu")
    return perm.to(kwargs.get("dtype") or torch.int64)


def _normal_float_float(node: fx.Node, args: tuple, kwargs: dict, stream: int) -> torch.Tensor:
    mean, std, size = args[:3]
    return fill_(_new(node, kwargs, size, torch.get_default_dtype()), "normal", stream, mean=mean, std=std)


def _like(kind: str, **params: float) -> Callable[..., torch.Tensor]:
    def make(node: fx.Node, args: tuple, kwargs: dict, stream: int) -> torch.Tensor:
        src = args[0]
        out = torch.empty(src.shape, dtype=kwargs.get("dtype") or src.dtype, device=kwargs.get("device") or src.device)
        return fill_(out, kind, stream, **params)
    return make


_FACTORIES: dict[Any, Callable[..., torch.Tensor]] = {
    aten.rand: _rand,
    aten.randn: _randn,
    aten.randint: _randint,
    aten.randperm: _randperm,
    aten.rand_like: _like("uniform", low=0.0, high=1.0),
    aten.randn_like: _like("normal", mean=0.0, std=1.0),
}
_FACTORIES[aten.normal] = _normal_float_float


# ---------------------------------------------------------------- opaque init functions
def _trunc_normal(tensor: torch.Tensor, stream: int, mean: float = 0.0, std: float = 1.0,
                  a: float = -2.0, b: float = 2.0) -> None:
    """Inverse-CDF sampling of N(mean, std) truncated to [a, b] (in float64)."""
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
