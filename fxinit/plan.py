"""The plan of a run: what the passes decided about one slice, as data a reader can print.

``make_plan`` runs the passes over a slice (``passes.slicing``) and keeps every decision
in a ``Plan``: which nodes run, which dead writes were skipped, which values are reused
(CSE), which element-wise ops run in place, which random fills fill only pieces or run in
chunks, which copies copy only part of their output and which draw it themselves
(``passes.forwarding``), which factories of zeros write only the part read, which fills
are cast chunk by chunk, where requested dtypes are applied, when each
value is freed, and which groups of nodes are independent. ``backends.interpreter`` runs a
plan without deciding anything; ``InitGraph.stats`` reads one; ``print(plan)`` shows it.
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Callable, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.ops import allocates, is_random, op_name
from fxinit.passes.batched_fills import NO_BATCHES, Batches, batched_fills
from fxinit.passes.cast_fusion import FusedCast, cast_points, fused_casts
from fxinit.passes.cse import common_subexpressions
from fxinit.passes.fills import Ranges, draws_alone, exact_chunks, exact_pieces, is_in_place_sampler, portable_pieces
from fxinit.passes.inplace import in_place_chains
from fxinit.passes.kernels import TABLE_BACKENDS, Kernel, compiled_fills, with_backend
from fxinit.passes.partition import independent_groups
from fxinit.passes.demand import partial_constants, partial_copies, partial_fills
from fxinit.passes.forwarding import Forward, forwarded_demand
from fxinit.passes.roots import shared_roots
from fxinit.passes.unbacked import unbacked_allocations
from fxinit.passes.ranges import Extent
from fxinit.rng.pieces import CHUNK
from fxinit.spec import cast_by_to

DeviceMap = Mapping[torch.device, torch.device]


@dataclass
class Plan:
    """How to run one slice of an init graph (see the module doc). Every field is a
    decision of a pass; nothing here is decided again while running."""

    nodes: list[fx.Node]  # what runs, in program order
    keep: frozenset[fx.Node]  # the values the caller gets
    rng: str = "exact"  # "exact": generator snapshots; "portable": counter-based streams
    seed: int | None = None  # portable mode's seed
    output_dtype: torch.dtype | None = None  # kept floating values are cast to it (Module.to's rule)
    dead: list[fx.Node] = field(default_factory=list)  # writes the slice skipped: overwritten unread
    reuse: dict[fx.Node, tuple[fx.Node, bool]] = field(default_factory=dict)  # CSE: node -> (earlier node, copy)
    in_place: dict[fx.Node, Any] = field(default_factory=dict)  # element-wise node -> its in-place op
    pieces: dict[fx.Node, Ranges] = field(default_factory=dict)  # random fill -> the element ranges it fills
    copies: dict[fx.Node, Ranges] = field(default_factory=dict)  # copy -> the output elements it copies (all read)
    forwards: dict[fx.Node, list[Forward]] = field(default_factory=dict)  # copy -> what it draws itself
    constant_parts: dict[fx.Node, Ranges] = field(default_factory=dict)  # zeros & co -> the elements it writes
    chunked: frozenset[fx.Node] = frozenset()  # whole exact fills run in cache-sized chunks
    fused_casts: dict[fx.Node, FusedCast] = field(default_factory=dict)  # fill -> fill-then-cast in chunks
    casts: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # after node: kept values cast to output_dtype
    frees: dict[fx.Node, list[fx.Node]] = field(default_factory=dict)  # after node: values nothing reads any more
    streams: dict[fx.Node, str] = field(default_factory=dict)  # portable: random node -> stream key
    kernels: dict[fx.Node, Kernel] = field(default_factory=dict)  # compiled: fill -> the kernel it runs as
    unbacked: frozenset[fx.Node] = frozenset()  # allocations nothing reads or writes: meta stand-ins
    exposed: dict[fx.Node, Extent] = field(default_factory=dict)  # kept node -> the storage extent read of it
    labels_of: Callable[[], Mapping[fx.Node, str]] | None = None  # the names of kept nodes, found when printed
    device_map: dict[torch.device, torch.device] = field(default_factory=dict)  # unavailable -> used device
    batches: Batches = NO_BATCHES  # fills run together in one kernel call, and the nodes they must precede

    @functools.cached_property
    def labels(self) -> dict[fx.Node, str]:
        """Kept node -> the name it is asked for by (printing)."""
        return dict(self.labels_of()) if self.labels_of is not None else {}

    @functools.cached_property
    def groups(self) -> list[list[fx.Node]]:
        """Independent groups of ``nodes`` (``passes.partition``), largest first, a CSE duplicate
        in the group of the value it reuses: found when asked (a small plan runs on one thread,
        in program order, and never asks)."""
        return independent_groups(self.nodes, [(dup, first) for dup, (first, _) in self.reuse.items()])

    @functools.cached_property
    def fused_away(self) -> frozenset[fx.Node]:
        """Nodes that do not run: members of fused casts (their fill runs the fused cast) and
        the element-wise chains inside compiled kernels (their fill's kernel runs them)."""
        away = {m for f in self.fused_casts.values() for m in f.members} - set(self.fused_casts)
        return frozenset(away | {m for k in self.kernels.values() for m in k.chain})

    @property
    def random_nodes(self) -> list[fx.Node]:
        away = self.fused_away
        return [n for n in self.nodes if is_random(n) and n not in away]

    def elements_drawn(self) -> int:
        """Elements the random nodes generate (their pieces, or all of the tensor they fill)
        and the copies draw (``forwards``); first draws: ``trunc_normal_``'s rejection rounds
        redraw a few more."""
        total = sum(f.elements for fs in self.forwards.values() for f in fs)
        for n in self.random_nodes:
            if n in self.pieces:
                total += sum(hi - lo for lo, hi in self.pieces[n])
                continue
            target = next((a for a in n.args if isinstance(a, fx.Node)), n)  # opaque nodes: (name, tensor)
            spec = target.meta.get("spec") or n.meta.get("spec")
            total += spec.numel if spec is not None else 0
        return total

    def bytes_allocated(self, device_type: str | None = None) -> int:
        """What running the plan allocates, outputs and temporaries, after in-place chains,
        CSE reuse, fused casts and casts to the output dtype; only on devices of
        ``device_type`` (``"cpu"``, ``"cuda"``) when given."""
        def on(n: fx.Node) -> bool:
            return device_type is None or self.runs_on(n).type == device_type

        total = sum(n.meta["spec"].nbytes for n in self.nodes if allocates(n) and n not in self.unbacked and on(n))
        total -= sum(n.meta["spec"].nbytes for n in self.in_place if on(n))
        total -= sum(n.meta["spec"].nbytes for n, (_, copy) in self.reuse.items() if not copy and allocates(n) and on(n))
        for fused in self.fused_casts.values():
            if not on(fused.alloc):
                continue
            total -= sum(m.meta["spec"].nbytes for m in fused.members if allocates(m))
            total += fused.alloc.meta["spec"].numel * fused.dtype.itemsize
        if self.output_dtype is not None:  # unfused floating outputs are cast after they are final
            in_dtype = {r for f in self.fused_casts.values() for r in f.results}
            total += sum(n.meta["spec"].numel * self.output_dtype.itemsize for n in self.keep - in_dtype
                         if n.meta.get("spec") is not None and cast_by_to(n.meta["spec"].dtype)
                         and n.meta["spec"].dtype != self.output_dtype and on(n))
        return total

    def runs_on(self, node: fx.Node) -> torch.device:
        """The device ``node``'s value is computed on: the recorded one, or what runs in its
        place where that one is not available (``device_map``)."""
        spec = node.meta.get("spec")
        recorded = spec.device if spec is not None else torch.device("cpu")
        return self.device_map.get(recorded, recorded)

    def __str__(self) -> str:
        return format_plan(self)


def make_plan(nodes: list[fx.Node], keep: AbstractSet[fx.Node], *, rng: str = "exact", seed: int | None = None,
              streams: Mapping[fx.Node, str] | None = None, output_dtype: torch.dtype | None = None,
              exposed: Mapping[fx.Node, Extent] | None = None, device_map: DeviceMap | None = None,
              dead: Sequence[fx.Node] = (), compiles: Callable[[torch.device], str | None] | None = None,
              keeps_roundings: Callable[[torch.device], bool] = lambda device: True,
              labels: Mapping[fx.Node, str] | Callable[[], Mapping[fx.Node, str]] | None = None) -> Plan:
    """The plan for the slice ``nodes`` (program order, from ``passes.slicing``) whose
    values ``keep`` the caller gets. ``exposed``: kept nodes of which the caller reads only
    this storage extent (their random fills fill what it needs, and they are not cast to
    ``output_dtype``: the caller casts the part it reads). ``streams``: portable mode's key
    of every random node (``passes.stream_keys``). ``compiles(device)``: the backend that
    runs portable fills on ``device`` as compiled kernels (``passes.kernels.BACKENDS``), or
    None; ``keeps_roundings(device)``: whether Inductor's kernels there keep a bfloat16 or
    float16 rounding that float32 ops read after (``passes.kernels.with_backend``)."""
    keep = frozenset(keep)
    members = set(nodes)
    exposed = dict(exposed or {})
    device_map = dict(device_map or {})
    reuse = common_subexpressions(nodes, keep)
    fused = {fill: f for fill, f in fused_casts(nodes, keep, output_dtype, 2 * CHUNK).items()
             if _fusable(f, rng) and not exposed.keys() & {*f.members, *f.results}}
    pieces: dict[fx.Node, Ranges] = {}
    pieces_of = portable_pieces if rng == "portable" else exact_pieces
    shared = {n for pair in reuse.items() for n in (pair[0], pair[1][0])}  # a CSE value serves other readers too
    in_place = in_place_chains(nodes, keep, reuse)
    kernels: dict[fx.Node, Kernel] = {}
    if rng == "portable" and compiles is not None:
        candidates = compiled_fills(nodes, in_place, fused, device_map)
        on = {d: compiles(d) for d in {k.device for k in candidates.values()}}
        kernels = {n: run for n, k in candidates.items()
                   if on[k.device] and (run := with_backend(k, on[k.device], keeps_roundings))}
    # nodes that run otherwise or for others too (fxinit's Triton kernel draws any piece alone)
    unsplit = {*shared, *in_place, *(n for n, k in kernels.items() if k.backend not in TABLE_BACKENDS),
               *(m for f in fused.values() for m in f.members), *(m for k in kernels.values() for m in k.chain)}
    roots_shared = shared_roots(nodes)
    demand, forwards = forwarded_demand(nodes, keep, exposed,
                                        lambda fill: fill not in unsplit and draws_alone(fill, rng, device_map),
                                        unsplit, roots_shared)
    for node, ranges in partial_fills(demand).items():
        if node in fused or node in shared:
            continue
        found = pieces_of(node, ranges, device_map)
        if found is not None:
            pieces[node] = found
    chunked = frozenset() if rng == "portable" else frozenset(
        n for n in nodes if is_random(n) and n not in pieces and n not in fused and exact_chunks(n, None, device_map))
    copies = {n: r for n, r in partial_copies(demand).items() if n not in shared and n not in in_place}
    constant_parts = {n: r for n, r in partial_constants(demand).items() if n not in unsplit}
    assert forwards.keys() <= copies.keys()  # a forwarded copy reads nothing else of its source
    unbacked = (unbacked_allocations(nodes, keep, pieces, copies, forwards.keys())
                if any(not r for r in (*pieces.values(), *copies.values())) else frozenset())
    batches = batched_fills(nodes, rng, {*unsplit, *pieces, *chunked, *fused, *copies, *constant_parts, *unbacked},
                            roots_shared, device_map, kernels)
    done_in_dtype = {r for f in fused.values() for r in f.results}
    casts = cast_points(nodes, keep - done_in_dtype - exposed.keys(), reuse) if output_dtype is not None else {}
    return Plan(
        nodes=list(nodes), keep=keep, rng=rng, seed=seed, output_dtype=output_dtype, dead=list(dead), reuse=reuse,
        in_place=in_place, pieces=pieces, copies=copies, forwards=forwards, constant_parts=constant_parts,
        chunked=chunked, fused_casts=fused,
        casts=casts, frees=last_uses(nodes, reuse, keep),
        streams={n: k for n, k in (streams or {}).items() if n in members}, kernels=kernels, exposed=exposed,
        unbacked=unbacked, device_map=device_map, batches=batches,
        labels_of=labels if callable(labels) else (lambda: labels or {}))


def _fusable(fused: FusedCast, rng: str) -> bool:
    """A fill-then-cast runs in chunks where its fill can be split exactly (and is large
    enough for chunks to matter); otherwise its members run unfused."""
    if fused.alloc.meta["spec"].numel < 2 * CHUNK:
        return False
    return is_in_place_sampler(fused.fill) if rng == "portable" else exact_chunks(fused.fill)


def last_uses(nodes: Sequence[fx.Node], reuse: Mapping[fx.Node, tuple[fx.Node, bool]],
              keep: AbstractSet[fx.Node]) -> dict[fx.Node, list[fx.Node]]:
    """For each node, the values nothing needs once it ran (a value nothing uses, such as
    an in-place op's result, right after its own node); a value reused by CSE lives until
    its last reuse, a kept value until the end."""
    last: dict[fx.Node, fx.Node] = {n: n for n in nodes}
    for n in nodes:
        for inp in n._input_nodes:
            last[inp] = n
        if n in reuse:
            last[reuse[n][0]] = n
    frees: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last.items():
        if value not in keep:
            frees.setdefault(user, []).append(value)
    return frees


def peak_bytes(plan: Plan) -> int:
    """The most bytes of storage a run of ``plan`` holds at once: a storage is held from the
    node that allocates it until no value on it (the node's, its views', in-place results')
    is held any more (``frees``)."""
    owner: dict[fx.Node, fx.Node] = {}  # value -> the node whose storage it is on
    users: dict[fx.Node, int] = {}  # storage owner -> values on it held now
    live = peak = 0
    for n in plan.nodes:
        base = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
        # (a piece of a multi-output op's result is a storage of its own: qr's q and r)
        o = n if allocates(n) or n.target is operator.getitem or base not in owner else owner[base]
        owner[n] = o
        if o is n and n.meta.get("spec") is not None:
            live += n.meta["spec"].nbytes
        users[o] = users.get(o, 0) + 1
        peak = max(peak, live)
        for value in plan.frees.get(n, ()):
            held = owner.get(value)
            if held is not None:
                users[held] -= 1
                if not users[held] and held.meta.get("spec") is not None:
                    live -= held.meta["spec"].nbytes
    return peak


# ---------------------------------------------------------------------------- printing
def format_plan(plan: Plan) -> str:
    """One line per node: what it computes, then what the passes decided about it."""
    head = (f"plan: {len(plan.nodes)} nodes in {len(plan.groups)} independent group(s), rng {plan.rng}"
            + (f" (seed {plan.seed})" if plan.seed is not None else "")
            + (f", output dtype {_dtype(plan.output_dtype)}" if plan.output_dtype is not None else "")
            + f", {_mib(plan.bytes_allocated())} allocated, {plan.elements_drawn():,} random elements drawn")
    lines = [head]
    if plan.dead:
        lines.append(f"skipped {len(plan.dead)} dead write(s), overwritten before anything reads them: "
                     + ", ".join(f"{n.name}" for n in plan.dead))
    if plan.device_map:
        lines.append("devices: " + ", ".join(f"{a} -> {b}" for a, b in plan.device_map.items()))
    fused_by_member = {m: f for f in plan.fused_casts.values() for m in f.members}
    in_kernel = {m: f for f, k in plan.kernels.items() for m in k.chain}
    for i, group in enumerate(plan.groups, 1):
        if len(plan.groups) > 1:
            lines.append(f"group {i}:")
        for n in group:
            decisions = _decisions(plan, n, fused_by_member, in_kernel)
            lines.append(f"  {_call(n):<52} {'; '.join(decisions)}".rstrip())
    return "\n".join(lines)


def _decisions(plan: Plan, n: fx.Node, fused_by_member: Mapping[fx.Node, FusedCast],
               in_kernel: Mapping[fx.Node, fx.Node]) -> list[str]:
    out = []
    spec = n.meta.get("spec")
    if spec is not None and allocates(n):
        out.append(f"{_dtype(spec.dtype)}{list(spec.shape)}")
    if n in plan.keep:
        label = plan.labels.get(n)
        out.append(f"-> {label}" if label else "kept")
        if n in plan.exposed:
            out.append(f"only storage {plan.exposed[n][0]}..{plan.exposed[n][1]} read")
    if is_random(n):
        source = (f"stream {plan.streams[n]!r}" if n in plan.streams
                  else "snapshot " + ", ".join(f"{k}" for k in n.meta["generators"].values()))
        out.append(f"random from {source}")
    if n in plan.kernels:
        k = plan.kernels[n]
        steps = [k.kind, _dtype(k.dtype), *(op_name(m) for m in k.chain)]
        if k.cast is not None:
            steps.append(_dtype(k.cast))
        out.append(f"compiled kernel ({k.backend}) on {k.device.type}: {' -> '.join(steps)}")
    if "default_dtype" in n.meta:
        out.append(f"under default dtype {_dtype(n.meta['default_dtype'])}")
    if "numerics" in n.meta:  # set inside the constructor (``fxinit.numerics``)
        out.append("under its own numeric settings (meta['numerics'])")
    if n in plan.unbacked:
        out.append("unbacked: nothing reads or writes it, a meta tensor stands in")
    if n in plan.pieces:
        out.append(f"fills only {_ranges(plan.pieces[n])}")
    if n in plan.copies:
        out.append(f"copies only {_ranges(plan.copies[n])}" if plan.copies[n] else "copies nothing")
    if n in plan.constant_parts:
        parts = plan.constant_parts[n]
        out.append(f"writes only {_ranges(parts)}" if parts else "writes nothing (all overwritten before read)")
    for f in plan.forwards.get(n, ()):
        out.append(f"draws {f.elements:,} elements of {f.fill.name} itself, in {len(f.runs):,} run(s)")
    if n in plan.chunked:
        out.append(f"in chunks of {CHUNK}")
    if n in plan.batches.fills:
        out.append("batched: one kernel call with the fills queued beside it")
    if n in plan.batches.flushes:
        out.append("runs the batched fills queued before it first")
    if n in plan.fused_casts:
        f = plan.fused_casts[n]
        how = "in one kernel" if n in plan.kernels else f"in chunks of {CHUNK}"
        out.append(f"fused with the cast to {_dtype(f.dtype)} ({how}): " + ", ".join(r.name for r in f.results)
                   + f" never whole in {_dtype(f.alloc.meta['spec'].dtype)}")
    elif n in fused_by_member:
        out.append(f"filled by {fused_by_member[n].fill.name}")
    if n in in_kernel:
        out.append(f"in {in_kernel[n].name}'s kernel")
    elif n in plan.in_place:
        out.append(f"in place ({op_name(n)}_ on {n.args[0].name})")
    if n in plan.reuse:
        first, copy = plan.reuse[n]
        out.append(f"reuses {first.name}" + (" (a copy)" if copy else ""))
    for k in plan.casts.get(n, ()):
        out.append(f"then {k.name} cast to {_dtype(plan.output_dtype)}")
    freed = [v.name for v in plan.frees.get(n, ()) if v is not n]
    if freed:
        out.append("frees " + ", ".join(freed))
    return out


_QUIET = {"pin_memory": False, "layout": torch.strided}  # keyword arguments not worth a reader's time


def _call(n: fx.Node) -> str:
    """``%normal_2 = normal_(%empty_3, 0.0, 0.02)``."""
    def show(a: Any) -> str:
        if isinstance(a, fx.Node):
            return f"%{a.name}"
        if isinstance(a, (list, tuple)):
            return "[" + ", ".join(show(x) for x in a) + "]"
        if isinstance(a, torch.dtype):
            return _dtype(a)
        if isinstance(a, float):
            return repr(a) if len(repr(a)) <= 10 else f"{a:.6g}"
        return str(a) if isinstance(a, torch.device) else repr(a)

    if n.op == "get_attr":
        return f"%{n.name} = constant {n.target}"
    args = [show(a) for a in (n.args[1:] if n.meta.get("opaque") else n.args)]
    args += [f"{k}={show(v)}" for k, v in n.kwargs.items() if v is not None and _QUIET.get(k, ...) != v]
    return f"%{n.name} = {op_name(n)}({', '.join(args)})"


def _ranges(ranges: Ranges) -> str:
    """``1024 elements in 2 pieces (0..512, 1024..1536)``."""
    shown = ", ".join(f"{lo}..{hi}" for lo, hi in ranges[:3]) + (" ..." if len(ranges) > 3 else "")
    pieces = f" in {len(ranges)} pieces" if len(ranges) > 1 else ""
    return f"{sum(hi - lo for lo, hi in ranges)} elements{pieces} ({shown})"


def _dtype(d: torch.dtype | None) -> str:
    return str(d).removeprefix("torch.")


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"
