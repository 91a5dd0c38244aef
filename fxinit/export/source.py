"""What an export writes and where each value comes from.

A ``Source`` is the list of tensors of a checkpoint (names in state-dict order, shapes,
dtypes, tie groups) and the way to compute any piece of any of them: from an init graph
(``InitGraph.materialize``, rows only where the tensor is too large to hold whole), or,
for a partly materialized model, from the real tensors it already holds.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from fxinit.errors import DeferredInitError
from fxinit.graph import InitGraph
from fxinit.spec import dtype_after_to

# Asking a piece for more than this many times its own elements of writes (random fills
# that cannot be restricted to the rows, a tensor computed from others) means it is
# cheaper to compute the tensor whole once.
_PIECE_OVERHEAD = 2


@dataclass(frozen=True)
class Piece:
    """Rows ``start .. stop`` (of dimension 0) of tensor ``name``, as written; ``whole``
    when that is all of it (0-dimensional tensors included)."""

    name: str
    start: int
    stop: int
    whole: bool
    nbytes: int


@dataclass
class Source:
    """The tensors to export, by name, and how to compute them."""

    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    dtypes: dict[str, torch.dtype]  # as computed, before ``dtype=``
    ties: list[list[str]]
    graph: InitGraph | None = None
    real: dict[str, torch.Tensor] = field(default_factory=dict)
    hf_config: dict[str, Any] | None = None
    parameters: set[str] | None = None  # the names that are parameters (not buffers), when known

    @staticmethod
    def of(obj: "torch.nn.Module | InitGraph | str | os.PathLike") -> "Source":
        """A source for a traced (possibly partly materialized) module, an init graph, or
        the path of an init-graph file."""
        if isinstance(obj, (str, os.PathLike)):
            from fxinit.graph import load_graph

            obj = load_graph(obj)
        if isinstance(obj, InitGraph):
            return _of_graph(obj)
        if isinstance(obj, torch.nn.Module):
            return _of_module(obj)
        raise TypeError(f"cannot export a {type(obj).__name__}: pass a module, an InitGraph or an init-graph file")

    def written_dtype(self, name: str, dtype: torch.dtype | None) -> torch.dtype:
        return dtype_after_to(self.dtypes[name], dtype)

    def nbytes(self, name: str, dtype: torch.dtype | None) -> int:
        n = 1
        for s in self.shapes[name]:
            n *= s
        return n * self.written_dtype(name, dtype).itemsize

    def pieces(self, name: str, dtype: torch.dtype | None, rng: str, piece_bytes: int) -> list[Piece]:
        """``name`` in pieces of about ``piece_bytes`` (whole rows), or whole when it is
        small, has no rows, or costs about as much to compute in part as whole."""
        shape, nbytes = self.shapes[name], self.nbytes(name, dtype)
        if not shape or nbytes <= piece_bytes or shape[0] < 2 or not self._separable(name, rng, piece_bytes):
            return [Piece(name, 0, shape[0] if shape else 1, True, nbytes)]
        row = nbytes // shape[0]
        step = max(1, piece_bytes // max(row, 1))
        return [Piece(name, lo, min(lo + step, shape[0]), False, (min(lo + step, shape[0]) - lo) * row)
                for lo in range(0, shape[0], step)]

    def _separable(self, name: str, rng: str, piece_bytes: int) -> bool:
        """Whether computing a piece of ``name`` writes not much more than the piece."""
        if name in self.real:
            return True
        from fxinit.passes.ranges import rows_extent, written_elements

        graph = self.graph
        assert graph is not None
        node, spec = graph.outputs[name], graph.spec(name)
        rows = max(1, piece_bytes // max(1, spec.nbytes // spec.shape[0]))
        start = (spec.shape[0] - rows) // 2
        if rows_extent(spec, start, start + rows) is None:
            return False
        # what a run for these rows fills (the seed changes values, not what runs)
        todo = graph.plan([name], rng=rng, seed=0, rows={name: (start, start + rows)})
        written = written_elements(todo.nodes, node, graph.output_storage[name], todo.pieces)
        return written <= _PIECE_OVERHEAD * rows * (spec.numel // spec.shape[0])

    def compute(self, pieces: Sequence[Piece], rng: str, seed: int | None, dtype: torch.dtype | None,
                compact: bool = False, compile: bool | str | None = None,
                device: torch.device | None = None) -> list[torch.Tensor]:
        """The values of ``pieces`` (contiguous CPU tensors in the written dtype), computed
        together (on ``device`` if given, else where each was meant to be); with ``compact``,
        each in a storage of its own. ``compile``: as for ``InitGraph.materialize``."""
        from_graph = [p for p in pieces if p.name not in self.real]
        values: dict[str, torch.Tensor] = {}
        if from_graph:
            assert self.graph is not None
            rows = {p.name: (p.start, p.stop) for p in from_graph if not p.whole}
            values = self.graph.materialize([p.name for p in from_graph], device=device, rng=rng, seed=seed,
                                            dtype=dtype, rows=rows, compile=compile)
        out = []
        for p in pieces:
            if p.name in self.real:
                t = self.real[p.name].detach()
                value = (t if p.whole else t[p.start:p.stop]).to("cpu", self.written_dtype(p.name, dtype))
            else:
                value = values[p.name].to("cpu")
            value = value.contiguous()
            if compact and value.untyped_storage().nbytes() != value.nbytes:
                value = value.clone()
            out.append(value)
        return out

    def select(self, names: Sequence[str]) -> "Source":
        """The same source restricted to ``names`` (kept in this source's order)."""
        keep = set(names)
        ties = [[n for n in g if n in keep] for g in self.ties]
        return Source([n for n in self.names if n in keep], self.shapes, self.dtypes,
                      [g for g in ties if len(g) > 1], self.graph, self.real, self.hf_config, self.parameters)


def _of_graph(graph: InitGraph) -> Source:
    names = [n for n in graph.outputs if graph.info[n].persistent]
    return Source(names, {n: tuple(graph.spec(n).shape) for n in names}, {n: graph.spec(n).dtype for n in names},
                  [g for g in graph.ties if len(g) > 1], graph=graph, hf_config=graph.hf_config,
                  parameters={n for n in names if graph.info[n].is_parameter})


def _of_module(module: torch.nn.Module) -> Source:
    """The entries of ``module.state_dict()`` by key (``fxinit.entries``); deferred ones
    computed from its init graph, the others written as they are."""
    from torch.distributed.tensor import DTensor

    from fxinit.capture.deferred import is_deferred_tensor
    from fxinit.entries import extra_state_keys, model_entries
    from fxinit.extract import hf_config, init_graph

    extra = extra_state_keys(module)
    if extra:
        warnings.warn(f"fxinit writes the model's tensors: the extra state of {len(extra)} module(s) "
                      f"({', '.join(extra[:3])}{' ...' if len(extra) > 3 else ''}: get_extra_state) is not in this "
                      "checkpoint; load it with strict=False, or save model.state_dict() with torch after "
                      "materialize to keep it", stacklevel=4)
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[int, list[str]] = {}
    parameters = set()
    entries = model_entries(module)
    for e in entries:
        if e.key in tensors:
            continue
        if isinstance(e.tensor, DTensor):
            raise DeferredInitError(f"{e.key} is a DTensor: fxinit exports whole tensors",
                                    hint="export the model before sharding it, or its init graph "
                                         "(fxinit.save(graph, ...))")
        tensors[e.key] = e.tensor
        groups.setdefault(id(e.tensor), []).append(e.key)
        if e.is_parameter:
            parameters.add(e.key)
    deferred = [n for n, t in tensors.items() if is_deferred_tensor(t)]
    graph = init_graph(module, carry_real=False, entries=entries) if deferred else None  # real ones are written as they are
    real = {n: t for n, t in tensors.items() if not is_deferred_tensor(t)}
    return Source(list(tensors), {n: tuple(t.shape) for n, t in tensors.items()},
                  {n: t.dtype for n, t in tensors.items()}, [g for g in groups.values() if len(g) > 1],
                  graph=graph, real=real, hf_config=graph.hf_config if graph is not None else hf_config(module),
                  parameters=parameters)


def tied_to(ties: Sequence[Sequence[str]]) -> Mapping[str, str]:
    """``{name: the first name of its tie group}`` for tied names."""
    return {n: g[0] for g in ties for n in g}
