"""The real torchtitan package (0.3.0) under fxinit: its trainer's flow with only the build line
changed, on one process (tests/test_torchtitan.py) and laid out with torchtitan's own
``ParallelDims`` and ``parallelize_fn`` on 4 gloo CPU processes (this module's ``run``).

The trainer (torchtitan/trainer.py) does::

    with torch.device("meta"), set_default_dtype(...):
        model = model_config.build()
    model = model_spec.parallelize_fn(model, parallel_dims=..., training=..., parallelism=...,
                                      compile_config=..., ac_config=..., dump_folder=...)
    model.to_empty(device=init_device)
    with torch.no_grad():
        model.init_weights(buffer_device=buffer_device)   # None unless CPU offload

With fxinit the build line becomes ``model = fxinit.trace_init(model_config.build)`` (same dtype
context, no ``torch.device("meta")``), and ``fxinit.materialize(model)`` comes last. Each
rank's local shard of every parameter and buffer must then be, bit for bit, the matching slice
(torch's own ``distribute_tensor(..., src_data_rank=None)``, as in tests/layouts_worker.py) of
the same flow run on one process without any layout.

Each distributed scenario returns a list of failures (empty when every rank is right).
"""

from __future__ import annotations

import functools
import importlib
import sys
import tempfile
import traceback
import types
import warnings
from typing import Any, Callable

import torch
import torch.nn as nn

import fxinit
from tests.launch import serve

# As README.md's test command installs it.
INSTALL = "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 triton==3.9.0 tyro==1.0.17 docstring_parser"

SEQ_LEN = 2048  # TrainingConfig().seq_len: the trainer counts parameters and flops for it

# (family, flavor, layers kept) whose single-process flow is checked: each flavor's first
# layers, as many as it takes to hold every kind of layer it has (the layer configs differ
# otherwise only in their layer id and depth-scaled std): deepseek_v3 and kimi_k2_7 have a
# dense first layer and MoE layers after it, gpt_oss alternates two attention kinds,
# muse_glimmer's fourth layer differs from the first three; vision encoders and MTP layers
# are kept whole. llama3 debugmodel is kept whole (its forward pass is checked too).
# Left out: qwen3_5 (needs the `fla` package, flash-linear-attention) and flux (needs PIL and
# `datasets`), which the --no-deps install above does not bring.
FAMILIES = [("llama3", "debugmodel", None), ("deepseek_v3", "debugmodel", 2), ("gpt_oss", "debugmodel", 2),
            ("kimi_k2_7", "debugmodel", 2), ("muse_glimmer", "debugmodel", 4), ("muse_glimmer", "debugmodel_mm", 4),
            ("qwen3", "debugmodel", 2), ("qwen3", "debugmodel_moe", 2), ("qwen3", "debugmodel_non_fused_qkv", 2)]


def missing() -> str | None:
    """Why torchtitan cannot be used here (with how to install it), or None."""
    try:
        import spmd_types  # noqa: F401
        import torchtitan.models  # noqa: F401
        import tyro  # noqa: F401
    except Exception as exc:  # ImportError, or triton & co. missing at import time
        return (f"the torchtitan tests need the real torchtitan 0.3.0 package ({type(exc).__name__}: {exc}); "
                f"install it into this environment with: {INSTALL}")
    return None


def prepare() -> None:
    """What running torchtitan's layout code on CPU processes, without its trainer, needs.

    * ``ParallelDims.build_mesh`` builds its meshes on ``torchtitan.tools.utils.device_type``,
      which is ``"cuda"`` on a machine without an accelerator: point it at the CPU (gloo).
    * ``Decoder.Config.update_from_config`` (which sets the models' sharding configs) imports
      ``torchtitan.trainer`` only to ask ``isinstance(config, Trainer.Config)``; the trainer
      module needs ``torchdata``, which the ``--no-deps`` install leaves out. Where it cannot
      be imported, a stand-in ``Trainer`` whose ``Config`` nothing is an instance of gives the
      documented non-trainer path (``config`` is "any config-like object with a
      ParallelismConfig in its parallelism field").
    """
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"
    try:
        importlib.import_module("torchtitan.trainer")
    except ImportError:
        sys.modules.pop("torchtitan.trainer", None)
        stand_in = types.ModuleType("torchtitan.trainer")

        class Trainer:
            class Config:
                pass

        stand_in.Trainer = Trainer  # type: ignore[attr-defined]
        sys.modules["torchtitan.trainer"] = stand_in


def model_spec(family: str, flavor: str, n_layers: int | None = None) -> Any:
    """torchtitan's ModelSpec of ``family``/``flavor`` (a fresh config), optionally with only
    its first ``n_layers`` layers."""
    spec = importlib.import_module(f"torchtitan.models.{family}").model_registry(flavor)
    if n_layers is not None:
        spec.model.layers = spec.model.layers[:n_layers]
    return spec


def build(config: Any, how: str) -> nn.Module:
    """The trainer's build line (``how="meta"``), fxinit's replacement of it (``"fxinit"``),
    or eager construction on the CPU (``"cpu"``, the single-process reference), all in the
    trainer's default-dtype context.

    fxinit's line has no ``torch.device("meta")``: the trace replays the constructors as
    they run on the CPU, random draws included, so its values are those of ``"cpu"``, not of
    ``"meta"`` (where the constructors draw nothing and ``init_weights`` starts from the seed).
    """
    from torchtitan.tools.utils import set_default_dtype

    with set_default_dtype(torch.float32):  # TORCH_DTYPE_MAP[TrainingConfig().dtype]
        if how == "fxinit":
            return fxinit.trace_init(config.build)
        with torch.device(how):
            return config.build()


def init(model: nn.Module, buffer_device: torch.device | None = None) -> nn.Module:
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=buffer_device)
    model.train()
    return model


def tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, non-persistent buffers (RoPE caches) included."""
    return dict(list(model.named_parameters()) + list(model.named_buffers()))


def single_process(config: Any, seed: int = 0) -> dict[str, torch.Tensor]:
    """The reference: the flow on one process, on the CPU, no layout."""
    torch.manual_seed(seed)
    model = init(build(config, "cpu"))
    return {k: v.detach().clone() for k, v in tensors(model).items()}


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach()
    if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
        return False
    if a.dtype == torch.bool:
        a, b = a.to(torch.uint8), b.to(torch.uint8)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def describe(got: torch.Tensor, want: torch.Tensor) -> str:
    if got.shape != want.shape or got.dtype != want.dtype or got.device != want.device:
        return f"{tuple(got.shape)} {got.dtype} {got.device} where {tuple(want.shape)} {want.dtype} {want.device}"
    ne = (got != want).reshape(-1)
    if got.is_floating_point() or got.is_complex():
        ne |= got.isnan().reshape(-1) != want.isnan().reshape(-1)
    idx = ne.nonzero()
    if not len(idx):
        return "equal values, different bits (signed zeros?)"
    i = int(idx[0])
    return (f"{int(ne.sum())}/{ne.numel()} elements differ, first at flat {i}: "
            f"{got.reshape(-1)[i].item()!r} where {want.reshape(-1)[i].item()!r}")


# ------------------------------------------------------------------------------ layouts
def _placements(t: torch.Tensor) -> str:
    from torch.distributed.tensor import DTensor

    return f" {tuple(t.placements)} on {t.device_mesh.mesh_dim_names}" if isinstance(t, DTensor) else ""


def compare(model: nn.Module, want: dict[str, torch.Tensor], what: str,
            only: set[str] | None = None) -> list[str]:
    """Each of ``model``'s tensors (those named in ``only`` for values, when given): nothing
    deferred or meta; a DTensor's local tensor equal, bit for bit, to torch's own slice of
    the reference for its placements; a plain tensor equal to the reference."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    got = tensors(model)
    errors = [f"{what}: names differ {sorted(set(got) ^ set(want))[:6]}"] if got.keys() != want.keys() else []
    if fxinit.is_deferred(model):
        errors.append(f"{what}: fxinit.is_deferred(model) after materialize")
    for name, t in got.items():
        if name not in want:
            continue
        local = t._local_tensor if isinstance(t, DTensor) else t
        if fxinit.is_deferred(t) or fxinit.is_deferred(local):
            errors.append(f"{what}: {name}{_placements(t)} is still deferred")
            continue
        if t.device.type == "meta" or local.device.type == "meta":
            errors.append(f"{what}: {name}{_placements(t)} is on meta (device {t.device}, local {local.device})")
            continue
        expected = want[name]
        if isinstance(t, DTensor):
            expected = distribute_tensor(expected, t.device_mesh, t.placements, src_data_rank=None).to_local()
        if only is not None and name not in only:
            if local.shape != expected.shape or not torch.isfinite(local).all():
                errors.append(f"{what}: {name}{_placements(t)} local {tuple(local.shape)} where "
                              f"{tuple(expected.shape)}, or not finite")
            continue
        if not bits_equal(local, expected):
            errors.append(f"{what}: {name}{_placements(t)} local shard differs from the single-process "
                          f"slice: {describe(local.detach(), expected)}")
    return errors


#: layout -> (family, flavor, layers kept, ParallelismConfig fields)
LAYOUTS: dict[str, tuple[str, str, int, dict[str, Any]]] = {
    "fsdp": ("llama3", "debugmodel", 2, dict(data_parallel_shard_degree=4)),
    "tp": ("llama3", "debugmodel", 2, dict(tensor_parallel_degree=4, data_parallel_shard_degree=1)),
    "2d": ("llama3", "debugmodel", 2, dict(tensor_parallel_degree=2, data_parallel_shard_degree=2)),
    "hsdp": ("llama3", "debugmodel", 2, dict(data_parallel_replicate_degree=2, data_parallel_shard_degree=2)),
    "2d_full_dtensor": ("llama3", "debugmodel", 2, dict(tensor_parallel_degree=2, data_parallel_shard_degree=2,
                                                        spmd_backend="full_dtensor")),
    "moe_ep": ("deepseek_v3", "debugmodel", 2, dict(data_parallel_shard_degree=4, expert_parallel_degree=2)),
}
# spmd_backend: torchtitan 0.3.0's default is "spmd_types"; with torch 2.13 its FSDP step fails
# on the eager flow itself ("When dp_mesh_dims is provided, all parameters must be DTensors on
# the full SPMD mesh"), so the layouts use "partial_dtensor" (DTensor for the model-parallel
# axes, torchtitan's long-standing path) unless they say otherwise.


def _parallelism(fields: dict[str, Any]) -> Any:
    from torchtitan.config import ParallelismConfig

    return ParallelismConfig(**{"spmd_backend": "partial_dtensor", **fields})


def _flow(spec: Any, dims: Any, parallelism: Any, how: str,
          buffer_device: torch.device | None = None) -> nn.Module:
    """The trainer's order (torchtitan/trainer.py): build, verify, count, parallelize,
    to_empty, init_weights; then fxinit.materialize where traced."""
    from torchtitan.config import CompileConfig, TrainingConfig

    torch.manual_seed(0)
    model = build(spec.model, how)
    model.verify_module_protocol()
    spec.model.get_nparams_and_flops(model, SEQ_LEN)
    model = spec.parallelize_fn(model, parallel_dims=dims, training=TrainingConfig(), parallelism=parallelism,
                                compile_config=CompileConfig(), ac_config=None, dump_folder=tempfile.gettempdir())
    init(model, buffer_device)
    if how == "fxinit":
        fxinit.materialize(model)
    return model


@functools.lru_cache(maxsize=None)
def _reference(family: str, flavor: str, n_layers: int) -> tuple[dict[str, torch.Tensor], set[str]]:
    """Single-process values with seed 0, and the names of those that do not depend on the
    seed (equal with seed 1): norms, zeros, RoPE caches."""
    config = model_spec(family, flavor, n_layers).model
    want = single_process(config)
    return want, {k for k, v in single_process(config, seed=1).items() if bits_equal(v, want[k])}


_DIMS: dict[str, Any] = {}


def layout(name: str, world: int, buffer_device: torch.device | None = None) -> list[str]:
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed import utils as dist_utils

    family, flavor, n_layers, fields = LAYOUTS[name]
    what = name if buffer_device is None else f"{name} buffer_device={buffer_device}"
    spec = model_spec(family, flavor, n_layers)
    parallelism = _parallelism(fields)
    spec.model.update_from_config(config=types.SimpleNamespace(parallelism=parallelism))
    # One ParallelDims (so one set of meshes) per layout, for every flow on it, as one trainer
    # has: DTensor's sharding-propagation cache compares meshes by value, so a second set of
    # equal meshes would get back DTensors on the first set, and full_dtensor's fully_shard
    # checks identity ("Expected param's DTensor mesh to be the same mesh passed to fully_shard").
    if name not in _DIMS:
        _DIMS[name] = ParallelDims.from_config(parallelism, world)
        _DIMS[name].build_mesh()
    dims = _DIMS[name]
    dist_utils.set_spmd_backend(parallelism.spmd_backend)
    want, seed_free = _reference(family, flavor, n_layers)

    errors = []
    try:  # the harness itself: torchtitan's eager flow on the same layout
        eager = _flow(spec, dims, parallelism, "meta", buffer_device)
        # DTensor's random ops on CPU differ from one process by design: values of the tensors
        # that do not depend on the seed (norms, zeros, RoPE caches), shapes of the others.
        errors += compare(eager, want, f"{what} (eager torchtitan flow, no fxinit)", only=seed_free)
    except Exception:
        errors.append(f"{what}: the eager torchtitan flow (no fxinit) raised:\n{traceback.format_exc()[-3000:]}")
    try:
        model = _flow(spec, dims, parallelism, "fxinit", buffer_device)
    except Exception:
        return errors + [f"{what}: the fxinit flow raised:\n{traceback.format_exc()[-3000:]}"]
    return errors + compare(model, want, f"{what} (fxinit)")


def dtensor_device(world: int) -> list[str]:
    """The mechanism under the TP and full_dtensor failures, without torchtitan: the device a
    DTensor of a traced parameter reports to code outside torch.distributed. Eager gives the
    CPU; so does fxinit for the parameter itself (``reported_device``), and the DTensor must
    agree, before ``to_empty`` and after it (torchtitan's RoPE asks ``self.cache.device``)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(0)
    model = fxinit.trace_init(lambda: nn.Linear(8, 8))
    errors = []
    for placements in ([Replicate()], [Shard(0)]):
        dt = distribute_tensor(model.weight, mesh, placements)
        for when, t in (("distribute_tensor", dt), ("torch.empty_like(..., device='cpu') (to_empty)",
                                                    torch.empty_like(dt, device="cpu"))):
            if t.device != torch.device("cpu"):
                errors.append(f"{type(t).__name__} of traced nn.Linear(8, 8).weight, {placements}, after {when}: "
                              f".device is {t.device} where eager gives cpu (its local tensor reports "
                              f"{t._local_tensor.device})")
    return errors


SCENARIOS: dict[str, Callable[[int], list[str]]] = {name: (lambda w, n=name: layout(n, w)) for name in LAYOUTS}
# The TP and full_dtensor layouts again with the buffer device given (the trainer's CPU-offload
# path passes one): RoPE then does not ask its cache DTensor for its device.
SCENARIOS.update({f"{name}/buffer_device": (lambda w, n=name: layout(n, w, torch.device("cpu")))
                  for name in ("tp", "2d_full_dtensor")})
SCENARIOS["dtensor_device"] = dtensor_device


def run(rank: int, world: int, port: int, scenarios: list[str], queue: Any) -> None:
    def body() -> dict[str, Any]:
        warnings.filterwarnings("ignore", message="DTensor random operators may not have complete support")
        why = missing()
        if why is not None:
            raise RuntimeError(why)
        prepare()
        return {name: SCENARIOS[name](world) for name in scenarios}

    serve(rank, world, port, queue, body)

