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
(``{generator: key in snapshots}`` on random ops), ``prov`` (Provenance), ``module``
(dotted path), ``default_dtype``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import torch
import torch.fx as fx

from fxinit import execute
from fxinit.arguments import checked_device, checked_dtype, checked_seed
from fxinit.artifact import decode, read_graph, save_graph
from fxinit.dependencies import dependency_graph
from fxinit.errors import DeferredInitError
from fxinit.numerics import Numerics
from fxinit.execute import program_dead_writes, slicer
from fxinit.ops import allocates, is_random
from fxinit.passes.ranges import rows_extent
from fxinit.passes.uninitialized import never_written
from fxinit.plan import Plan
from fxinit.report import explain
from fxinit.rng import Snapshot
from fxinit.spec import OutputInfo, TensorSpec, cast_by_to, dtype_after_to

if TYPE_CHECKING:
    import networkx as nx


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
    #: torch's numeric settings the constructor ran under (``fxinit.numerics``); nodes recorded
    #: under others have their own in ``meta["numerics"]``. None: unknown (replayed under the
    #: settings in force).
    numerics: Numerics | None = None
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
        return program_dead_writes(self)

    def required_nodes(self, names: Iterable[str], eliminate_dead: bool = True, to_run: bool = False
                       ) -> list[fx.Node]:
        """The nodes, in program order, that the named outputs need (a slice); ``to_run``: only
        what the interpreter runs (see ``passes.slicing.Slicer.required``)."""
        return slicer(self, eliminate_dead).required(self._targets(names), to_run)[0]

    def _targets(self, names: Iterable[str]) -> list[tuple[fx.Node, int]]:
        return [(self.outputs[n], self.output_storage[n]) for n in names]

    def uninitialized(self) -> list[str]:
        """Outputs that no op ever writes: allocated (``torch.empty`` & co.) and left as they
        are, so eager construction gives them whatever the memory held, and so does
        materialization. A model usually means to initialize them (e.g. parameters that
        ``from_pretrained`` found missing and ``_init_weights`` does not cover), and copies of
        them (``copy.deepcopy`` of a layer holding one: ``passes.uninitialized.never_written``)."""
        return never_written(self.nodes, self.outputs, self.output_storage)

    def explain(self, name: str) -> str:
        """How the tensor ``name`` is initialized, in words: each op with the init function,
        module and source line it came from, which ops are random, which are dead and why."""
        return explain(self, name)

    def to_networkx(self) -> "nx.DiGraph":
        """The init dependencies as a ``networkx.DiGraph`` of op nodes and tensor names, for
        analysis with networkx (``networkx.ancestors(g, name)``: what ``name`` comes from);
        see ``fxinit.dependencies``."""
        return dependency_graph(self.nodes, self.outputs, self.output_storage, self.dead_writes())

    def save(self, path: str | os.PathLike) -> None:
        """Write this graph to ``path`` (format: docs/artifact-format.md); ``fxinit.load_graph`` reads it."""
        save_graph(self, path)

    def plan(self, names: Iterable[str] | None = None, rng: str = "exact", seed: int | None = None,
             dtype: torch.dtype | None = None, rows: Mapping[str, tuple[int, int]] | None = None,
             compile: bool | str | None = None) -> Plan:
        """What materializing ``names`` (all if None) runs and how: the slice and every
        decision of the passes (``fxinit.plan``; ``print`` it). Arguments as for ``materialize``."""
        wanted = self._wanted(names)
        if rng not in ("exact", "portable"):
            raise ValueError(f"rng={rng!r}: choose 'exact' or 'portable'")
        if dtype is not None and not cast_by_to(dtype):
            raise TypeError(f"dtype={dtype}: like Module.to, materialize takes a floating-point or complex dtype")
        labels: dict[fx.Node, str] = {}
        for name in wanted:
            node = self.outputs[name]
            labels[node] = f"{labels[node]}, {name}" if node in labels else name
        return execute.plan(self, self._targets(wanted), rng=rng, dtype=dtype, labels=labels,
                            seed=_portable_seed(seed, self.seed) if rng == "portable" else None,
                            exposed=self._rows_extents(wanted, rows or {}), compile=compile)

    def materialize(
        self, names: Iterable[str] | None = None, device: torch.device | str | None = None,
        rng: str = "exact", max_bytes: int | None = None, seed: int | None = None,
        dtype: torch.dtype | None = None, rows: Mapping[str, tuple[int, int]] | None = None,
        compile: bool | str | None = None,
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
        ``compile`` (portable mode): as for ``fxinit.materialize``.
        """
        seed, dtype, device = checked_seed(seed), checked_dtype(dtype), checked_device(device)
        wanted = self._wanted(names)
        todo = self.plan(wanted, rng=rng, seed=seed, dtype=dtype, rows=rows, compile=compile)
        need = sum(n.meta["spec"].nbytes for n in todo.nodes if allocates(n))
        limit = max_bytes if max_bytes is not None else _physical_memory()
        if need > limit:
            raise DeferredInitError(
                f"materializing these {len(wanted)} tensors allocates {need / 2**30:.1f} GiB, more than "
                f"{limit / 2**30:.1f} GiB", hint="ask for fewer names at a time, or pass max_bytes=")
        env = execute.run(self, todo)
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

    def _wanted(self, names: Iterable[str] | None) -> list[str]:
        wanted = list(self.outputs) if names is None else list(names)
        unknown = [n for n in wanted if n not in self.outputs]
        if unknown:
            raise KeyError(f"not outputs of this init graph: {unknown[:5]}")
        return wanted

    def _rows_extents(self, wanted: list[str], rows: Mapping[str, tuple[int, int]]) -> dict[fx.Node, tuple[int, int]]:
        """The storage extents of the row ranges asked for, by output node (a node all of
        whose requested names ask for rows; tied names ask for the union)."""
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
        counts are what the plan runs after slicing and dead-init elimination.
        ``random_elements`` counts the elements random ops fill (their draws, up to a
        per-dtype factor). ``cse_reused`` nodes take an earlier node's value instead of
        computing it, ``in_place`` nodes run in place on a dying temporary, ``fused_casts``
        fills run in chunks cast as they go (with ``dtype``, the output dtype asked of
        ``materialize``). ``bytes_allocated`` is what an exact run allocates after all of
        these (outputs and temporaries); ``bytes_allocated_captured`` what replaying the
        capture would.
        """
        wanted = self._wanted(names)
        captured = self.required_nodes(wanted, eliminate_dead=False)
        todo = self.plan(wanted, dtype=dtype)
        out = {"outputs": len(self.outputs), "constants": len(self.constants),
               "output_bytes": sum(self.spec(g[0]).nbytes for g in self._tie_representatives()),
               "dead_nodes": len(set(captured) - set(todo.nodes))}
        for suffix, nodes in (("_captured", captured), ("", todo.nodes)):
            random = [n for n in nodes if is_random(n)]
            out["nodes" + suffix] = len(nodes)
            out["random_ops" + suffix] = len(random)
            out["random_elements" + suffix] = sum(_numel(n) for n in random)
            out["bytes_allocated" + suffix] = sum(n.meta["spec"].nbytes for n in nodes if allocates(n))
        out.update(cse_reused=len(todo.reuse), in_place=len(todo.in_place), fused_casts=len(todo.fused_casts))
        out["bytes_allocated"] = todo.bytes_allocated()
        out["output_bytes_in_dtype"] = sum(
            _numel(self.outputs[g[0]]) * dtype_after_to(self.spec(g[0]).dtype, dtype).itemsize
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
    return InitGraph(**read_graph(path))


def loads(data: bytes, source: str = "<bytes>") -> InitGraph:
    """``load_graph`` from the bytes of a file."""
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
