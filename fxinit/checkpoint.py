"""Reading tensors by name from a checkpoint: a dict, a safetensors file, a torch.save file,
or a checkpoint sharded over several such files (a ``save_pretrained`` directory, its
``*.index.json``, or a list of files).

Files are opened lazily and memory-mapped, and only the tensors asked for are read, so a
checkpoint larger than memory can fill a model one tensor at a time; a shard that holds
nothing the caller asks for is never opened. ``torch.save`` files are read with
``weights_only=True``: no pickled code runs.
"""

from __future__ import annotations

import functools
import json
import os
from collections import OrderedDict, defaultdict
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, Union

import torch
from torch.nn.modules.batchnorm import _NormBase

from fxinit.capture.names import tensor_slots
from fxinit.distributed import local_part
from fxinit.errors import DeferredInitError

CheckpointSource = Union[Mapping[str, torch.Tensor], str, os.PathLike, Sequence[Union[str, os.PathLike]]]

# What ``save_pretrained`` writes (transformers', then diffusers' names), in the order a
# directory is searched.
_DIRECTORY_ENTRIES = ("model.safetensors.index.json", "model.safetensors",
                      "pytorch_model.bin.index.json", "pytorch_model.bin",
                      "diffusion_pytorch_model.safetensors.index.json", "diffusion_pytorch_model.safetensors",
                      "diffusion_pytorch_model.bin.index.json", "diffusion_pytorch_model.bin")


class _Part:
    """One mapping, or one file opened on first use."""

    def __init__(self, source: Mapping[str, torch.Tensor] | Path) -> None:
        self.path = source if isinstance(source, Path) else None
        self._dict: Mapping[str, torch.Tensor] | None = None if self.path is not None else source
        self._file: Any = None

    def _open(self) -> None:
        if self._dict is not None or self._file is not None:
            return
        path = self.path
        assert path is not None
        if not path.is_file():
            raise DeferredInitError(f"checkpoint file not found: {path}",
                                    hint="pass an existing file, a checkpoint directory or a list of files")
        if _is_safetensors(path):
            try:
                from safetensors import safe_open
            except ImportError as exc:
                raise DeferredInitError("reading a .safetensors checkpoint needs the safetensors package",
                                        hint="pip install safetensors") from exc
            self._file = safe_open(str(path), framework="pt", device="cpu")
        else:
            self._dict = _torch_load(path)

    def keys(self) -> list[str]:
        self._open()
        return list(self._dict.keys()) if self._dict is not None else list(self._file.keys())

    def shape(self, name: str) -> tuple[int, ...]:
        self._open()
        if self._dict is not None:
            return tuple(self.get(name).shape)
        return tuple(self._file.get_slice(name).get_shape())

    def get_part(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        self._open()
        if self._dict is not None:
            return self.get(name)[index]
        return self._file.get_slice(name)[index]

    def get(self, name: str) -> torch.Tensor:
        value = self.entry(name)
        if not isinstance(value, torch.Tensor):
            raise DeferredInitError(f"checkpoint entry {name!r} is a {type(value).__name__}, not a tensor",
                                    hint="pass a state dict that maps names to tensors")
        return value

    def entry(self, name: str) -> Any:
        """What the checkpoint holds under ``name``, a tensor or not (a module's extra state)."""
        self._open()
        return self._dict[name] if self._dict is not None else self._file.get_tensor(name)


class Checkpoint:
    """Named tensors, fetched one at a time (each a CPU tensor or the caller's own)."""

    def __init__(self, source: CheckpointSource) -> None:
        if isinstance(source, Mapping):
            self._part_of = _names_in([_Part(source)])
        elif isinstance(source, (str, os.PathLike)):
            self._part_of = _names_at(Path(source))
        elif isinstance(source, Sequence) and source and all(isinstance(p, (str, os.PathLike)) for p in source):
            self._part_of = _names_in([_Part(Path(p)) for p in source])
        else:
            raise TypeError("state_dict must be a mapping, a file or directory path, or a list of files, "
                            f"got {type(source).__name__}")

    def keys(self) -> set[str]:
        return set(self._part_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """The shape of ``name``, without reading its data."""
        return self._part_of[name].shape(name)

    def get_part(self, name: str, index: tuple[slice, ...]) -> torch.Tensor:
        """``get(name)[index]``; from a safetensors file only that part is read."""
        return self._part_of[name].get_part(name, index)

    def get(self, name: str) -> torch.Tensor:
        return self._part_of[name].get(name)

    def entry(self, name: str) -> Any:
        return self._part_of[name].entry(name)


def _names_at(path: Path) -> dict[str, _Part]:
    """Where each tensor of a file, an index file or a ``save_pretrained`` directory is."""
    if path.is_dir():
        entry = next((path / e for e in _DIRECTORY_ENTRIES if (path / e).is_file()), None)
        if entry is None:
            found = sorted(p.name for p in path.iterdir())[:8]
            raise DeferredInitError(
                f"checkpoint directory {path} has none of {', '.join(_DIRECTORY_ENTRIES)} (it has {found})",
                hint="pass the checkpoint file, or a list of its shard files")
        path = entry
    if path.name.endswith(".index.json"):
        return _indexed(path)
    return _names_in([_Part(path)])


def _indexed(index_path: Path) -> dict[str, _Part]:
    """The shards an ``*.index.json`` names, each opened only when one of its tensors is read."""
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not an object")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise DeferredInitError(
            f"cannot read checkpoint index {index_path}: {type(exc).__name__}: {exc}",
            hint='an index is a JSON object with a "weight_map" from tensor names to shard files') from exc
    parts: dict[str, _Part] = {}
    for shard in sorted(set(weight_map.values())):
        shard_path = index_path.parent / shard
        if not shard_path.is_file():
            raise DeferredInitError(f"checkpoint index {index_path} names {shard}, which does not exist",
                                    hint="all shards of a checkpoint must be in the index's directory")
        parts[shard] = _Part(shard_path)
    return {name: parts[shard] for name, shard in weight_map.items()}


def _names_in(parts: list[_Part]) -> dict[str, _Part]:
    part_of: dict[str, _Part] = {}
    for part in parts:
        for name in part.keys():
            other = part_of.setdefault(name, part)
            if other is not part:
                raise DeferredInitError(
                    f"checkpoint tensor {name!r} is in both {other.path} and {part.path}",
                    hint="pass each shard once; shards of one checkpoint hold disjoint names")
    return part_of


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


def checkpoint_values(module: torch.nn.Module, tensors: list[torch.Tensor], state_dict: CheckpointSource,
                       prefix: str, strict: bool, sharded: Mapping[int, tuple[Any, Any]] | None = None,
                       incompatible: list[list[str]] | None = None
                       ) -> tuple[dict[int, Callable[[], torch.Tensor]], Callable[[], None]]:
    """``id(tensor) -> reader of its checkpoint tensor`` for the deferred tensors the checkpoint
    names (for the deferred DTensors of ``sharded``, a reader of this rank's part only), and
    what ``load_state_dict`` does besides, to run once they are materialized: each module's
    extra state handed to its ``set_extra_state`` (megatron-core's and Transformer Engine's
    layers keep one; ``load_state_dict`` reads it under ``<module>._extra_state``).

    Names are ``prefix`` + the name under ``module``; of tied names, the first the
    checkpoint has wins. Tensors that are real already are not read (a part materialized
    before, from this checkpoint or not). Non-persistent buffers are not read, as
    ``load_state_dict`` reads none. Shapes must match; dtypes are converted as
    ``load_state_dict`` does. ``strict`` refuses missing keys (deferred tensors the checkpoint
    lacks, and the extra state of a module that holds one) and unexpected ones (keys under
    ``prefix`` that name nothing of the module); ``incompatible`` receives both lists.
    """
    ckpt = Checkpoint(state_dict)
    keys = ckpt.keys()
    targets: dict[int, Any] = {id(t): t for t in tensors}
    targets.update({tid: dt for tid, (dt, _) in (sharded or {}).items()})
    names: dict[int, list[str]] = defaultdict(list)
    module_keys: set[str] = set()
    holding: set[int] = set()  # modules (by id) holding a tensor this call materializes
    for name, mod, kind, local, t in tensor_slots(module):
        if id(t) in targets:
            holding.add(id(mod))
        if not (kind == "_buffers" and local in mod._non_persistent_buffers_set):
            module_keys.add(prefix + name)  # the names load_state_dict reads
            if id(t) in targets:
                names[id(t)].append(prefix + name)
    extra_keys = [(mod, f"{prefix}{path}{'.' if path else ''}{_EXTRA_STATE}")
                  for path, mod in module.named_modules(remove_duplicate=False)
                  if type(mod).set_extra_state is not _PLAIN_SET_EXTRA_STATE]
    module_keys.update(key for _, key in extra_keys)
    found: dict[int, str] = {}
    for tid, fqns in names.items():
        hit = next((k for k in fqns if k in keys), None)
        if hit is not None:
            found[tid] = hit
    filled = _filled_by_norms(module, prefix, keys, _metadata(state_dict))
    missing = sorted([n for tid, fqns in names.items() if tid not in found for n in fqns if n not in filled]
                     + [key for mod, key in extra_keys if key not in keys and id(mod) in holding])
    unexpected = sorted(k for k in keys if k.startswith(prefix) and k not in module_keys)
    if incompatible is not None:
        incompatible.extend([missing, unexpected])
    if strict and (missing or unexpected):
        raise DeferredInitError(
            f"checkpoint does not match the module: {len(missing)} missing key(s) {missing[:8]}"
            f"{' ...' if len(missing) > 8 else ''}, {len(unexpected)} unexpected key(s) {unexpected[:8]}"
            f"{' ...' if len(unexpected) > 8 else ''}",
            hint=_prefix_hint(missing, unexpected, prefix)
            + "pass strict=False to initialize what the checkpoint lacks and ignore what it has extra "
              "(materialize then returns the missing and unexpected keys, as load_state_dict does)")
    out: dict[int, Callable[[], torch.Tensor]] = {}
    for tid, key in found.items():
        shape = ckpt.shape(key)
        if shape != tuple(targets[tid].shape):  # a DTensor's shape is the full tensor's
            raise DeferredInitError(
                f"checkpoint tensor {key!r} has shape {shape}, the module's has "
                f"{tuple(targets[tid].shape)}",
                hint="check that the checkpoint belongs to this model and config")
        if sharded and tid in sharded:
            out[tid] = functools.partial(local_part, targets[tid], functools.partial(ckpt.get_part, key))
        else:
            out[tid] = functools.partial(ckpt.get, key)
    extra = [(mod, key) for mod, key in extra_keys if key in keys]
    return out, functools.partial(_set_extra_states, ckpt, extra)


def _metadata(state_dict: CheckpointSource) -> Mapping[str, dict] | None:
    """The per-module metadata ``Module.state_dict()`` attaches (``_metadata``: each module's
    ``version``), which ``load_state_dict`` hands each module's ``_load_from_state_dict``."""
    return getattr(state_dict, "_metadata", None) if isinstance(state_dict, Mapping) else None


def _filled_by_norms(module: torch.nn.Module, prefix: str, keys: set[str],
                     metadata: Mapping[str, dict] | None) -> set[str]:
    """Keys a checkpoint lacks that the norm layers' own loading fills in, so they are not
    missing: ``num_batches_tracked`` of a checkpoint older than the buffer (no ``version`` 2 in
    its metadata: torchvision's ImageNet files, any plain dict), which ``_NormBase`` gives its
    current value (here: the one the init graph computes)."""
    filled = set()
    for path, mod in module.named_modules():
        if not isinstance(mod, _NormBase) or not mod.track_running_stats:
            continue
        key = f"{prefix}{path}{'.' if path else ''}num_batches_tracked"
        version = (metadata or {}).get(f"{prefix}{path}".rstrip("."), {}).get("version")
        if key not in keys and (version is None or version < 2):
            filled.add(key)
    return filled


_EXTRA_STATE = "_extra_state"  # torch's key suffix (torch.nn.modules.module._EXTRA_STATE_KEY_SUFFIX)
_PLAIN_SET_EXTRA_STATE = torch.nn.Module.set_extra_state


def _set_extra_states(ckpt: Checkpoint, extra: list[tuple[torch.nn.Module, str]]) -> None:
    """``checkpoint_values``' second answer: each module's ``set_extra_state`` with what the
    checkpoint holds for it, once its tensors are materialized (``load_state_dict``'s order)."""
    for mod, key in extra:
        mod.set_extra_state(ckpt.entry(key))


#: ``_load_from_state_dict`` overrides whose effect fxinit's reading by name gives (torch's norm
#: layers: versions of their buffers older than any ``state_dict()`` of these years).
_LOADS_AS_PLAIN = frozenset({("torch.nn.modules.module", "Module._load_from_state_dict"),
                             ("torch.nn.modules.batchnorm", "_NormBase._load_from_state_dict"),
                             ("torch.nn.modules.instancenorm", "_InstanceNorm._load_from_state_dict")})


def loads_by_its_own_code(module: torch.nn.Module) -> list[str]:
    """The modules of ``module``'s tree (by path) whose own code changes what
    ``load_state_dict`` reads: load-state-dict hooks (torchtune's fusion layers rename keys,
    its CLIP embeddings interpolate a checkpoint's tiles, transformers' Mamba renames
    ``embedding.``) and ``_load_from_state_dict`` overrides (DETR's frozen batch norm)."""
    found = []
    for path, mod in module.named_modules():
        fn = type(mod)._load_from_state_dict
        hooks = [getattr(h, "hook", h) for h in (*mod._load_state_dict_pre_hooks.values(),
                                                 *mod._load_state_dict_post_hooks.values())]
        if any(not getattr(h, "__module__", "").startswith(_FSDP2) for h in hooks) or \
                (getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)) not in _LOADS_AS_PLAIN:
            found.append(path or type(mod).__name__)
    return found


#: FSDP2's load hooks: sharding what was loaded, which fxinit's reading of each rank's part does
_FSDP2 = "torch.distributed.fsdp._fully_shard."


def load_by_its_own_code(module: torch.nn.Module, state_dict: CheckpointSource, prefix: str,
                         strict: bool, init: bool = True) -> tuple[list[str], list[str]]:
    """``module.load_state_dict`` of the checkpoint's entries under ``prefix``, on the deferred
    model (its copies are recorded like any other write), for a model whose own code changes
    what loading reads (``loads_by_its_own_code``); the missing and unexpected keys, with
    ``prefix``. The entries are read whole, as ``load_state_dict`` takes them. Refused for a
    materialize with ``init=False``, which runs no recorded write."""
    if not init:
        raise DeferredInitError(
            f"materialize(init=False, state_dict=...) of a model whose own code changes what load_state_dict reads "
            f"({', '.join(loads_by_its_own_code(module)[:3])}): fxinit loads it by that code, as recorded writes, "
            "which init=False does not run", hint="materialize(..., state_dict=...) with init=True, or "
                                                   "materialize(init=False) and then model.load_state_dict(...)")
    ckpt = Checkpoint(state_dict)
    entries = OrderedDict((k[len(prefix):], ckpt.entry(k)) for k in sorted(ckpt.keys()) if k.startswith(prefix))
    metadata = _metadata(state_dict)
    if metadata is not None:  # each module's version, which its own _load_from_state_dict may read
        entries._metadata = OrderedDict((path[len(prefix):], meta) for path, meta in metadata.items()  # type: ignore[attr-defined]
                                        if (path + ".").startswith(prefix) or prefix == "")
    try:
        result = module.load_state_dict(entries, strict=strict)
    except RuntimeError as exc:
        raise DeferredInitError(
            f"checkpoint does not match the module, as its own load_state_dict says: {exc}",
            hint="pass strict=False to initialize what the checkpoint lacks (the loads that matched were recorded, "
                 "as eager's load_state_dict copies them before it raises)") from exc
    return [prefix + k for k in result.missing_keys], [prefix + k for k in result.unexpected_keys]


def _prefix_hint(missing: list[str], unexpected: list[str], prefix: str) -> str:
    """A hint when one prefix added or dropped explains the mismatch (``module.`` of DDP,
    ``_orig_mod.`` of torch.compile, ``model.`` of a wrapper)."""
    if not missing or not unexpected:
        return ""
    want = {k[len(prefix):] for k in missing}
    have = [k[len(prefix):] for k in unexpected]
    for k in have:
        for cut in range(1, k.count(".") + 1):
            head = ".".join(k.split(".", cut)[:cut]) + "."
            explained = sum(h.startswith(head) and h[len(head):] in want for h in have)
            if k[len(head):] in want and explained * 2 >= len(want):
                return (f"the checkpoint's keys carry a prefix {head!r} the module's lack: pass "
                        f"prefix={prefix + head!r}, or strip it from the keys; ")
    have_set = set(have)
    for k in want:
        for cut in range(1, k.count(".") + 1):
            head = ".".join(k.split(".", cut)[:cut]) + "."
            if k[len(head):] in have_set:
                return (f"the module's keys carry a prefix {head!r} the checkpoint's lack: materialize the "
                        f"submodule under {head[:-1]!r} instead; ")
    return ""
