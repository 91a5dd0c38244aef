"""Reading tensors by name from a checkpoint: a dict, a safetensors file, a torch.save file.

Files are opened lazily and memory-mapped, and only the tensors asked for are read, so a
checkpoint larger than memory can fill a model one tensor at a time. ``torch.save`` files
are read with ``weights_only=True``: no pickled code runs.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Union

import torch

from fxinit.errors import DeferredInitError

CheckpointSource = Union[Mapping[str, torch.Tensor], str, os.PathLike]


class Checkpoint:
    """Named tensors, fetched one at a time (each a CPU tensor or the caller's own)."""

    def __init__(self, source: CheckpointSource) -> None:
        self._dict: Mapping[str, torch.Tensor] | None = None
        self._file: Any = None
        if isinstance(source, Mapping):
            self._dict = source
        elif isinstance(source, (str, os.PathLike)):
            path = Path(source)
            if not path.is_file():
                raise DeferredInitError(f"checkpoint file not found: {path}", hint="pass a path to a file")
            if _is_safetensors(path):
                try:
                    from safetensors import safe_open
                except ImportError as exc:
                    raise DeferredInitError("reading a .safetensors checkpoint needs the safetensors package",
                                            hint="pip install safetensors") from exc
                self._file = safe_open(str(path), framework="pt", device="cpu")
            else:
                self._dict = _torch_load(path)
        else:
            raise TypeError(f"state_dict must be a mapping or a file path, got {type(source).__name__}")

    def keys(self) -> set[str]:
        return set(self._dict.keys()) if self._dict is not None else set(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of ``name``, without reading its data."""
        if self._dict is not None:
            return tuple(self.get(name).shape)
        return tuple(self._file.get_slice(name).get_shape())

    def get_part(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``get(name)[index]``; from a safetensors file only that part is read."""
        if self._dict is not None:
            return self.get(name)[index]
        return self._file.get_slice(name)[index]

    def get(self, name: str) -> torch.Tensor:
        value = self._dict[name] if self._dict is not None else self._file.get_tensor(name)
        if not isinstance(value, torch.Tensor):
            raise DeferredInitError(f"checkpoint entry {name!r} is a {type(value).__name__}, not a tensor",
                                    hint="pass a state dict that maps names to tensors")
        return value


def _is_safetensors(path: Path) -> bool:
    if path.suffix == ".safetensors":
        return True
    with open(path, "rb") as f:
        head = f.read(9)
    return len(head) == 9 and head[8:9] == b"{"  # 8-byte header length, then a JSON header


def _torch_load(path: Path) -> Mapping[str, torch.Tensor]:
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as exc:  # not a zip-format torch.save file, or unsafe content
        raise DeferredInitError(f"cannot read checkpoint {path}: {type(exc).__name__}: {exc}",
                                hint="pass a safetensors file, a torch.save'd state dict, or a dict") from exc
    if not isinstance(loaded, Mapping):
        raise DeferredInitError(f"checkpoint {path} holds a {type(loaded).__name__}, not a state dict",
                                hint="torch.save(model.state_dict(), path) makes one")
    return loaded
