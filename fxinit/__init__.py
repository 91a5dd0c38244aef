"""fxinit: build big PyTorch models without allocating them, materialize exactly what you ask for.

    m = fxinit.trace_init(MyModel, *args)     # deferred: shapes, dtypes, no storage
    fxinit.materialize(m.layers[3])           # bit-for-bit what eager construction gives
    graph = fxinit.init_graph(m)              # the recorded torch.fx init graph
    fxinit.save(m, "ckpt/", format="hf")      # a checkpoint on disk, in bounded memory
"""

from fxinit.capture import DeferredTensor, clear_meta_init_cache, deferred_init, dry_run, is_meta_init, meta_init, recording, trace_init
from fxinit.graph import InitGraph, load_graph
from fxinit.errors import ArtifactError, DeferredInitError, ExportError
from fxinit.export import Exported, save
from fxinit.extract import init_graph
from fxinit.materialize import is_deferred, materialize, materialize_module, materialize_tensor
from fxinit.check import check
from fxinit import fsdp1 as _fsdp1  # noqa: F401  (FSDP1's deferred-init idiom: fxinit/fsdp1.py)
from fxinit import ddp as _ddp  # noqa: F401  (DistributedDataParallel of a deferred model: refused)

__version__ = "0.1.0"

__all__ = [
    "ArtifactError",
    "DeferredInitError",
    "DeferredTensor",
    "ExportError",
    "Exported",
    "InitGraph",
    "check",
    "clear_meta_init_cache",
    "deferred_init",
    "dry_run",
    "init_graph",
    "is_deferred",
    "is_meta_init",
    "load_graph",
    "materialize",
    "materialize_module",
    "materialize_tensor",
    "meta_init",
    "recording",
    "save",
    "trace_init",
]
