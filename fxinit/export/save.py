"""``fxinit.save``: a model's freshly initialized weights as a checkpoint on disk, in
bounded memory whatever the model's size."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from fxinit.arguments import checked_device, checked_dtype, checked_seed
from fxinit.errors import DeferredInitError
from fxinit.export.files import prepare_directory
from fxinit.export.plan import parse_part, parse_size
from fxinit.export.run import Export, Exported
from fxinit.export.source import Source
from fxinit.graph import InitGraph

FORMATS = ("hf", "dcp", "safetensors")


def save(obj: "torch.nn.Module | InitGraph | str | os.PathLike", directory: "str | os.PathLike", *,
         format: str = "hf", rng: str = "exact", seed: int | None = None, dtype: torch.dtype | None = None,
         only: str | None = None, part: "str | tuple[int, int] | None" = None,
         max_shard_size: int | str = "5GB", resume: bool = False, memory: int | str = "1GiB",
         workers: int | None = None, quiet: bool = True, compile: bool | str | None = None,
         device: torch.device | str | None = None) -> Exported:
    """Write what ``obj.state_dict()`` holds (its keys, after its state-dict hooks; no
    non-persistent buffers) — ``obj`` a model traced with ``trace_init`` (tensors already
    materialized are written as they are), an ``InitGraph``, or an init-graph file — to the
    checkpoint directory ``directory``, or with ``format="safetensors"`` to the one file
    ``directory`` names.

    ``format="hf"``: ``save_pretrained``'s layout (safetensors shards of at most
    ``max_shard_size``, their index, ``config.json`` for a graph traced from a transformers
    config). ``format="dcp"``: a ``torch.distributed.checkpoint`` directory (``dcp.load``,
    torchtitan's seed checkpoint), files of at most ``max_shard_size``.
    ``format="safetensors"``: one file of any size, its header first, tensors streamed after
    it (``safetensors.torch.load_file`` and ``load_state_dict`` read it; ties stored once,
    listed in its ``fxinit.ties`` metadata). Values are exact
    (``rng="exact"``) or the portable stream (``rng="portable"``, ``seed``; ``compile`` as
    for ``fxinit.materialize``); ``dtype`` casts floating-point tensors as ``Module.to`` would;
    ``device`` is where they are computed (default: where each was meant to be).

    Tensors are computed on ``workers`` threads (default: torch's thread count) while
    earlier ones are written, with at most ``memory`` bytes computed and not yet written;
    a larger tensor is computed and written in pieces of rows where its init allows.
    Each file is written under a temporary name and renamed when complete; the index
    comes last. ``resume=True`` keeps the files a killed run completed (verified by
    size and CRC-32) and writes the rest. ``only`` (a glob, or a module prefix) writes a
    checkpoint of the matching tensors only; ``part="k/n"`` writes the ``k``-th of ``n``
    parts of the whole checkpoint (runs of consecutive files of about equal size), so that
    ``n`` runs into one directory make one checkpoint: the run that completes the set
    writes the index.
    """
    seed, dtype, device = checked_seed(seed), checked_dtype(dtype), checked_device(device)
    from fxinit.report import matching

    if format not in FORMATS:
        raise ValueError(f"format={format!r}: choose one of {', '.join(FORMATS)}")
    if rng not in ("exact", "portable"):
        raise ValueError(f"rng={rng!r}: choose 'exact' or 'portable'")
    if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
        raise TypeError(f"dtype={dtype}: like Module.to, save takes a floating-point or complex dtype")
    if format == "safetensors" and (part is not None or resume):
        raise ValueError("part= and resume= are for the checkpoint directories (format='hf' or 'dcp')")
    source = Source.of(obj)
    names = matching(source.names, only)
    if not names:
        raise DeferredInitError(f"only={only!r} matches no tensor to save",
                                hint="a glob over names ('model.layers.3.*') or a module prefix ('model.layers.3')")
    if rng == "portable" and seed is None and source.graph is not None:
        seed = source.graph.seed
    export = Export(source.select(names), Path(directory), format, rng=rng, seed=seed, dtype=dtype,
                    max_shard_size=parse_size(max_shard_size), part=parse_part(part), resume=resume,
                    memory=parse_size(memory), workers=workers or torch.get_num_threads(), quiet=quiet,
                    compile=compile, device=device)
    if format == "safetensors":
        from fxinit.export.hf import write_file

        path = Path(directory)
        export.directory = path.parent if str(path.parent) else Path(".")
        return write_file(export, path)
    prepare_directory(export.directory)
    if format == "hf":
        from fxinit.export.hf import write_hf

        return write_hf(export)
    from fxinit.export.dcp import write_dcp

    return write_dcp(export)
