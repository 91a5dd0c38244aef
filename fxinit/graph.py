"""InitGraph: the contract between capture and everything after it.

An InitGraph is a ``torch.fx.Graph`` of init ops in program order (aten overloads,
``operator.getitem``, and the ops of ``fxinit.ops``), plus:

* ``outputs``: fully qualified name -> the node whose value is that parameter/buffer;
* ``ties``: groups of names that are the same tensor object (``head.weight`` tied to
  ``embed.weight``);
* ``constants``: real tensors the graph reads (``torch.tensor([...])``, numpy data);
* ``snapshots``: generator states, one per random op, so each random op can be replayed
  on its own, in any order, without touching the user's generators.

Node metadata (``node.meta``): ``pos`` (program order), ``spec`` (TensorSpec of the
value), ``reads``/``mutates`` (storage ids, for slicing with aliasing), ``generators``
(``{generator: key in snapshots}`` on random ops), ``prov`` (Provenance), ``module`` (dotted path), ``default_dtype``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch
import torch.fx as fx

from fxinit.errors import DeferredInitError
from fxinit.ops import ALLOCATIONS, allocates, view_base
from fxinit.rng import Snapshot
from fxinit.spec import OutputInfo, TensorSpec, cast_by_to, dtype_after_to


@dataclass
class InitGraph:
    """A self-contained init graph for a set of named parameters and buffers."""

    graph: fx.Graph
    outputs: dict[str, fx.Node]
    output_storage: dict[str, int]
    info: dict[str, OutputInfo]
    ties: list[list[str]]
    constants: dict[str, torch.Tensor]
    snapshots: dict[str, Snapshot]
    default_dtype: torch.dtype = field(default_factory=torch.get_default_dtype)
    seed: int | None = None  # torch.initial_seed() when capture started: portable mode's default
    stream_names: dict[int, str] = field(default_factory=dict)  # storage id -> name for portable keys
    #: The transformers config the traced model was built from, as plain JSON data (what
    #: ``config.json`` holds), or None: lets a graph be exported as a loadable checkpoint.
    hf_config: dict[str, Any] | None = None

    def storage_names(self) -> dict[int, str]:
        """``{storage id: name}`` for portable stream keys: the names the storages had when
        the trace ended, else the smallest output name living in them."""
        names: dict[int, str] = {}
        for fqn, sid in self.output_storage.items():
            if sid not in names or fqn < names[sid]:
                names[sid] = fqn
        names.update(self.stream_names)
        return names

    @property
    def nodes(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op not in ("output", "placeholder")]

    def spec(self, name: str) -> TensorSpec:
        return self.outputs[name].meta["spec"]

    def dead_writes(self) -> set[fx.Node]:
        """Nodes whose writes are overwritten before anyone reads them (never executed)."""
        from fxinit.passes.dead_init import dead_writes

        return dead_writes(self.nodes)

    def required_nodes(self, names: Iterable[str], eliminate_dead: bool = True, to_run: bool = False
                       ) -> list[fx.Node]:
        """The nodes, in program order, that the named outputs need (a slice); ``to_run``: only
        what the backend runs (see ``passes.slicing.required_nodes``)."""
        from fxinit.passes.slicing import required_nodes

        dead = self.dead_writes() if eliminate_dead else frozenset()
        return required_nodes(self.nodes, [(self.outputs[n], self.output_storage[n]) for n in names], dead, to_run)

    def uninitialized(self) -> list[str]:
        """Outputs that no op ever writes: allocated (``torch.empty`` & co.) and left as they
        are, so eager construction gives them whatever the memory held, and so does
        materialization. A model usually means to initialize them (e.g. parameters that
        ``from_pretrained`` found missing and ``_init_weights`` does not cover)."""

        written = {sid for n in self.nodes for sid in n.meta.get("mutates", ())}
        names = []
        for name, node in self.outputs.items():
            if self.output_storage[name] in written:
                continue
            if view_base(node).target in ALLOCATIONS:
                names.append(name)
        return names

    def explain(self, name: str) -> str:
        """How the tensor ``name`` is initialized, in words: each op with the init function,
        module and source line it came from, which ops are random, which are dead and why."""
        from fxinit.report import explain

        return explain(self, name)

    def save(self, path: str | os.PathLike) -> None:
        """Write this graph to ``path`` (format: docs/artifact-format.md); ``fxinit.load_graph`` reads it."""
        from fxinit.artifact import save_graph

        save_graph(self, path)

    @staticmethod
    def load(path: str | os.PathLike) -> "InitGraph":
        """Read a graph written by ``save`` (``fxinit.load_graph``)."""
        return load_graph(path)

    def materialize(
        self, names: Iterable[str] | None = None, device: torch.device | str | None = None,
        rng: str = "exact", max_bytes: int | None = None, seed: int | None = None,
        dtype: torch.dtype | None = None, rows: Mapping[str, tuple[int, int]] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Values of the named outputs (all if None).

        ``rng="exact"``: bit-for-bit equal to eager construction; tensors are computed on the
        device eager construction would have used and then moved to ``device`` if one is
        given. ``rng="portable"``: random ops draw from the counter-based stream of
        ``fxinit.rng.portable`` keyed by ``seed`` (default: the seed the trace saw), each
        tensor's name and element index. Tied names map to the same tensor. A run that
        would allocate more than ``max_bytes`` (default: physical memory) is refused.
        ``dtype`` casts the floating-point and complex outputs as ``Module.to(dtype)`` would, each as
        soon as it is final (random fills read only through the cast run in chunks).
        ``rows={name: (start, stop)}`` asks for rows ``start .. stop`` of dimension 0 of
        that output only: the random fills it comes from fill only what those rows need
        where they can (the same bits as the whole tensor's rows), so a tensor too large to
        hold can be produced in pieces. The value is ``whole[start:stop]``, a view whose
        storage is the whole tensor's, of which only those rows were computed (memory never
        written takes none); ``.clone()`` it to keep it apart from that storage.
        """
        from fxinit.backends.eager import run_parallel
        from fxinit.backends.portable import streams_for

        if rng not in ("exact", "portable"):
            raise ValueError(f"rng={rng!r}: choose 'exact' or 'portable'")
        if dtype is not None and not cast_by_to(dtype):
            raise ValueError(f"dtype={dtype}: like Module.to, materialize takes a floating-point or complex dtype")
        wanted = list(self.outputs) if names is None else list(names)
        unknown = [n for n in wanted if n not in self.outputs]
        if unknown:
            raise KeyError(f"not outputs of this init graph: {unknown[:5]}")
        exposed = self._rows_extents(wanted, rows or {})
        nodes = self.required_nodes(wanted, to_run=True)
        need = sum(n.meta["spec"].nbytes for n in nodes if allocates(n))
        limit = max_bytes if max_bytes is not None else _physical_memory()
        if need > limit:
            raise DeferredInitError(
                f"materializing these {len(wanted)} tensors allocates {need / 2**30:.1f} GiB, more than "
                f"{limit / 2**30:.1f} GiB", hint="ask for fewer names at a time, or pass max_bytes=")
        streams = None
        if rng == "portable":
            streams = streams_for(self.nodes, self.storage_names(), _portable_seed(seed, self.seed))
        env = run_parallel(nodes, self.constants, self.snapshots, self.default_dtype,
                           keep={self.outputs[n] for n in wanted}, streams=streams, output_dtype=dtype,
                           exposed=exposed)
        out: dict[str, torch.Tensor] = {}
        for n in wanted:
            value = env[self.outputs[n]]
            if n in (rows or {}):
                start, stop = rows[n]  # type: ignore[index]
                value = value[start:stop]
                if dtype_after_to(value.dtype, dtype) != value.dtype:  # exposed values are not cast yet
                    value = value.to(dtype_after_to(value.dtype, dtype))
            if device is not None:
                value = value.to(device)
            out[n] = value
        return out

    def _rows_extents(self, wanted: list[str], rows: Mapping[str, tuple[int, int]]) -> dict[fx.Node, tuple[int, int]]:
        """The storage extents of the row ranges asked for, by output node (a node all of
        whose requested names ask for rows; tied names ask for the union)."""
        from fxinit.passes.ranges import rows_extent

        extents: dict[fx.Node, tuple[int, int]] = {}
        whole = {self.outputs[n] for n in wanted if n not in rows}
        for name, (start, stop) in rows.items():
            if name not in wanted:
                raise KeyError(f"rows= names {name!r}, which is not among the names asked for")
            shape = self.spec(name).shape
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise ValueError(f"rows {start}..{stop} of {name!r} (shape {tuple(shape)}): not a range of its rows")
            node = self.outputs[name]
            ext = rows_extent(self.spec(name), start, stop)
            if node in whole or ext is None:
                whole.add(node)
                continue
            old = extents.get(node, ext)
            extents[node] = (min(old[0], ext[0]), max(old[1], ext[1]))
        return {node: ext for node, ext in extents.items() if node not in whole}

    def stats(self, names: Iterable[str] | None = None, dtype: torch.dtype | None = None) -> dict[str, int]:
        """Sizes of the graph, and of what materializing ``names`` (all if None) runs.

        ``*_captured`` counts everything capture recorded for those outputs; the plain
        counts are what runs after slicing and dead-init elimination. ``random_elements``
        counts the elements random ops fill (their draws, up to a per-dtype factor).
        ``cse_reused`` nodes take an earlier node's value instead of computing it,
        ``in_place`` nodes run in place on a dying temporary, ``fused_casts`` fills run in
        chunks cast as they go (with ``dtype``, the output dtype asked of ``materialize``).
        ``bytes_allocated`` is what an exact run allocates after all of these (outputs
        and temporaries); ``bytes_allocated_captured`` what replaying the capture would.
        """
        from fxinit.backends.fused import runnable
        from fxinit.passes.cast_fusion import fused_casts
        from fxinit.passes.cse import common_subexpressions
        from fxinit.passes.inplace import in_place_chains

        wanted = list(self.outputs) if names is None else list(names)
        captured = self.required_nodes(wanted, eliminate_dead=False)
        run = self.required_nodes(wanted, to_run=True)
        out_nodes = {self.outputs[n] for n in wanted}
        out = {"outputs": len(self.outputs), "constants": len(self.constants),
               "output_bytes": sum(self.spec(g[0]).nbytes for g in self._tie_representatives()),
               "dead_nodes": len(set(captured) - set(run))}
        for suffix, nodes in (("_captured", captured), ("", run)):
            random = [n for n in nodes if n.meta.get("generators")]
            out["nodes" + suffix] = len(nodes)
            out["random_ops" + suffix] = len(random)
            out["random_elements" + suffix] = sum(_numel(n) for n in random)
            out["bytes_allocated" + suffix] = sum(n.meta["spec"].nbytes for n in nodes if allocates(n))
        shared = common_subexpressions(run, out_nodes)
        in_place = in_place_chains(run, out_nodes, shared)
        fused = runnable(fused_casts(run, out_nodes, dtype), self.snapshots, None)
        saved = sum(n.meta["spec"].nbytes for n in in_place)
        saved += sum(n.meta["spec"].nbytes for n, (_, copy) in shared.items() if not copy and allocates(n))
        in_dtype = {r for p in fused.values() for r in p.results}
        for plan in fused.values():
            saved += sum(m.meta["spec"].nbytes for m in plan.members if allocates(m))
            saved -= _numel(plan.alloc) * plan.dtype.itemsize
        if dtype is not None:  # unfused floating outputs are cast after they are final
            saved -= sum(_numel(n) * dtype.itemsize for n in out_nodes - in_dtype
                         if cast_by_to(n.meta["spec"].dtype) and n.meta["spec"].dtype != dtype)
        out.update(cse_reused=len(shared), in_place=len(in_place), fused_casts=len(fused))
        out["bytes_allocated"] -= saved
        out["output_bytes_in_dtype"] = sum(
            _numel(self.outputs[g[0]]) * (dtype.itemsize if dtype is not None and cast_by_to(self.spec(g[0]).dtype)
                                          else self.spec(g[0]).dtype.itemsize)
            for g in self._tie_representatives())
        return out

    def _tie_representatives(self) -> list[list[str]]:
        seen: set[str] = set()
        groups = []
        for group in self.ties:
            groups.append(group)
            seen.update(group)
        groups.extend([n] for n in self.outputs if n not in seen)
        return groups

    def __repr__(self) -> str:
        s = self.stats()
        return (f"InitGraph({s['outputs']} outputs, {s['nodes_captured']} nodes ({s['dead_nodes']} dead), "
                f"{s['random_ops']} random ops to run, {s['output_bytes'] / 2**20:.1f} MiB)")


def load_graph(path: str | os.PathLike) -> InitGraph:
    """Read an init graph written by ``InitGraph.save`` or ``fxinit trace``; refuses (with
    ``ArtifactError``) anything it cannot trust (see ``fxinit.artifact``)."""
    from fxinit.artifact import read_graph

    return InitGraph(**read_graph(path))


def loads(data: bytes, source: str = "<bytes>") -> InitGraph:
    """``load_graph`` from the bytes of a file."""
    from fxinit.artifact import decode

    return InitGraph(**decode(data, source))


def _portable_seed(seed: int | None, traced: int | None) -> int:
    if seed is not None:
        return seed
    if traced is None:
        raise DeferredInitError("this graph does not know the seed its trace saw", hint="pass seed=")
    return traced


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 1 << 62


def _numel(n: fx.Node) -> int:
    """Elements of the node's value; for an in-place op, of the tensor it writes."""
    spec = n.meta.get("spec")
    if spec is None:
        written = next((a for a in n.args if isinstance(a, fx.Node)), None)
        spec = written.meta.get("spec") if written is not None else None
    return 0 if spec is None else spec.numel
