"""Compiled portable fills: fxinit's own Triton kernel (``rng.portable_triton``: CUDA, the
default there), fxinit's own CUDA kernel compiled by NVRTC (``rng.portable_cuda``: CUDA where
Triton cannot run), or kernels torch.compile (Inductor) generates for the target device
(C++/OpenMP on CPU, Triton on CUDA: ``compile=True``), from the torch ops that define the stream.

A kernel computes ``rng.portable.sample24`` of element indices ``start ..``, times a scale
plus a shift, rounds to the tensor's dtype, applies the element-wise chain the plan put in it
(``passes.kernels``; Inductor's kernels only) and a fused cast, and writes the result straight
into the output tensor. Sizes, element offsets, stream constants and every number are runtime
arguments, so a model compiles one kernel per distinct ``Kernel.signature`` (a handful),
whatever its number of layers; Triton's and Inductor's caches keep them across processes.

Bits: each operation must stay rounded on its own, as the C kernel and eager torch ops
compute it. fxinit's Triton kernel is launched with ``enable_fp_fusion=False``, its CUDA kernel
compiled with ``--fmad=false`` (and checked against the torch-op twin on its GPU before its
first fill). Inductor's C++
backend compiles with ``-ffp-contract=off`` (no fused multiply-add) and vectorizes with
correctly rounded ``sqrt``; its Triton kernels are compiled with ``emulate_precision_casts``
(which turns ``enable_fp_fusion`` off and keeps every rounding to bfloat16/float16) and with
``eager_numerics.division_rounding`` (IEEE division). Square roots are ``sqrt_rn``.

Threads: Dynamo refuses to run a compiled function while any thread is inside an FX trace,
which its own compilation is; and a worker thread's grad mode differs from the caller's, which
made Dynamo recompile there. So every call of an Inductor kernel runs under ``torch.no_grad``
and holds one lock (its work is parallel inside: OpenMP on CPU, the GPU on CUDA).
fxinit's own kernels are plain launches.
"""

from __future__ import annotations

import functools
import os
import threading
import time
import types
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from fxinit.errors import DeferredInitError
from fxinit.ops import op_name
from fxinit.passes.batched_fills import BatchedFill
from fxinit.passes.cast_fusion import FusedCast
from fxinit.passes.fills import Ranges
from fxinit.passes.kernels import TABLE_BACKENDS, Kernel, number_rounding, round_number
from fxinit.rng import portable_cuda, portable_triton
from fxinit.rng.portable import Piece, sample24
from fxinit.backends.streams import PortableSampler, batched_affine, sampler_params

#: Below this many elements a fill runs eagerly (the same bits): a kernel call costs more.
MIN_ELEMENTS = 2

_INDUCTOR = {
    "emulate_precision_casts": True,  # Triton: no FMA contraction; every bf16/fp16 rounding kept
    "eager_numerics.division_rounding": True,  # Triton: IEEE division
    "cpp.enable_floating_point_contract_flag": "off",  # C++: no FMA contraction
    # C++: loops run on OpenMP's threads whatever the size the kernel was compiled for (sizes
    # are symbolic; Inductor otherwise decides from the first call's size, and caches that)
    "cpp.dynamic_threads": True,
}


@dataclass
class CompileStats:
    """What compiling cost in this process: kernels compiled and seconds spent compiling."""

    kernels: int = 0
    seconds: float = 0.0
    calls: int = 0


STATS = CompileStats()
_KERNELS: dict[tuple, Callable[..., None]] = {}
_LOCK = threading.RLock()


def _kernel_function(kernel: Kernel) -> Callable[..., None]:
    """The Python function torch.compile turns into ``kernel``'s code."""
    kind, dtype, cast = kernel.kind, kernel.dtype, kernel.cast
    chain = [(n.target, len(n.args) - 1, tuple(sorted(n.kwargs))) for n in kernel.chain]

    def fill(out: torch.Tensor, start: torch.Tensor, stream: torch.Tensor, scale: float, shift: float,
             *numbers: Any) -> None:
        i = torch.arange(out.shape[0], dtype=torch.int64, device=out.device) + start
        x = (sample24(kind, i, stream) * scale + shift).to(dtype)
        k = 0
        for target, n_args, keys in chain:
            args, kwargs = numbers[k:k + n_args], dict(zip(keys, numbers[k + n_args:k + n_args + len(keys)]))
            k += n_args + len(keys)
            # as eager computes a bfloat16/float16 op: in float32, rounded after each op (with
            # emulate_precision_casts Inductor keeps these roundings; on CPU it elides implicit ones)
            x = target(x.float(), *args, **kwargs).to(dtype)
        out.copy_(x if cast is None else x.to(cast))

    # Dynamo keeps compiled code per code object: a code object of its own per signature keeps
    # one kernel's guards from counting against another's recompile limit.
    code = fill.__code__.replace(co_name=f"fxinit_fill_{abs(hash(kernel.signature)):x}")
    return types.FunctionType(code, fill.__globals__, code.co_name, fill.__defaults__, fill.__closure__)


def compiled(kernel: Kernel) -> Callable[..., None]:
    """The compiled kernel of ``kernel``'s signature (compiled on its first call)."""
    key = kernel.signature
    fn = _KERNELS.get(key)
    if fn is None:
        with _LOCK:
            fn = _KERNELS.get(key)
            if fn is None:
                fn = _KERNELS[key] = torch.compile(_kernel_function(kernel), dynamic=True, fullgraph=True,
                                                   options=_inductor_options())
    return fn


def _inductor_options() -> dict[str, Any]:
    """``_INDUCTOR``, less what the installed torch's Inductor does not know (``passes.kernels``
    keeps divisions out of CUDA kernels when it has no IEEE division)."""
    from torch._inductor import config

    known = config.get_config_copy()
    return {k: v for k, v in _INDUCTOR.items() if k in known}


class CompiledSampler(PortableSampler):
    """Portable mode with the fills of ``kernels`` run as compiled kernels: the same values
    as ``PortableSampler`` (on CPU, bit for bit), other random ops as there."""

    def __init__(self, seed: int, keys: dict[fx.Node, str], kernels: dict[fx.Node, Kernel],
                 forwarded: frozenset[fx.Node] = frozenset(), batched: frozenset[fx.Node] = frozenset()) -> None:
        super().__init__(seed, keys)
        self.kernels = kernels
        self.forwarded = forwarded  # fills that copies draw from (``plan.forwards``): the table variant
        self.batched = batched  # fills run batched (``plan.batches``): the table variant alone
        self.uncompiled: set[tuple] = set()  # Inductor kernels' signatures this thread cannot compile

    def prepare(self, random_nodes: list[fx.Node]) -> None:
        """Compile every kernel the plan needs before anything runs, so that compiling is
        timed apart (``STATS``) and never happens on worker threads."""
        variants: dict[tuple, tuple[Kernel, set[str]]] = {}
        for n, k in self.kernels.items():
            wanted = variants.setdefault(k.signature, (k, set()))[1]
            if n not in self.batched:
                wanted.add("fill")
            if k.backend == "triton" and (n in self.forwarded or n in self.batched):
                wanted.add("table")  # Triton's other specialization
        for kernel, wanted in variants.values():
            if kernel.backend == "nvrtc":  # one kernel for every variant, compiled and checked when planned
                continue
            for variant in sorted(wanted):
                with _LOCK:  # exports plan and run on several threads
                    if (kernel.signature, variant) in _WARM:
                        continue
                    if kernel.backend == "inductor" and not compiles_on_this_thread():
                        self.uncompiled.add(kernel.signature)  # the same bits, by the torch ops it is made of
                        continue
                    started = time.perf_counter()
                    out = torch.empty(MIN_ELEMENTS + 1, dtype=kernel.cast or kernel.dtype, device=kernel.device)
                    if variant == "fill" and kernel.backend == "inductor":
                        _check_bits(kernel)
                    elif variant == "fill":
                        self._run(kernel, out, 0, 0, {"scale": 1.0, "shift": 0.0})
                    else:  # Triton's other specialization: a table of rows (``fill_runs``, ``fill_many``)
                        portable_triton.fill_runs(out, kernel.kind, [(0, 2, 0)], 0, 1.0, 0.0, dtype=kernel.dtype,
                                                  interpret=out.device.type == "cpu")
                    STATS.kernels += 1
                    STATS.seconds += time.perf_counter() - started
                    _WARM.add((kernel.signature, variant))

    def call(self, node: fx.Node, args: tuple, kwargs: dict) -> Any:
        kernel = self.kernels.get(node)
        if kernel is None:
            return super().call(node, args, kwargs)
        out, _, params = sampler_params(node, args, kwargs)
        self._fill(kernel, out.view(-1), self.streams[node], 0, params)
        return out

    def fill_batch(self, fills: list[tuple[fx.Node, BatchedFill, torch.Tensor]]) -> None:
        """Batched fills (``passes.batched_fills``): those of fxinit's own kernels in one launch
        per kernel, kind, dtype and device; the others as ``PortableSampler`` runs them. A
        launch fills its rows in no order, and the launches need none: the queued fills write
        storages of their own (``batched_fills`` queues no second fill of a storage)."""
        launches: dict[tuple, list[Piece]] = {}
        rest = []
        for node, fill, t in fills:
            kernel = self.kernels.get(node)
            if kernel is None or kernel.backend not in TABLE_BACKENDS:
                rest.append((node, fill, t))
                continue
            launches.setdefault((kernel.backend, kernel.kind, t.dtype, t.device), []).append(
                (t, ((0, t.numel(), 0),), self.streams[node], *batched_affine(fill)))
        for (backend, kind, dtype, _), pieces in launches.items():
            fill_table(backend, kind, pieces, dtype)
        if rest:
            super().fill_batch(rest)

    def fill_pieces(self, node: fx.Node, args: tuple, kwargs: dict, pieces: Ranges) -> None:
        kernel = self.kernels.get(node)
        if kernel is None:
            return super().fill_pieces(node, args, kwargs, pieces)
        _, _, params = sampler_params(node, args, kwargs)
        flat = args[0].view(-1)
        for lo, hi in pieces:
            self._fill(kernel, flat[lo:hi], self.streams[node], lo, params)

    def fill_runs(self, node: fx.Node, runs: Any, out: torch.Tensor) -> None:
        """A copy's draws (``plan.forwards``): by fxinit's own kernel in one launch."""
        kernel = self.kernels.get(node)
        if kernel is None or kernel.backend not in TABLE_BACKENDS:
            return super().fill_runs(node, runs, out)
        target = torch.empty(node.args[0].meta["spec"].shape, dtype=kernel.dtype, device="meta")
        _, _, params = sampler_params(node, (target, *node.args[1:]), dict(node.kwargs))
        fill_table(kernel.backend, kernel.kind, [(out, runs, self.streams[node], float(params["scale"]),
                                                  float(params["shift"]))], kernel.dtype)

    def fill_cast(self, fused: FusedCast, out: torch.Tensor) -> None:
        kernel = self.kernels.get(fused.fill)
        if kernel is None:
            return super().fill_cast(fused, out)
        spec = fused.alloc.meta["spec"]
        target = torch.empty(spec.shape, dtype=spec.dtype, device="meta")  # what the fill would have filled
        _, _, params = sampler_params(fused.fill, (target, *fused.fill.args[1:]), dict(fused.fill.kwargs))
        self._fill(kernel, out.view(-1), self.streams[fused.fill], 0, params)

    def _fill(self, kernel: Kernel, flat: torch.Tensor, stream: int, first: int, params: dict[str, Any]) -> None:
        """Elements ``first ..`` of ``kernel``'s fill, into contiguous ``flat``."""
        if kernel.backend == "inductor" and (flat.numel() < MIN_ELEMENTS or kernel.signature in self.uncompiled):
            # the same bits, eagerly
            _kernel_function(kernel)(flat, torch.tensor(first, device=flat.device), stream,
                                     float(params["scale"]), float(params["shift"]), *_numbers(kernel))
            return
        self._run(kernel, flat, stream, first, params)

    @staticmethod
    def _run(kernel: Kernel, flat: torch.Tensor, stream: int, first: int, params: dict[str, Any]) -> None:
        device = flat.device
        STATS.calls += 1
        if kernel.backend == "triton":
            portable_triton.fill(flat, kernel.kind, first, stream, float(params["scale"]), float(params["shift"]),
                                 dtype=kernel.dtype, interpret=device.type == "cpu")
            return
        if kernel.backend == "nvrtc":
            portable_cuda.fill_many(kernel.kind, [(flat, ((first, first + flat.numel(), 0),), stream,
                                                   float(params["scale"]), float(params["shift"]))], kernel.dtype)
            return
        with _LOCK, torch.no_grad():
            compiled(kernel)(flat, torch.tensor(first, dtype=torch.int64, device=device),
                             torch.tensor(stream, dtype=torch.int64, device=device),
                             float(params["scale"]), float(params["shift"]), *_numbers(kernel))


def _check_bits(kernel: Kernel) -> None:
    """Compile ``kernel`` and check its bits against the torch ops that define portable values
    (the function it is compiled from, run eagerly): a compiler that computes otherwise (torch
    2.11's Inductor dropped the roundings ``passes.kernels`` now leaves out of its kernels) is
    refused, not trusted."""
    probe = dict(scale=0.37, shift=-0.11)  # a scale and shift that leave every sample's rounding to do
    first, stream = 1_000_003, 0x5EED
    got = torch.empty(_PROBE_ELEMENTS, dtype=kernel.cast or kernel.dtype, device=kernel.device)
    want = torch.empty_like(got)
    CompiledSampler._run(kernel, got, stream, first, probe)
    with torch.no_grad():
        _kernel_function(kernel)(want, torch.tensor(first, device=want.device), stream, probe["scale"],
                                 probe["shift"], *_numbers(kernel))
    bits = torch.int16 if want.element_size() == 2 else torch.int32
    if not torch.equal(got.view(bits), want.view(bits)):
        steps = " -> ".join([kernel.kind, str(kernel.dtype).removeprefix("torch."),
                             *(op_name(n) for n in kernel.chain),
                             *([str(kernel.cast).removeprefix("torch.")] if kernel.cast else [])])
        raise DeferredInitError(
            f"compile=True: the kernel torch.compile generates for the portable fill {steps} on "
            f"{kernel.device.type} gives other bits than the torch ops that define it (torch {torch.__version__})",
            hint="materialize with compile=None (fxinit picks its own kernels) or compile=False")


_PROBE_ELEMENTS = 4099


#: torch 2.11's Dynamo crashes the process (a segmentation fault) where the main thread compiles
#: after another thread did; 2.12 fixed it.
_COMPILING_OFF_THE_MAIN_THREAD_CRASHES = tuple(map(int, torch.__version__.split(".")[:2])) < (2, 12)


def compiles_on_this_thread() -> bool:
    """Whether torch.compile may run on this thread: on torch 2.11 the main thread's later
    compiles (fxinit's, or the caller's training step) would crash the process after a
    compile on another one, so there Inductor kernels a worker thread (an export's) needs
    run as the torch ops they are made of: the same bits, slower."""
    return not _COMPILING_OFF_THE_MAIN_THREAD_CRASHES or threading.current_thread() is threading.main_thread()


def inductor_keeps_roundings(device: torch.device) -> bool:
    """Whether Inductor's code for ``device`` keeps a rounding to bfloat16 or float16 that
    float32 ops read after (``x.to(torch.bfloat16).float()``), as eager does: torch 2.13's
    does with ``emulate_precision_casts``; 2.11's and 2.12's fold the two casts into none
    (a joint-graph pattern, and the C++ code's cache of converted values). Asked of the
    installed torch once per device type, by compiling a probe."""
    if not compiles_on_this_thread():
        return False  # (torch 2.11's does not)
    return _keeps_roundings(device.type)


@functools.lru_cache(maxsize=None)
def _keeps_roundings(device_type: str) -> bool:
    def rounded(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.to(torch.bfloat16).float() * 3, x.to(torch.float16).float() * 3

    x = torch.linspace(1 / 3, 7 / 3, 1031, device=device_type)  # most of them other in both dtypes
    started = time.perf_counter()
    with _LOCK, torch.no_grad():
        got = torch.compile(rounded, dynamic=True, fullgraph=True, options=_inductor_options())(x)
        STATS.seconds += time.perf_counter() - started
    return all(torch.equal(g, w) for g, w in zip(got, rounded(x)))


def fill_table(backend: str, kind: str, pieces: list[Piece], dtype: torch.dtype) -> None:
    """``pieces`` (``rng.portable.fill_table``) in one launch of fxinit's ``backend`` kernel."""
    STATS.calls += 1
    if backend == "triton":
        portable_triton.fill_many(kind, pieces, dtype, interpret=pieces[0][0].device.type == "cpu")
    else:
        portable_cuda.fill_many(kind, pieces, dtype)


_WARM: set[tuple] = set()  # (signature, variant) compiled in this process


def _numbers(kernel: Kernel) -> tuple:
    """The numbers of ``kernel``'s chain, in the order the kernel takes them (runtime
    arguments: they are not part of the compiled code), rounded to the kernel's dtype where
    eager ops round them (``passes.kernels.number_rounding``)."""
    out = []
    for n in kernel.chain:
        rounds = number_rounding(n.target, kernel.dtype) == "dtype"
        for v in (*n.args[1:], *(n.kwargs[k] for k in sorted(n.kwargs))):
            out.append(round_number(v, kernel.dtype) if rounds and isinstance(v, (int, float)) else v)
    return tuple(out)


def compile_available(device: torch.device) -> str | None:
    """Why torch.compile cannot generate kernels for ``device`` here, or None if it can."""
    return _why_not(device.type)


@functools.lru_cache(maxsize=None)
def _why_not(device_type: str) -> str | None:
    try:
        if device_type == "cuda":
            from torch.utils._triton import has_triton

            return None if has_triton() else "Triton is not installed"
        if device_type == "cpu":
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
            return None
        return f"fxinit compiles fills for cpu and cuda, not {device_type}"
    except Exception as exc:  # no C++ compiler, a broken install
        return f"{type(exc).__name__}: {exc}"


def triton_available(device: torch.device) -> str | None:
    """Why fxinit's Triton kernel cannot fill tensors on ``device`` here, or None if it can:
    CUDA with Triton installed, or a CPU under Triton's interpreter (``TRITON_INTERPRET=1``)."""
    why = portable_triton.available()
    if why is not None:
        return why
    if device.type == "cuda":
        return None if _triton_compiles_for_cuda() else "Triton cannot compile for this GPU (torch's has_triton())"
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "on the CPU it runs only under Triton's interpreter, to check bits: set TRITON_INTERPRET=1"
    return f"fxinit's Triton kernel fills cuda tensors, not {device.type}"


@functools.lru_cache(maxsize=None)
def _triton_compiles_for_cuda() -> bool:
    """torch's own answer: a GPU of compute capability 7.0 or more, and a working Triton."""
    try:
        from torch.utils._triton import has_triton

        return has_triton()
    except Exception:  # noqa: BLE001 - a broken install: no
        return False


def nvrtc_available(device: torch.device) -> str | None:
    """Why fxinit's CUDA kernel cannot fill tensors on ``device`` here, or None if it can (the
    first answer on a device compiles or loads the kernel and checks its bits there: that
    time counts as compiling, ``STATS``)."""
    with _LOCK:
        started = time.perf_counter()
        why = portable_cuda.available(device)
        if (device.type, device.index) not in _NVRTC_TIMED:
            _NVRTC_TIMED.add((device.type, device.index))
            STATS.kernels += why is None
            STATS.seconds += time.perf_counter() - started
    return why


_NVRTC_TIMED: set[tuple] = set()


def refuse(device: torch.device, why: str, asked: str = "compile=True") -> DeferredInitError:
    what = {"compile='triton'": f"fxinit's Triton kernel cannot fill {device} tensors",
            "compile='nvrtc'": f"fxinit's CUDA kernel cannot fill {device} tensors"}.get(
                asked, f"torch.compile cannot generate kernels for {device}")
    return DeferredInitError(f"{asked}: {what} here ({why})",
                             hint="materialize with compile=None (fxinit picks) or compile=False")
