"""A ``torch.distributed.checkpoint`` directory, through DCP's own planner and storage writer.

``dcp.save`` runs a fixed protocol on a ``SavePlanner`` and a ``StorageWriter``: local
plans, a global plan and its ``Metadata``, ``write_data`` per plan, then ``finish``
(which writes ``.metadata``). fxinit runs the same protocol with one local plan per file
of about ``max_shard_size`` (as if each file were a rank's), so that files can be written,
verified and skipped one by one (``resume``) and by separate runs (``part``):

- the planner (a ``DefaultSavePlanner``) is given write items planned by fxinit — a
  tensor too large to hold is a set of row chunks, which is how DCP stores a sharded
  tensor — and answers ``resolve_data`` with values the producer computed ahead;
- the storage writer is DCP's ``FileSystemWriter`` on a file system whose streams write
  under a temporary name, count bytes and checksum them, and rename when complete;
- ``finish`` runs when every file of the plan is complete, with the write results of each
  file (recorded in its sidecar by the run that wrote it).

``dcp.load`` (and torchtitan's checkpointer, for a seed checkpoint) reads the result like
any checkpoint ``dcp.save`` wrote from one process.
"""

from __future__ import annotations

import dataclasses
import io
import os
import warnings
from contextlib import closing, contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from fxinit.errors import DeferredInitError
from fxinit.export.files import SinkFile, incomplete_file
from fxinit.export.plan import FilePlan, split_files
from fxinit.export.run import Export, Exported
from fxinit.export.source import Piece

_ITEM_OVERHEAD = 4096  # bytes torch.save adds around a tensor (zip records, alignment), at most


@dataclasses.dataclass(frozen=True)
class DcpFile(FilePlan):
    """One ``.distcp`` file: the pieces it holds, in order."""

    pieces: tuple[Piece, ...] = ()


def plan_files(export: Export) -> list[DcpFile]:
    """Every file of the checkpoint, ``__<k>_0.distcp`` as DCP names the file of plan ``k``.
    DCP's writer holds every tensor of a file until the file is written, so files are
    also kept to half of the memory budget."""
    source = export.source
    limit = min(export.max_shard_size, export.memory // 2)
    groups = split_files([(n, source.nbytes(n, export.dtype)) for n in source.names], limit)
    files = []
    for k, group in enumerate(groups):
        pieces = tuple(p for n, _ in group for p in export.pieces(n))
        files.append(DcpFile(f"__{k}_0.distcp", tuple(n for n, _ in group), sum(b for _, b in group), pieces))
    return files


def write_dcp(export: Export) -> Exported:
    """Write ``export`` as a ``torch.distributed.checkpoint`` directory."""
    files = plan_files(export)
    record = export.record(files)
    mine = export.mine(files)
    todo = [f for f in mine if not (export.resume and record.verified(f.file) is not None)]
    written = export.begin([f for f in mine if f not in todo],
                           [f.nbytes + _ITEM_OVERHEAD * len(f.pieces) for f in todo])
    fs = _RenamingFileSystem(written.progress.update)
    writer = FileSystemWriter(export.directory, single_file_per_rank=True, sync_files=True, thread_count=1,
                              overwrite=True)
    writer.fs = fs
    with closing(export.produce([p for f in todo for p in f.pieces], compact=True)) as values:
        planner = _Planner(export, [p for f in files for p in f.pieces], values)
        global_plans, metadata = _global_plan(export, files, planner, writer)
        for k, f in enumerate(files):
            if f not in todo:
                continue
            record.forget(f.file)
            results = writer.write_data(planner.finish_plan(global_plans[k]), planner).value()
            wrote = {r.storage_data.relative_path for r in results}
            if wrote != {f.file}:
                raise DeferredInitError(f"DCP wrote {sorted(wrote)} where fxinit planned {f.file}",
                                        hint="this torch names its checkpoint files differently; please report it")
            size, crc = fs.written.pop(str(export.directory / f.file))
            record.done(f.file, size, crc, results=[_result_json(r) for r in results])
            written.files.append(f.file)
    written.progress.close()
    sides = [record.recorded(f.file) for f in files]
    if all(s is not None for s in sides):
        results = [[_result(r) for r in s["results"]] for s in sides]  # type: ignore[index]
        writer.finish(metadata, results)
        written.finished = True
    return written


def _global_plan(export: Export, files: Sequence[DcpFile], planner: "_Planner",
                 writer: FileSystemWriter) -> tuple[list[SavePlan], Any]:
    """DCP's planning steps for one local plan per file."""
    source = export.source
    state_dict = {n: torch.empty(source.shapes[n], dtype=source.written_dtype(n, export.dtype), device="meta")
                  for n in source.names}
    planner.set_up_planner(state_dict, storage_meta=writer.storage_meta(), is_coordinator=True)
    writer.set_up_storage_writer(True)
    local = []
    for f in files:
        plan = SavePlan([_write_item(export, p) for p in f.pieces], planner_data={n: (n,) for n in f.names})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overwriting an existing checkpoint": resume does so on purpose
            local.append(writer.prepare_local_plan(plan))
    global_plans, metadata = planner.create_global_plan(local)
    return writer.prepare_global_plan(global_plans), metadata


def _write_item(export: Export, piece: Piece) -> WriteItem:
    """A whole tensor, or a chunk of rows of one (stored as DCP stores a shard)."""
    shape = export.source.shapes[piece.name]
    dtype = export.source.written_dtype(piece.name, export.dtype)
    offsets = torch.Size([piece.start] + [0] * (len(shape) - 1)) if shape else torch.Size([])
    sizes = torch.Size([piece.stop - piece.start, *shape[1:]]) if shape else torch.Size([])
    return WriteItem(index=MetadataIndex(piece.name, offsets),
                     type=WriteItemType.TENSOR if piece.whole else WriteItemType.SHARD,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                 properties=TensorProperties(dtype=dtype), size=torch.Size(shape)))


class _Planner(DefaultSavePlanner):
    """``DefaultSavePlanner`` whose data comes from the producer when the writer asks."""

    def __init__(self, export: Export, pieces: Sequence[Piece], values: Iterator[tuple[Piece, torch.Tensor]]) -> None:
        super().__init__()
        self._export = export
        self._values = values
        self._held: dict[Piece, torch.Tensor] = {}
        self._by_index = {(p.name, p.start): p for p in pieces}

    def lookup_object(self, index: MetadataIndex) -> Any:
        start = index.offset[0] if index.offset is not None and len(index.offset) else 0
        piece = self._by_index[(index.fqn, start)]
        if piece in self._held:
            return self._held.pop(piece)
        for produced, value in self._values:
            if produced == piece:
                return value
            self._held[produced] = value  # DCP asked in another order than planned
        return self._export.source.compute([piece], self._export.rng, self._export.seed, self._export.dtype)[0]


class _RenamingFileSystem(FileSystem):
    """DCP's ``FileSystem`` whose written files exist under their name only when complete
    (``files.incomplete_file``); ``written`` maps each path to its size and CRC-32."""

    def __init__(self, on_write: Callable[[int], None]) -> None:
        super().__init__()
        self._on_write = on_write
        self.written: dict[str, tuple[int, int]] = {}

    @contextmanager
    def create_stream(self, path: "str | os.PathLike", mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with incomplete_file(Path(path), self._on_write) as sink:
            stream = io.BufferedWriter(_RawSink(sink), buffer_size=1 << 20)
            yield stream
            stream.close()  # flushes (DCP closes it itself after syncing)
        self.written[str(path)] = (sink.size, sink.crc)


class _RawSink(io.RawIOBase):
    """A ``SinkFile`` as a raw stream (DCP calls ``tell``, ``fileno``, ``close``); closing
    it leaves the file to ``incomplete_file``, which syncs and renames it."""

    def __init__(self, sink: SinkFile) -> None:
        super().__init__()
        self._sink = sink

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        return self._sink.write(b)

    def tell(self) -> int:
        return self._sink.size

    def fileno(self) -> int:
        return self._sink.fd


def _result_json(r: WriteResult) -> dict[str, Any]:
    info = r.storage_data
    return {"fqn": r.index.fqn, "offset": None if r.index.offset is None else list(r.index.offset),
            "index": r.index.index, "size": r.size_in_bytes,
            "file": info.relative_path, "at": info.offset, "length": info.length}


def _result(d: dict[str, Any]) -> WriteResult:
    # DCP's file-system storage info; the writer creates it, fxinit recreates it for files
    # an earlier run wrote (``.metadata`` maps every chunk to its file, offset and length)
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    offset = None if d["offset"] is None else torch.Size(d["offset"])
    return WriteResult(index=MetadataIndex(d["fqn"], offset, d["index"]), size_in_bytes=d["size"],
                       storage_data=_StorageInfo(d["file"], d["at"], d["length"]))
