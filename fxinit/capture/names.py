"""Names: where a module keeps its parameters and buffers, by fully qualified name, and
what a trace calls its modules and storages."""

from __future__ import annotations

import weakref
from typing import Callable, Iterable, Iterator

import torch
import torch.fx as fx


def tensor_slots(module: torch.nn.Module, modules: Iterable[tuple[str, torch.nn.Module]] | None = None,
                 ) -> Iterator[tuple[str, torch.nn.Module, str, str, torch.Tensor]]:
    """``(fully qualified name, owning module, "_parameters" | "_buffers", name, tensor)`` for
    every parameter and buffer under ``module``, under each of its names (ties and shared
    submodules included). ``modules``: its ``named_modules(remove_duplicate=False)`` when
    the caller has walked them already."""
    if modules is None:
        modules = module.named_modules(remove_duplicate=False)
    for mod_name, mod in modules:
        prefix = f"{mod_name}." if mod_name else ""
        for kind in ("_parameters", "_buffers"):
            for name, t in getattr(mod, kind).items():
                if t is not None:
                    yield prefix + name, mod, kind, name, t


def module_paths_of(named_modules: Iterable[tuple[str, torch.nn.Module]]) -> dict[int, str]:
    """id(module) -> its first dotted path."""
    paths: dict[int, str] = {}
    for name, mod in named_modules:
        paths.setdefault(id(mod), name)
    return paths


class TraceNames:
    """The names of a trace's modules and storages under its root model.

    Portable stream keys are storage names as they were when the trace ended, so that
    later wrapping (FSDP's sharding, DTensor parameters) does not rename them; node
    ``meta["module"]`` is the path a node's module had then."""

    def __init__(self, owns: Callable[[torch.Tensor], bool], storage_id: Callable[[torch.Tensor], int]) -> None:
        self._owns = owns  # whether a deferred tensor belongs to this trace
        self._storage_id = storage_id
        self._root: weakref.ReferenceType | None = None
        self._paths: dict[int, str] = {}
        self._at_end: dict[int, str] = {}  # storage id -> name when the trace ended
        self._given: dict[int, str] = {}  # storage id -> name (global tensors of DTensors)

    @property
    def root(self) -> torch.nn.Module | None:
        """The traced model, while it is alive."""
        return self._root() if self._root is not None else None

    def set_root(self, module: torch.nn.Module, graph: fx.Graph) -> None:
        self._root = weakref.ref(module)
        modules = list(module.named_modules(remove_duplicate=False))  # one walk for paths and names
        self._paths = module_paths_of(modules)
        self._at_end = self._current(modules)
        self.stamp_module_paths(graph)

    def forget_paths(self) -> None:
        """Module paths are looked up again next time (modules may have been wrapped)."""
        self._paths = {}

    def module_paths(self) -> dict[int, str]:
        """id(module) -> dotted path under the traced root (empty while it is being built)."""
        root = self.root
        if root is not None and not self._paths:
            self._paths = module_paths_of(root.named_modules(remove_duplicate=False))
        return self._paths

    def stamp_module_paths(self, graph: fx.Graph) -> None:
        """Give every node recorded so far ``meta["module"]``, its module's path now (at the
        end of the trace for the traced ops), so that later wrapping does not rename it."""
        paths = self.module_paths()
        for n in graph.nodes:
            ref = n.meta.get("module_ref")
            if "module" not in n.meta and ref is not None and ref() is not None and id(ref()) in paths:
                n.meta["module"] = paths[id(ref())]

    def storage_names(self) -> dict[int, str]:
        """Names of storages for portable stream keys: as they were when the trace ended,
        plus the current names of storages created after it."""
        names = self._current()
        names.update(self._given)
        names.update(self._at_end)
        return names

    def name_storage(self, t: torch.Tensor, name: str) -> None:
        """Name ``t``'s storage for portable stream keys (a tensor the model does not hold)."""
        self._given[self._storage_id(t)] = name

    def _current(self, modules: list[tuple[str, torch.nn.Module]] | None = None) -> dict[int, str]:
        """``{storage id: smallest fully qualified name of a deferred tensor in it}`` now."""
        names: dict[int, str] = {}
        root = self.root
        if root is None:
            return names
        for fqn, _, _, _, t in tensor_slots(root, modules):
            if self._owns(t):
                sid = self._storage_id(t)
                if sid not in names or fqn < names[sid]:
                    names[sid] = fqn
        return names
