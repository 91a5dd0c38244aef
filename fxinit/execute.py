"""The one execution pipeline: slice, plan, interpret.

Every value fxinit computes from an init graph comes through here, whether the graph is a
live trace's (``capture.recorder.Recorder``: ``materialize``, and values Python asks for
while recording) or a self-contained ``InitGraph`` (``InitGraph.materialize``, exports):

1. ``passes.slicing``: the nodes the requested values need, without dead writes;
2. ``plan.make_plan``: everything the passes decide about that slice (``print(plan)``);
3. ``backends.parallel.run_plan``: the interpreter runs it, random ops drawing from the
   snapshots (exact), the portable streams, or compiled kernels of those streams.
"""

from __future__ import annotations

import functools

import weakref
from typing import Any, Callable, Iterable, Mapping, Protocol

import torch
import torch.fx as fx

from fxinit.backends.compiled import (CompiledSampler, compile_available, inductor_keeps_roundings, nvrtc_available, refuse,
                                      triton_available)
from fxinit.backends.exact import ExactSampler
from fxinit.backends.interpreter import Sampler
from fxinit.backends.parallel import run_plan
from fxinit.backends.streams import PortableSampler
from fxinit.errors import DeferredInitError
from fxinit.init_bodies import body_fingerprint
from fxinit.numerics import Numerics, Settings
from fxinit.ops import op_name
from fxinit.passes.dead_init import dead_writes
from fxinit.passes.ranges import Extent
from fxinit.passes.slicing import Slicer, Target
from fxinit.passes.stream_keys import stream_keys
from fxinit.passes.uninitialized import unwritten_reads
from fxinit.plan import DeviceMap, Plan, make_plan
from fxinit.rng import Snapshot
from fxinit.rng.kernel_fingerprints import fingerprint
from fxinit.rng.native import portable_library


class Program(Protocol):
    """What the pipeline reads of a graph: a live trace or an InitGraph."""

    graph: fx.Graph
    constants: dict[str, torch.Tensor]
    snapshots: dict[str, Snapshot]
    default_dtype: torch.dtype
    numerics: Numerics | None

    def storage_names(self) -> dict[int, str]: ...


def op_nodes(program: Program) -> list[fx.Node]:
    """The op nodes of ``program``'s graph in program order (no placeholder, no output)."""
    return [n for n in program.graph.nodes if n.op not in ("output", "placeholder")]


# Per graph, as long as it does not grow: its dead writes and slicers (with and without them).
_INDEX: "weakref.WeakKeyDictionary[fx.Graph, tuple[int, dict[Any, Any]]]" = weakref.WeakKeyDictionary()


def _indexed(program: Program, key: Any, make: Any) -> Any:
    graph = program.graph
    size = len(graph.nodes)
    entry = _INDEX.get(graph)
    if entry is None or entry[0] != size:
        entry = _INDEX[graph] = (size, {})
    if key not in entry[1]:
        entry[1][key] = make()
    return entry[1][key]


def program_dead_writes(program: Program) -> set[fx.Node]:
    """Writes of ``program`` overwritten before anything reads them (``passes.dead_init``)."""
    return _indexed(program, "dead", lambda: dead_writes(op_nodes(program)))


def slicer(program: Program, eliminate_dead: bool = True) -> Slicer:
    """The ``Slicer`` of ``program``'s graph as it is now."""
    return _indexed(program, ("slicer", eliminate_dead), lambda: Slicer(
        op_nodes(program), program_dead_writes(program) if eliminate_dead else frozenset()))


def plan(program: Program, targets: Iterable[Target], *, rng: str = "exact", seed: int | None = None,
         dtype: torch.dtype | None = None, exposed: Mapping[fx.Node, Extent] | None = None,
         devices: Callable[[list[fx.Node]], DeviceMap] | None = None, eliminate_dead: bool = True,
         compile: bool | str | None = False, labels: Mapping[fx.Node, str] | None = None) -> Plan:
    """The plan computing ``targets`` (``(value node, storage id)``) of ``program``: exact
    (eager's values) or portable (the streams of ``seed``), cast to ``dtype`` by
    ``Module.to``'s rule; ``exposed`` as for ``plan.make_plan``; ``devices(slice)``: the
    plan's ``device_map`` (unavailable devices the slice asks for, and what runs instead).
    ``compile`` (portable mode): which compiled kernels run the fills (``compiles``).
    ``labels``: names of the targets, for printing (default: the names of their storages)."""
    targets = list(targets)
    nodes, dead = slicer(program, eliminate_dead).required(targets, to_run=True)
    keys = stream_keys(op_nodes(program), program.storage_names()) if rng == "portable" else None
    return make_plan(nodes, {node for node, _ in targets}, rng=rng, seed=seed, streams=keys, output_dtype=dtype,
                     exposed=exposed, device_map=devices(nodes) if devices is not None else None, dead=dead,
                     compiles=compiles(compile) if rng == "portable" else None,
                     keeps_roundings=inductor_keeps_roundings,
                     labels=labels if labels is not None else functools.partial(_storage_labels, program, targets))


def refuse_changed_init_functions(nodes: Iterable[fx.Node]) -> None:
    """Exact replay of an opaque node whose init function is not the one that ran at capture
    (a graph saved with another torch) would give other values than eager's, silently:
    refused, naming the function."""
    for n in nodes:
        recorded = n.meta.get("body")
        if recorded and n.meta.get("opaque") and recorded != body_fingerprint(n.meta["opaque"]):
            raise DeferredInitError(
                f"{n.meta['opaque']} of this torch ({torch.__version__}) is not the one this init graph was "
                f"recorded with (node {n.name}): replaying it would not give eager's values",
                op=n.meta["opaque"], module=n.meta.get("module"), source=getattr(n.meta.get("prov"), "source", None),
                hint="trace the model again with this torch, materialize with the torch the graph was saved "
                     "with, or use rng='portable' (fxinit's own samplers)")


def refuse_changed_kernels(nodes: Iterable[fx.Node]) -> None:
    """Exact replay of a CPU random node recorded with other random kernels than this torch's
    (a graph saved with torch 2.12, whose bfloat16 samplers draw otherwise than 2.13's) would
    give other values than eager's, silently: refused, naming the op and the dtype."""
    for n in nodes:
        recorded = n.meta.get("kernels")
        if recorded is None:
            continue
        spec = n.meta.get("spec") or n.args[0].meta["spec"]
        if recorded != fingerprint(spec.dtype):
            raise DeferredInitError(
                f"torch {torch.__version__} draws other {spec.dtype} random numbers on the CPU than the torch this "
                f"init graph was recorded with (node {n.name}, {op_name(n)}): replaying it would not give eager's "
                "values", op=str(n.target), module=n.meta.get("module"),
                source=getattr(n.meta.get("prov"), "source", None),
                hint="trace the model again with this torch, materialize with the torch the graph was saved with, "
                     "or use rng='portable' (fxinit's own samplers, the same values with any torch)")


def refuse_inexact(nodes: Iterable[fx.Node]) -> None:
    """A node recorded on the meta path of an op that eager runs with another kernel on the
    target device (``capture.branches.inexact_branch``) would give other bits than eager's,
    silently: refused where a value needs it, naming the op and the source line."""
    for n in nodes:
        why = n.meta.get("inexact")
        if why:
            raise DeferredInitError(
                f"fxinit cannot give eager's values here: {why}, a kernel fxinit does not rebuild, and a "
                f"materialized tensor's value depends on it (node {n.name})",
                op=str(n.target), module=n.meta.get("module"), source=getattr(n.meta.get("prov"), "source", None),
                hint="compute it after fxinit.materialize (on the real tensors), or turn that kernel off around "
                     "both eager construction and trace_init (torch.backends.cudnn.flags(enabled=False), "
                     "torch.nn.attention.sdpa_kernel(SDPBackend.MATH))")


def _storage_labels(program: Program, targets: list[Target]) -> dict[fx.Node, str]:
    """The targets' names: their storages' (found when a plan is printed: naming walks the model)."""
    names = program.storage_names()
    return {node: names[sid] for node, sid in targets if sid in names}


def compiles(compile: bool | str | None) -> Callable[[torch.device], str | None] | None:
    """Which backend runs portable fills on a device as compiled kernels (``"triton"``,
    ``"nvrtc"``, ``"inductor"``) or None. ``None`` (fxinit picks, measured or known fastest):
    on CUDA fxinit's own Triton kernel (torch ops make ~40 passes over memory per fill; the
    kernel makes one and never enters Dynamo), or where Triton cannot run, fxinit's CUDA
    kernel compiled by NVRTC (``rng.portable_cuda``: no Triton, no C++ compiler); on the CPU
    fxinit's C kernel (which beats Inductor's code there: a float32 normal in 1.4 ns against
    7.8 ns on one AVX2 core), and Inductor only where neither exists but a C++ compiler does.
    ``True``: kernels torch.compile (Inductor) generates; ``"triton"``: fxinit's Triton kernel
    (on a CPU tensor only under Triton's interpreter, ``TRITON_INTERPRET=1``, to check bits);
    ``"nvrtc"``: fxinit's CUDA kernel (on a CPU tensor only compiled as C, with
    ``FXINIT_NVRTC_ON_CPU=1``, to check bits); each refused with ``DeferredInitError`` where
    it cannot run. ``False``: never (None)."""
    if compile not in (None, True, False, "triton", "nvrtc"):
        raise ValueError(f"compile={compile!r}: choose True, False, None, 'triton' or 'nvrtc'")
    if compile is False:
        return None

    def on(device: torch.device) -> str | None:
        if compile in ("triton", "nvrtc"):
            why = (triton_available if compile == "triton" else nvrtc_available)(device)
            if why is not None:
                raise refuse(device, why, f"compile={compile!r}")
            return compile
        why = compile_available(device)
        if compile is True:
            if why is not None:
                raise refuse(device, why)
            return "inductor"
        if device.type == "cuda":
            if triton_available(device) is None:
                return "triton"
            return "nvrtc" if nvrtc_available(device) is None else None
        return "inductor" if why is None and portable_library() is None else None

    return on


def unwritten(plan: Plan, targets: Iterable[Target]) -> list[tuple[fx.Node, fx.Node]]:
    """``passes.uninitialized`` for a plan: ``[(reader, allocation)]`` of memory no op wrote."""
    return unwritten_reads(plan.nodes, targets)


def sampler_for(program: Program, plan: Plan) -> Sampler:
    """How ``plan``'s random nodes draw."""
    if plan.rng == "portable":
        assert plan.seed is not None
        if plan.kernels:
            return CompiledSampler(plan.seed, plan.streams, plan.kernels,
                                   frozenset(f.fill for fs in plan.forwards.values() for f in fs),
                                   frozenset(plan.batches.fills))
        return PortableSampler(plan.seed, plan.streams)
    return ExactSampler(program.snapshots)


def run(program: Program, plan: Plan, workers: int | None = None) -> dict[fx.Node, Any]:
    """The values of ``plan``'s kept nodes."""
    if plan.rng == "exact":
        refuse_changed_init_functions(plan.nodes)
        refuse_changed_kernels(plan.nodes)
        refuse_inexact(plan.nodes)
    return run_plan(plan, program.constants, sampler_for(program, plan), Settings(program.default_dtype, program.numerics),
                    workers)
