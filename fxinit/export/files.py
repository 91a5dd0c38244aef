"""Files that exist under their final name only when complete.

Every file of an export is written under ``<name>.<pid>.incomplete``, synced to disk, and then
renamed (the directory synced too), so a killed run, a full disk or an I/O error never
leaves a file that looks complete. Errors of the file system become one-line
``ExportError``s with a hint, and the incomplete file is removed.
"""

from __future__ import annotations

import errno
import glob
import json
import mmap
import os
import shutil
import zlib
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from fxinit.errors import ExportError

INCOMPLETE = ".incomplete"
_WRITE_CHUNK = 256 << 20  # bytes per write call (Linux writes at most ~2 GiB per call)
_STAGE = 16 << 20  # bytes per direct write
_BLOCK = 4096  # direct writes start and end on multiples of this


class SinkFile:
    """An open ``.incomplete`` file: writes, a running CRC-32 of everything written (the
    checksums resume verifies), and a callback with each byte count (progress).

    Where the file system allows, the file is opened with ``O_DIRECT`` and written from
    an aligned staging buffer: the bytes go to the device without passing through the
    page cache, which on the machines measured costs a fifth of the CPU time per byte
    (copying into the cache and allocating it cost more than generating the numbers) and
    leaves other processes' cached files alone."""

    def __init__(self, path: Path, on_write: Callable[[int], None] | None = None) -> None:
        self.path = path
        self.fd, self.direct = _open_for_writing(path)
        self.size = 0
        self.crc = 0
        self._on_write = on_write
        self._stage = mmap.mmap(-1, _STAGE) if self.direct else None  # page-aligned
        self._staged = 0

    def write(self, data: "bytes | memoryview") -> int:
        view = memoryview(data).cast("B")
        for lo in range(0, len(view), _WRITE_CHUNK):
            part = view[lo:lo + _WRITE_CHUNK]
            self.crc = zlib.crc32(part, self.crc)
            if self._stage is not None:
                self._stage_bytes(part)
            else:
                _write_all(self.fd, part)
            self.size += len(part)
            if self._on_write is not None:
                self._on_write(len(part))
        return len(view)

    def _stage_bytes(self, part: memoryview) -> None:
        assert self._stage is not None
        while len(part):
            n = min(_STAGE - self._staged, len(part))
            self._stage[self._staged:self._staged + n] = part[:n]
            self._staged += n
            part = part[n:]
            if self._staged == _STAGE:
                _write_all(self.fd, memoryview(self._stage))
                self._staged = 0

    def write_tensor(self, t: torch.Tensor) -> int:
        """The bytes of contiguous CPU tensor ``t``."""
        if t.numel() == 0:
            return 0
        return self.write(t.reshape(-1).view(torch.uint8).numpy().data)

    def sync(self) -> None:
        """Everything written is on the device (the last direct block padded, then cut)."""
        if self._stage is not None and self._staged:
            padded = -(-self._staged // _BLOCK) * _BLOCK
            self._stage[self._staged:padded] = bytes(padded - self._staged)
            _write_all(self.fd, memoryview(self._stage)[:padded])
            self._staged = 0
            os.ftruncate(self.fd, self.size)
        os.fdatasync(self.fd)

    def close(self) -> None:
        self._stage = None  # unmapped once no view of it is left (an error's traceback may hold one)
        if self.fd >= 0:
            fd, self.fd = self.fd, -1
            os.close(fd)


def _open_for_writing(path: Path) -> tuple[int, bool]:
    """The file descriptor, and whether it writes directly to the device (``O_DIRECT``)."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    direct = getattr(os, "O_DIRECT", 0)
    if direct:
        try:
            return os.open(path, flags | direct, 0o666), True
        except OSError as exc:
            if exc.errno != errno.EINVAL:  # EINVAL: this file system has no direct I/O
                raise
    return os.open(path, flags, 0o666), False


def _write_all(fd: int, view: memoryview) -> None:
    while len(view):
        view = view[os.write(fd, view):]


@contextmanager
def incomplete_file(final: Path, on_write: Callable[[int], None] | None = None) -> Iterator[SinkFile]:
    """A ``SinkFile`` written under ``final.incomplete``, synced and renamed to ``final``
    when the block ends without an error; removed otherwise."""
    temp = final.with_name(f"{final.name}.{os.getpid()}{INCOMPLETE}")  # parts may write the same shared file
    with translated_errors(final):
        sink = SinkFile(temp, on_write)
        try:
            yield sink
            sink.sync()
            sink.close()
            os.replace(temp, final)
            sync_directory(final.parent)
        except BaseException:
            sink.close()
            temp.unlink(missing_ok=True)
            raise


def write_json(path: Path, data: Any) -> None:
    """``data`` as JSON at ``path``, complete or not at all."""
    with incomplete_file(path) as f:
        f.write((json.dumps(data, indent=2, sort_keys=True) + "\n").encode())


def sync_directory(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def prepare_directory(path: Path) -> None:
    """Create ``path`` (and its parents) and check it can be written."""
    if path.exists() and not path.is_dir():
        raise ExportError(f"{path} exists and is not a directory",
                          hint="give -o a directory to write the checkpoint in")
    with translated_errors(path):
        path.mkdir(parents=True, exist_ok=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, "permission denied", str(path))


def check_free_space(path: Path, needed: int) -> None:
    """Refuse up front when the file system of ``path`` has less free space than ``needed``."""
    free = shutil.disk_usage(path).free
    if needed > free:
        raise ExportError(f"not enough disk space in {path}: the export needs {_gb(needed)}, {_gb(free)} are free",
                          hint="free space or choose another directory with -o; --only or --part write less")


def remove_incomplete(path: Path) -> None:
    """Remove what a killed run left of ``path`` (its ``.incomplete`` files)."""
    for p in path.parent.glob(f"{glob.escape(path.name)}.*{INCOMPLETE}"):
        p.unlink(missing_ok=True)


@contextmanager
def translated_errors(path: Path) -> Iterator[None]:
    """File-system errors as one-line ``ExportError``s that say what to do."""
    try:
        yield
    except OSError as exc:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise ExportError(f"no space left on the device writing {path}",
                              hint=f"free space ({_gb(_free(path))} free now) or choose another directory with -o, "
                                   "then run again with --resume to keep the files already complete") from None
        if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOTDIR, errno.EEXIST):
            raise ExportError(f"cannot write {path}: {os.strerror(exc.errno).lower()}",
                              hint="choose a directory you can write with -o") from None
        raise ExportError(f"writing {path} failed: {exc.strerror or exc}",
                          hint="check the device; --resume keeps the files already complete") from None


def _free(path: Path) -> int:
    for p in (path, *path.parents):
        try:
            return shutil.disk_usage(p).free
        except OSError:
            continue
    return 0


def _gb(n: int) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
