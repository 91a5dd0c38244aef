"""Compiled fills: which portable fills run as compiled kernels (fxinit's own Triton kernel,
or kernels torch.compile generates), and which element-wise ops after them run inside the
same kernel (Inductor's only).

A uniform or normal fill of a contiguous float32, bfloat16 or float16 tensor is
``rng.portable.sample24`` (element-wise torch ops of the element index and the stream),
times a scale plus a shift, rounded to the tensor's dtype. An in-place chain that follows a
random factory on its own temporary (``torch.randn(n, m) * 0.02 + 1``; ``passes.inplace``)
joins the kernel when each op is exactly rounded (``+ - * /`` by a number, negation,
absolute value, clamping): compiled code computes them with the bits eager computes.
Transcendental ops (``exp``, ``tanh``...) stay out: their last bit may differ between
torch's kernels and generated code.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.ops import is_random
from fxinit.passes.cast_fusion import FusedCast
from fxinit.passes.fills import IN_PLACE_SAMPLERS, is_in_place_sampler
from fxinit.rng.portable_cuda import DTYPES as CUDA_DTYPES
from fxinit.rng.portable_triton import DTYPES as TRITON_DTYPES
from fxinit.spec import TensorSpec

aten = torch.ops.aten

#: Dtypes a compiled fill writes: those whose samples are ``sample24`` (24-bit units).
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
#: Kernel dtypes whose rounding compiled code may drop where float32 ops read the value after.
LOW_PRECISION = (torch.bfloat16, torch.float16)
#: Random factories whose values are one distribution of ``sample24``.
FACTORIES = {aten.rand: "uniform", aten.randn: "normal", aten.normal: "normal", aten.rand_like: "uniform",
             aten.randn_like: "normal"}
#: Element-wise ops that join a compiled fill's kernel: exactly rounded, so compiled code
#: gives eager's bits (``alpha`` of add/sub is refused: eager fuses it into a multiply-add).
CHAIN_OPS = frozenset({
    aten.add.Tensor, aten.add.Scalar, aten.sub.Tensor, aten.sub.Scalar, aten.mul.Tensor, aten.mul.Scalar,
    aten.div.Tensor, aten.div.Scalar, aten.neg.default, aten.abs.default, aten.clamp.default,
    aten.clamp_min.default, aten.clamp_max.default,
})


@dataclass(frozen=True)
class Kernel:
    """A portable fill run as one compiled kernel: samples of ``kind``, times a scale plus a
    shift, rounded to ``dtype``, then the element-wise ``chain`` (nodes whose values are the
    fill's, in order), then cast to ``cast`` if given (a fused cast)."""

    kind: str
    dtype: torch.dtype
    device: torch.device
    chain: tuple[fx.Node, ...] = ()
    cast: torch.dtype | None = None
    backend: str = "inductor"  # or one of fxinit's own kernels, ``TABLE_BACKENDS``: no chain

    @property
    def signature(self) -> tuple:
        """What the generated code depends on (sizes, offsets, streams and numbers are
        runtime arguments): one compiled kernel per distinct signature."""
        return (self.backend, self.kind, self.dtype, self.device.type, self.cast,
                tuple(_chain_signature(n) for n in self.chain))


BACKENDS = ("triton", "nvrtc", "inductor")
#: fxinit's own kernels (``rng.portable_triton``, ``rng.portable_cuda``): a fill with its scale,
#: shift and cast, no chain; any piece of a fill alone; a table of fills in one launch.
TABLE_BACKENDS = ("triton", "nvrtc")


def with_backend(kernel: Kernel, backend: str,
                 keeps_roundings: Callable[[torch.device], bool] = lambda device: True) -> Kernel | None:
    """``kernel`` run by ``backend``, or None where that backend cannot: fxinit's Triton kernel
    computes a fill, its scale and shift and a cast into float32, bfloat16 or float16, its
    CUDA kernel the same in float32 and bfloat16, neither a chain (the chain's ops then run
    on their own, as nodes). Inductor computes a chain and a cast after a bfloat16 or float16
    rounding only where it keeps that rounding (``keeps_roundings(device)``; torch 2.11 and
    2.12 fold ``x.to(bfloat16).float()`` into ``x``): elsewhere such a kernel ends at the
    rounding, and one with a cast runs uncompiled."""
    if backend not in BACKENDS:
        raise ValueError(f"no compiled-fill backend {backend!r}")
    if backend == "triton" and (kernel.cast or kernel.dtype) not in TRITON_DTYPES:
        return None
    if backend == "nvrtc" and not {kernel.dtype, kernel.cast or kernel.dtype} <= set(CUDA_DTYPES):
        return None
    chain = () if backend in TABLE_BACKENDS else kernel.chain
    cast = None if kernel.cast == kernel.dtype else kernel.cast
    if (backend == "inductor" and kernel.dtype in LOW_PRECISION and (chain or cast is not None)
            and not keeps_roundings(kernel.device)):
        if cast is not None:
            return None
        chain = ()
    return replace(kernel, backend=backend, chain=chain)


def _chain_signature(n: fx.Node) -> tuple:
    return (n.target, tuple(type(a).__name__ for a in n.args[1:]), tuple(sorted(n.kwargs)))


def compiled_fills(nodes: Sequence[fx.Node], in_place: Mapping[fx.Node, Any], fused: Mapping[fx.Node, FusedCast],
                   device_map: Mapping[torch.device, torch.device]) -> dict[fx.Node, Kernel]:
    """``{random node: Kernel}`` for the fills of the slice ``nodes`` that compile: plain
    in-place samplers and random factories of ``KERNEL_DTYPES`` into contiguous tensors
    (a fused cast's fill with its cast); ``in_place`` is the plan's in-place map."""
    users: dict[fx.Node, list[fx.Node]] = {}
    for n in nodes:
        for inp in n._input_nodes:
            users.setdefault(inp, []).append(n)
    out: dict[fx.Node, Kernel] = {}
    for n in nodes:
        if not is_random(n):
            continue
        if n in fused:
            f = fused[n]
            kind = _in_place_kind(n)
            spec = f.alloc.meta["spec"]
            if kind is not None and spec.dtype in KERNEL_DTYPES:
                out[n] = Kernel(kind, spec.dtype, _device(spec, device_map), cast=f.dtype)
            continue
        kind = _in_place_kind(n)
        if kind is not None:
            spec = n.args[0].meta.get("spec")  # type: ignore[union-attr]
            chain: tuple[fx.Node, ...] = ()
        else:
            kind = _factory_kind(n)
            spec = n.meta.get("spec")
            chain = _chain(n, in_place, users, spec.dtype if spec is not None else None)
            if spec is not None and not _divides_exactly(_device(spec, device_map)):
                chain = chain[:next((i for i, m in enumerate(chain) if m.target in _DIVISIONS), len(chain))]
        if kind is None or spec is None or spec.dtype not in KERNEL_DTYPES or not spec.is_contiguous():
            continue
        out[n] = Kernel(kind, spec.dtype, _device(spec, device_map), chain)
    return out


def _in_place_kind(n: fx.Node) -> str | None:
    if not is_in_place_sampler(n):
        return None
    kind = IN_PLACE_SAMPLERS[n.target.overloadpacket][0]
    return kind if kind in ("uniform", "normal") else None


def _factory_kind(n: fx.Node) -> str | None:
    packet = getattr(n.target, "overloadpacket", None)
    if packet is aten.normal and n.target is not aten.normal.float_float:
        return None  # a tensor mean or std
    return FACTORIES.get(packet)


_DIVISIONS = {aten.div.Tensor, aten.div.Scalar}


def _divides_exactly(device: torch.device) -> bool:
    """Whether compiled code for ``device`` divides with IEEE rounding: Triton's ``/`` is
    approximate unless the installed Inductor has ``eager_numerics.division_rounding``."""
    if device.type != "cuda":
        return True
    from torch._inductor import config

    return "eager_numerics.division_rounding" in config.get_config_copy()


def _device(spec: TensorSpec, device_map: Mapping[torch.device, torch.device]) -> torch.device:
    return device_map.get(spec.device, spec.device)


def _chain(start: fx.Node, in_place: Mapping[fx.Node, Any], users: Mapping[fx.Node, list[fx.Node]],
           dtype: torch.dtype | None) -> tuple[fx.Node, ...]:
    """The in-place element-wise nodes that follow factory ``start`` (of ``dtype``) on its
    value, in order, as long as the kernel can apply their numbers as eager does."""
    chain: list[fx.Node] = []
    value = start
    while True:
        following = users.get(value, [])
        if len(following) != 1:
            break
        n = following[0]
        if n not in in_place or n.target not in CHAIN_OPS or n.args[0] is not value:
            break
        if any(isinstance(a, fx.Node) for a in (*n.args[1:], *n.kwargs.values())):
            break  # another tensor: not a per-element function of the fill alone
        if n.kwargs.get("alpha", 1) != 1:
            break
        if dtype is None or number_rounding(n.target, dtype) is None:
            break
        chain.append(n)
        value = n
    return tuple(chain)


_PROBE_NUMBERS = (0.1, 0.3, 1 / 3, 0.02, 7.0, 257, 2049, -1.7)


@functools.lru_cache(maxsize=None)
def number_rounding(target: Any, dtype: torch.dtype) -> str | None:
    """How eager torch (CPU, the installed version) applies a Python number to a ``dtype``
    tensor in chain op ``target``: ``"float"``, as a float32 number (what a kernel computing
    in float32 does), or ``"dtype"``, rounded to ``dtype`` first (measured on torch 2.13:
    ``add`` and ``sub`` of bfloat16 and float16 tensors; ``mul`` and ``div`` do not); None
    when neither gives eager's bits, and the op stays out of kernels. Compiled kernels apply
    numbers the measured way, so they give the bits eager ops give (``backends.compiled``)."""
    if dtype == torch.float32:
        return "float"
    x = torch.linspace(-3, 3, 4099, dtype=torch.float32).to(dtype)
    found = None
    for how in ("float", "dtype"):
        same = True
        for number in _PROBE_NUMBERS:
            eager = _probe_call(target, x, number)
            applied = round_number(number, dtype) if how == "dtype" else number
            computed = _probe_call(target, x.float(), applied).to(dtype)
            if not torch.equal(eager.view(torch.int16), computed.view(torch.int16)):
                same = False
                break
        if same:
            found = how
            break
    return found


def round_number(number: Any, dtype: torch.dtype) -> Any:
    """``number`` rounded to ``dtype`` (an int stays an int)."""
    rounded = torch.tensor(float(number), dtype=torch.float64).to(dtype).item()
    return int(rounded) if isinstance(number, int) and not isinstance(number, bool) else rounded


def _probe_call(target: Any, x: torch.Tensor, number: Any) -> torch.Tensor:
    packet = target.overloadpacket
    if packet in (aten.neg, aten.abs):
        return target(x)
    if packet is aten.clamp:
        return target(x, -abs(number), abs(number))
    return target(x, number)
