"""Where a module keeps its parameters and buffers, by fully qualified name."""

from __future__ import annotations

from typing import Iterable, Iterator

import torch


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
