"""What an export directory holds: its plan, and which of its files are complete.

``<dir>/.fxinit/plan.json`` records the plan (the files, their tensors, and a fingerprint
of everything that decides their bytes: the init graph, its generator states, rng mode,
seed, dtype). After a file is synced and renamed to its final name, a sidecar
``<dir>/.fxinit/<file>.json`` records its size and CRC-32. A file is *complete and
verified* when its sidecar carries the current fingerprint and the file on disk has the
recorded size, the planned header (safetensors) and the recorded CRC-32 (read back from
disk). ``--resume`` skips such files and writes all others again; a file written without
its sidecar (a kill between the rename and the sidecar) is simply written again.
"""

from __future__ import annotations

import hashlib
import json
import zlib
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from fxinit.errors import ExportError
from fxinit.export.files import remove_incomplete, translated_errors, write_json
from fxinit.export.source import Source

RECORD_DIR = ".fxinit"
_READ_CHUNK = 64 << 20


def fingerprint(source: Source, options: dict[str, Any], files: Sequence[Any]) -> str:
    """A digest of everything that decides the exported bytes: the export's options, the file
    plan, the tensors' names, shapes and dtypes, the graph's ops, constants and generator
    states (``passes.fingerprint``) and which node each name reads, and real tensors' bytes."""
    from fxinit.passes.fingerprint import fingerprint as graph_fingerprint

    h = hashlib.blake2b(digest_size=16)
    h.update(json.dumps({"settings": options, "files": [repr(f) for f in files]}, sort_keys=True).encode())
    for name in source.names:
        h.update(f"{name}{source.shapes[name]}{source.dtypes[name]}".encode())
    graph = source.graph
    if graph is not None:
        nodes = graph.nodes
        h.update(graph_fingerprint(nodes, graph.constants, graph.snapshots).encode())
        h.update(repr((graph.default_dtype, graph.numerics)).encode())  # what the ops replay under
        index = {n: i for i, n in enumerate(nodes)}
        h.update(repr(sorted((k, index[v], graph.output_storage[k]) for k, v in graph.outputs.items())).encode())
    for name, t in source.real.items():
        h.update(name.encode())
        h.update(zlib.crc32(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
                 .to_bytes(4, "little"))
    return h.hexdigest()


class Record:
    """The ``.fxinit`` directory of an export."""

    def __init__(self, directory: Path, digest: str, files: Sequence[str]) -> None:
        self.directory = directory
        self.root = directory / RECORD_DIR
        self.digest = digest
        self.files = list(files)

    def start(self, resume: bool) -> None:
        """Record this plan. Without ``resume`` the files of an earlier, different plan are
        removed; with it, a directory holding a different plan is refused."""
        with translated_errors(self.root):
            self.root.mkdir(exist_ok=True)
            previous = self._read(self.root / "plan.json")
            if previous is not None and previous.get("fingerprint") != self.digest:
                if resume:
                    raise ExportError(
                        f"{self.directory} holds an export of another plan (other tensors, files, graph, rng, "
                        "seed or dtype)", hint="run without --resume to replace it, or export to a new directory")
                for name in previous.get("files", []):
                    (self.directory / name).unlink(missing_ok=True)
                    self.sidecar(name).unlink(missing_ok=True)
            if previous is None or previous.get("fingerprint") != self.digest:
                write_json(self.root / "plan.json", {"fingerprint": self.digest, "files": self.files})

    def sidecar(self, file: str) -> Path:
        return self.root / f"{file}.json"

    def forget(self, file: str) -> None:
        """``file`` is about to be written again: it is no longer complete (and what a
        killed run left of it goes)."""
        with translated_errors(self.sidecar(file)):
            self.sidecar(file).unlink(missing_ok=True)
            remove_incomplete(self.directory / file)

    def done(self, file: str, size: int, crc: int, **extra: Any) -> None:
        write_json(self.sidecar(file), {"fingerprint": self.digest, "size": size, "crc32": crc, **extra})

    def recorded(self, file: str) -> dict[str, Any] | None:
        """The sidecar of ``file`` when it was written for this plan and the file has the
        recorded size (a cheap check: what a part waits for before writing the index)."""
        side = self._read(self.sidecar(file))
        if side is None or side.get("fingerprint") != self.digest:
            return None
        path = self.directory / file
        if not path.is_file() or path.stat().st_size != side.get("size"):
            return None
        return side

    def verified(self, file: str, check_start: Callable[[Path], bool] | None = None) -> dict[str, Any] | None:
        """The sidecar of ``file`` when the file is complete and verified (size, planned
        start of file, CRC-32 of every byte read back), else None."""
        side = self.recorded(file)
        if side is None:
            return None
        path = self.directory / file
        if check_start is not None and not check_start(path):
            return None
        return side if file_crc(path) == side.get("crc32") else None

    @staticmethod
    def _read(path: Path) -> dict[str, Any] | None:
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None


def file_crc(path: Path) -> int:
    crc = 0
    with open(path, "rb", buffering=0) as f:
        buf = bytearray(_READ_CHUNK)
        view = memoryview(buf)
        while True:
            n = f.readinto(buf)
            if not n:
                return crc
            crc = zlib.crc32(view[:n], crc)
