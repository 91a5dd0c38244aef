"""A Hugging Face checkpoint directory, written tensor by tensor.

The layout ``save_pretrained`` writes: ``model-0000k-of-0000N.safetensors`` shards and
``model.safetensors.index.json`` (one ``model.safetensors`` when everything fits in one
file), tied tensors stored once under their first name, and ``config.json`` when the graph
was traced from a transformers config, so ``from_pretrained(directory)`` loads it as is.
Shards are written first, each complete before it is renamed; ``config.json`` and then
the index come last, once every shard of the plan is complete.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from fxinit.export.files import incomplete_file, write_json
from fxinit.export.plan import FilePlan, split_files
from fxinit.export.progress import Progress
from fxinit.export.run import Export, Exported
from fxinit.export.safetensors_format import header, read_header
from fxinit.export.source import Piece, tied_to

INDEX = "model.safetensors.index.json"


@dataclass(frozen=True)
class Shard(FilePlan):
    header: bytes = b""


def plan_shards(export: Export) -> list[Shard]:
    """The shards of the checkpoint (all of them, whichever part this run writes)."""
    source, dtype = export.source, export.dtype
    first = tied_to(source.ties)
    stored = [n for n in source.names if first.get(n, n) == n]
    groups = split_files([(n, source.nbytes(n, dtype)) for n in stored], export.max_shard_size)
    shards = []
    for k, group in enumerate(groups):
        file = "model.safetensors" if len(groups) == 1 else f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        names = tuple(n for n, _ in group)
        ties = [g for g in source.ties if g[0] in names]
        metadata = {"format": "pt", **({"fxinit.ties": json.dumps(ties)} if ties else {})}
        head = header([(n, source.shapes[n], source.written_dtype(n, dtype)) for n in names], metadata)
        shards.append(Shard(file, names, sum(b for _, b in group), head))
    return shards


def write_hf(export: Export) -> Exported:
    """Write ``export`` as a Hugging Face checkpoint directory."""
    shards = plan_shards(export)
    record = export.record(shards)
    mine = export.mine(shards)

    def complete(shard: Shard) -> bool:
        return record.verified(shard.file, lambda path: read_header(path) == shard.header) is not None

    todo = [s for s in mine if not (export.resume and complete(s))]
    written = export.begin([s for s in mine if s not in todo], [s.nbytes + len(s.header) for s in todo])
    pieces = {s.file: [p for n in s.names for p in export.pieces(n)] for s in todo}
    with closing(export.produce([p for s in todo for p in pieces[s.file]])) as values:
        for shard in todo:
            record.forget(shard.file)
            size, crc = _write_shard(export.directory / shard.file, shard.header, pieces[shard.file], values,
                                     written.progress)
            record.done(shard.file, size, crc)
            written.files.append(shard.file)
    written.progress.close()
    if all(record.recorded(s.file) is not None for s in shards):
        _finish(export, shards)
        written.finished = True
    return written


def write_file(export: Export, path: Path) -> Exported:
    """Write ``export`` as one safetensors file at ``path``, of any size: its header (names,
    dtypes and shapes, known before any value) first, then each tensor as it is computed,
    in the bounded memory of the sharded formats. Under a temporary name until complete."""
    shard = dataclasses.replace(plan_shards(dataclasses.replace(export, max_shard_size=1 << 62))[0], file=path.name)
    written = export.begin([], [shard.nbytes + len(shard.header)])
    pieces = [p for n in shard.names for p in export.pieces(n)]
    with closing(export.produce(pieces)) as values:
        _write_shard(path, shard.header, pieces, values, written.progress)
    written.files.append(path.name)
    written.progress.close()
    written.finished = True
    return written


def _write_shard(path: Path, head: bytes, pieces: list[Piece], values: Iterator[tuple[Piece, Any]],
                 progress: Progress) -> tuple[int, int]:
    """The header, then the values of ``pieces`` as ``values`` yields them; (size, CRC-32)."""
    with incomplete_file(path, progress.update) as f:
        f.write(head)
        for expected in pieces:
            piece, value = next(values)
            assert piece == expected, (piece, expected)
            f.write_tensor(value)
            del value
    return f.size, f.crc


def _finish(export: Export, shards: list[Shard]) -> None:
    """``config.json``, then the index: last, when every shard is complete."""
    source = export.source
    if source.hf_config is not None:
        write_json(export.directory / "config.json", _config(source.hf_config, export, shards))
    if len(shards) > 1:
        weight_map = {n: s.file for s in shards for n in s.names}
        metadata: dict[str, Any] = {"total_size": sum(s.nbytes for s in shards)}
        if source.parameters is not None:
            first = tied_to(source.ties)
            metadata["total_parameters"] = sum(_numel(source.shapes[n]) for n in source.names
                                               if n in source.parameters and first.get(n, n) == n)
        write_json(export.directory / INDEX, {"metadata": metadata, "weight_map": weight_map})


def _config(config: dict[str, Any], export: Export, shards: list[Shard]) -> dict[str, Any]:
    """The config with ``dtype`` set to the dtype the floating-point weights were written
    in, as ``save_pretrained`` sets it."""
    out = dict(config)
    source = export.source
    floating = [source.written_dtype(n, export.dtype) for s in shards for n in s.names
                if source.dtypes[n].is_floating_point]
    if floating:
        out["dtype"] = str(floating[0]).removeprefix("torch.")
    return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

