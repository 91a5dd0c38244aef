"""Which tensors go to which file, and which files a part of a parallel export writes.

Files are filled in state-dict order the way ``huggingface_hub.split_torch_state_dict_into_shards``
(what ``save_pretrained`` uses) fills them: a file is closed when the next tensor would take
it over the size limit, and a tensor larger than the limit gets a file of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(size: int | str) -> int:
    """``5GB`` -> 5 * 10**9 (``KB MB GB TB`` are powers of 10, ``KiB MiB GiB TiB`` of 2)."""
    if isinstance(size, int):
        if size <= 0:
            raise ValueError(f"a size must be positive, got {size}")
        return size
    match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", size)
    if not match or match.group(2).upper() not in _UNITS:
        raise ValueError(f"{size!r} is not a size like 5GB, 500MB or 2GiB")
    value = int(float(match.group(1)) * _UNITS[match.group(2).upper()])
    if value <= 0:
        raise ValueError(f"a size must be positive, got {size!r}")
    return value


@dataclass(frozen=True)
class FilePlan:
    """One file of the checkpoint: its name and the tensors it holds, in order."""

    file: str
    names: tuple[str, ...]
    nbytes: int


def split_files(sizes: Sequence[tuple[str, int]], max_bytes: int) -> list[list[tuple[str, int]]]:
    """``(name, bytes)`` in order, grouped into files of at most ``max_bytes`` (a larger
    tensor alone)."""
    files: list[list[tuple[str, int]]] = []
    current: list[tuple[str, int]] = []
    size = 0
    for name, nbytes in sizes:
        if nbytes > max_bytes:
            files.append([(name, nbytes)])
            continue
        if current and size + nbytes > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append((name, nbytes))
        size += nbytes
    if current or not files:
        files.append(current)
    return files


def parse_part(part: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """``"2/8"`` or ``(2, 8)`` -> (2, 8): the second of eight parts (counted from 1)."""
    if part is None:
        return None
    if isinstance(part, str):
        match = re.fullmatch(r"\s*([0-9]+)\s*/\s*([0-9]+)\s*", part)
        if not match:
            raise ValueError(f"{part!r} is not a part like 2/8 (the second of eight)")
        part = (int(match.group(1)), int(match.group(2)))
    k, n = part
    if not 1 <= k <= n:
        raise ValueError(f"part {k}/{n}: K must be between 1 and N")
    return k, n


def part_of(files: Sequence[FilePlan], part: tuple[int, int] | None) -> list[FilePlan]:
    """The files part ``k`` of ``n`` writes: the ``k``-th of ``n`` runs of consecutive files
    of about equal bytes (so a part is a contiguous range of layers, like a pipeline stage).
    The ``n`` parts together are every file, each once."""
    if part is None:
        return list(files)
    k, n = part
    total = sum(f.nbytes for f in files) or 1
    mine, done = [], 0
    for f in files:
        middle = (done + f.nbytes / 2) / total  # a file belongs to the part its middle falls in
        if min(n, int(middle * n) + 1) == k:
            mine.append(f)
        done += f.nbytes
    return mine
