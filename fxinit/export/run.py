"""One export run: its options, and what every format's writer shares (the plan record,
the part to write, the pieces, the producer, free space and progress)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence, TypeVar

import torch

from fxinit.export.files import check_free_space
from fxinit.export.plan import FilePlan, part_of
from fxinit.export.produce import Producer, batches
from fxinit.export.progress import Progress
from fxinit.export.resume import Record, fingerprint
from fxinit.export.source import Piece, Source
from fxinit.numerics import Settings, distinct_settings, settings_applied
from fxinit.rng.portable import STREAM_VERSION

F = TypeVar("F", bound=FilePlan)


@dataclass
class Exported:
    """What a run did: files written and files found complete (``--resume``), bytes,
    seconds, and whether the checkpoint is finished (its index written)."""

    files: list[str]
    skipped: list[str]
    progress: Progress
    finished: bool = False

    @property
    def bytes(self) -> int:
        return self.progress.written

    @property
    def seconds(self) -> float:
        return self.progress.seconds


@dataclass
class Export:
    """The options of one export (see ``fxinit.save``)."""

    source: Source
    directory: Path
    format: str
    rng: str = "exact"
    seed: int | None = None
    dtype: torch.dtype | None = None
    max_shard_size: int = 5 * 10**9
    part: tuple[int, int] | None = None
    resume: bool = False
    memory: int = 1 << 30
    workers: int = 1
    quiet: bool = False
    compile: bool | str | None = None  # portable mode: compiled fills (the same values: not in the plan's fingerprint)
    device: torch.device | None = None  # where values are computed (the same values: not in the fingerprint)
    _record: Record | None = field(default=None, repr=False)

    def record(self, files: Sequence[FilePlan]) -> Record:
        """The directory's record for this plan (started: see ``Record.start``)."""
        options = {"format": self.format, "rng": self.rng, "seed": self.seed, "dtype": str(self.dtype),
                   "stream": STREAM_VERSION if self.rng == "portable" else None}
        self._record = Record(self.directory, fingerprint(self.source, options, files), [f.file for f in files])
        self._record.start(self.resume)
        return self._record

    def mine(self, files: Sequence[F]) -> list[F]:
        return part_of(files, self.part)

    def begin(self, skipped: Sequence[FilePlan], sizes: Sequence[int]) -> Exported:
        """Check the disk can take ``sizes`` more bytes; start the progress bar."""
        check_free_space(self.directory, sum(sizes))
        return Exported([], [f.file for f in skipped], Progress(sum(sizes), self.quiet, desc=f"export {self.format}"))

    @property
    def ahead(self) -> int:
        """Bytes computed ahead of the writer. DCP's writer keeps every tensor of a file
        until the file is done: there, half of ``memory`` goes to that, half to this."""
        return self.memory // 2 if self.format == "dcp" else self.memory

    @property
    def piece_bytes(self) -> int:
        """Tensors above this size are computed in pieces (if they can be)."""
        return max(1 << 20, self.ahead // (2 * self.workers + 2))

    def pieces(self, name: str) -> list[Piece]:
        return self.source.pieces(name, self.dtype, self.rng, self.piece_bytes)

    def produce(self, pieces: Sequence[Piece], compact: bool = False) -> Iterator[tuple[Piece, torch.Tensor]]:
        """``(piece, value)`` in the order of ``pieces``, computed ahead on worker threads;
        ``compact``: each value in a storage of its own (not a view of a larger one)."""
        workers = self.workers if len(_settings(self.source)) <= 1 else 1
        producer = Producer(lambda batch: self.source.compute(batch, self.rng, self.seed, self.dtype, compact,
                                                              self.compile, self.device),
                            batches(pieces, self.piece_bytes), self.ahead, workers)
        with _settings_applied(self.source):
            yield from producer


def _settings(source: Source) -> set[Settings]:
    """The settings the graph's ops were recorded under (default dtype, ``fxinit.numerics``):
    one, and they are set for the whole run, so materializations on several threads never
    switch them; several, and the run has one thread."""
    graph = source.graph
    if graph is None:
        return set()
    return distinct_settings(Settings(graph.default_dtype, graph.numerics), graph.nodes)


@contextlib.contextmanager
def _settings_applied(source: Source) -> Iterator[None]:
    """The graph's settings in force for the run, when it has one set of them."""
    settings = _settings(source)
    if len(settings) != 1:
        yield
        return
    with settings_applied(next(iter(settings))):
        yield
