"""InitGraph: the contract between capture and everything after it.

An InitGraph is a ``torch.fx.Graph`` of init ops in program order (aten overloads,
``operator.getitem``, and the ops of ``fxinit.ops``), plus:

* ``outputs``: fully qualified name -> the node whose value is that parameter/buffer;
* ``ties``: groups of names that are the same tensor object (``head.weight`` tied to
  ``embed.weight``);
* ``constants``: real tensors the graph reads (``torch.tensor([...])``, numpy data);
* ``rng``: generator snapshots, one per random op, so each random op can be replayed
  on its own, in any order, without touching the user's generators.

Node metadata (``node.meta``): ``pos`` (program order), ``spec`` (TensorSpec of the
value), ``reads``/``mutates`` (storage ids, for slicing with aliasing), ``rng``
(snapshot keys), ``prov`` (Provenance), ``module`` (dotted path), ``default_dtype``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, NamedTuple

import torch
import torch.fx as fx

from fxinit.rng import RngSnapshot


class TensorSpec(NamedTuple):
    """Shape and placement of a value, as eager construction would have it."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    dtype: torch.dtype
    device: torch.device

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize

    @staticmethod
    def of(t: torch.Tensor, device: torch.device) -> "TensorSpec":
        return TensorSpec(tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype, device)


@dataclass(frozen=True)
class OutputInfo:
    """What a named output is besides its value."""

    requires_grad: bool
    is_parameter: bool
    persistent: bool = True


@dataclass
class InitGraph:
    """A self-contained init graph for a set of named parameters and buffers."""

    graph: fx.Graph
    outputs: dict[str, fx.Node]
    output_storage: dict[str, int]
    info: dict[str, OutputInfo]
    ties: list[list[str]]
    constants: dict[str, torch.Tensor]
    rng: dict[str, RngSnapshot]
    default_dtype: torch.dtype = field(default_factory=torch.get_default_dtype)

    @property
    def nodes(self) -> list[fx.Node]:
        return [n for n in self.graph.nodes if n.op not in ("output", "placeholder")]

    def spec(self, name: str) -> TensorSpec:
        return self.outputs[name].meta["spec"]

    def required_nodes(self, names: Iterable[str]) -> list[fx.Node]:
        """The nodes, in program order, that the named outputs need (a slice)."""
        from fxinit.passes.slicing import required_nodes

        return required_nodes(self.nodes, [(self.outputs[n], self.output_storage[n]) for n in names])

    def materialize(
        self, names: Iterable[str] | None = None, device: torch.device | str | None = None
    ) -> dict[str, torch.Tensor]:
        """Values of the named outputs (all if None), bit-for-bit equal to eager construction.

        Tensors are computed on the device eager construction would have used and then
        moved to ``device`` if one is given. Tied names map to the same tensor.
        """
        from fxinit.backends.eager import run_nodes

        wanted = list(self.outputs) if names is None else list(names)
        unknown = [n for n in wanted if n not in self.outputs]
        if unknown:
            raise KeyError(f"not outputs of this init graph: {unknown[:5]}")
        env = run_nodes(self.required_nodes(wanted), self.constants, self.rng, self.default_dtype,
                        keep={self.outputs[n] for n in wanted})
        out: dict[str, torch.Tensor] = {}
        for n in wanted:
            value = env[self.outputs[n]]
            if device is not None:
                value = value.to(device)
            out[n] = value
        return out

    def stats(self) -> dict[str, int]:
        nodes = self.nodes
        random = sum(1 for n in nodes if n.meta.get("rng"))
        out_bytes = sum(self.spec(n).nbytes for n in {ns[0] for ns in self._tie_representatives()})
        return {"nodes": len(nodes), "random_ops": random, "outputs": len(self.outputs),
                "constants": len(self.constants), "output_bytes": out_bytes}

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
        return (f"InitGraph({s['outputs']} outputs, {s['nodes']} nodes, {s['random_ops']} random ops, "
                f"{s['output_bytes'] / 2**20:.1f} MiB)")
