"""Worker processes for tests/test_layouts.py (gloo, CPU): every torch.distributed layout of a
traced model, each rank's local tensors against the matching slice (torch's own
``distribute_tensor(..., src_data_rank=None)``) of single-process eager construction.

Each scenario returns a list of failures (empty when every rank is bit for bit right), or,
for the portable ones, the gathered full tensors."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.placement_types import _StridedShard

import fxinit
from tests.launch import serve

_EXAMPLE = pathlib.Path(__file__).resolve().parent.parent / "docs" / "examples" / "titan_llama.py"


def titan() -> Any:
    """docs/examples/titan_llama.py, the guide's runnable torchtitan-style model."""
    if "titan_llama" not in sys.modules:
        spec = importlib.util.spec_from_file_location("titan_llama", _EXAMPLE)
        module = importlib.util.module_from_spec(spec)
        sys.modules["titan_llama"] = module
        spec.loader.exec_module(module)
    return sys.modules["titan_llama"]


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict(keep_vars=True).items()}


def compare(model: nn.Module, want: dict[str, torch.Tensor], what: str) -> list[str]:
    """Every tensor of ``model``: a DTensor's local tensor must equal torch's own slice of
    the reference for its placements; a plain tensor must equal the reference."""
    got = _state(model)
    errors = [f"{what}: names differ {sorted(set(got) ^ set(want))[:4]}"] if got.keys() != want.keys() else []
    for name, t in got.items():
        if name not in want:
            continue
        if fxinit.is_deferred(t):
            errors.append(f"{what}: {name} is still deferred")
            continue
        if isinstance(t, DTensor):
            expected = distribute_tensor(want[name], t.device_mesh, t.placements, src_data_rank=None).to_local()
            if not _bits(t.to_local(), expected):
                errors.append(f"{what}: {name} {tuple(t.placements)} local differs")
        elif not _bits(t, want[name]):
            errors.append(f"{what}: {name} differs")
    return errors


def _bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach()
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.contiguous().view(torch.uint8),
                                                                     b.contiguous().view(torch.uint8))


def eager(factory: Callable[[], nn.Module], seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    return {k: v.detach().clone() for k, v in factory().state_dict().items()}


def traced(factory: Callable[[], nn.Module], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return fxinit.trace_init(factory)


class MoE(nn.Module):
    """Experts stored as one tensor each (torchtitan's GroupedExperts), a router and a shared MLP."""

    def __init__(self, experts: int = 4, dim: int = 12, hidden: int = 10) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.w2 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.shared = nn.Linear(dim, dim)
        for w in (self.w1, self.w2):
            nn.init.trunc_normal_(w, std=0.02)
        self.register_buffer("bias", torch.linspace(-1, 1, experts))


def expert_parallel(module: MoE, mesh: Any) -> None:
    """torchtitan's ExpertParallel: expert weights sharded on the expert dimension."""
    def partition(name: str, mod: nn.Module, mesh: Any) -> None:
        if mod is module:
            for pname in ("w1", "w2"):
                mod.register_parameter(pname, nn.Parameter(distribute_tensor(getattr(mod, pname), mesh, [Shard(0)])))

    distribute_module(module, mesh, partition)


# ------------------------------------------------------------------------------ scenarios
def tensor_parallel(world: int) -> list[str]:
    """parallelize_module (Colwise, Rowwise with Replicate input, SequenceParallel,
    PrepareModuleInput) on a model traced without meta: its constructor's own init."""
    t = titan()
    errors = []
    for tie in (False, True):
        args = t.ModelArgs(tie_embeddings=tie)
        want = eager(lambda: t.Transformer(args))
        model = traced(lambda: t.Transformer(args))
        mesh = init_device_mesh("cpu", (world,))
        t.parallelize(model, tp_mesh=mesh)
        fxinit.materialize(model)
        errors += compare(model, want, f"tp tie={tie}")
    return errors


def tensor_parallel_bf16(world: int) -> list[str]:
    t = titan()
    args = t.ModelArgs()
    torch.manual_seed(0)
    want = {k: v.detach().clone() for k, v in t.Transformer(args).to(torch.bfloat16).state_dict().items()}
    model = traced(lambda: t.Transformer(args))
    t.parallelize(model, tp_mesh=init_device_mesh("cpu", (world,)))
    fxinit.materialize(model, dtype=torch.bfloat16)
    return compare(model, want, "tp bfloat16")


def titan_flow(world: int, tp: int, tie: bool = False, hsdp: bool = False) -> list[str]:
    """torchtitan's flow: meta-traced, parallelized, to_empty, init_weights, materialize."""
    t = titan()
    args = t.ModelArgs(tie_embeddings=tie)
    want = t.single_process_reference(args, seed=3)
    dp = world // tp
    torch.manual_seed(3)
    if hsdp:
        mesh = init_device_mesh("cpu", (2, dp // 2, tp), mesh_dim_names=("rep", "shard", "tp"))
        dp_mesh = mesh["rep", "shard"]
    else:
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        dp_mesh = mesh["dp"] if dp > 1 else None
    model = t.build(args, mesh["tp"] if tp > 1 else None, dp_mesh)
    errors = compare(model, want, f"titan flow world={world} tp={tp} tie={tie} hsdp={hsdp}")
    logits = model(torch.randint(0, args.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1)))
    if not torch.isfinite(logits.full_tensor() if isinstance(logits, DTensor) else logits).all():
        errors.append("titan flow: forward after materialize is not finite")
    return errors


def fsdp_over_tp(world: int) -> list[str]:
    """fully_shard over tensor parallel on a 2-D mesh (the _StridedShard placements FSDP2 makes),
    on a model traced without meta; then a checkpoint read into the same layout."""
    t = titan()
    args = t.ModelArgs()
    want = eager(lambda: t.Transformer(args))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
    model = t.parallelize(traced(lambda: t.Transformer(args)), mesh["tp"], mesh["dp"])
    strided = [n for n, p in model.named_parameters() if any(type(q) is _StridedShard for q in p.placements)]
    errors = [] if strided else ["fsdp over tp: no _StridedShard placement was made"]
    fxinit.materialize(model)
    errors += compare(model, want, "fsdp over tp")
    return errors + _checkpoint_into(t, args, mesh)


def _checkpoint_into(t: Any, args: Any, mesh: Any) -> list[str]:
    import tempfile

    from safetensors.torch import save_file

    torch.manual_seed(7)
    ckpt = {k: v.contiguous() for k, v in t.Transformer(args).state_dict().items() if k != "freqs_cis"}
    dropped = "layers.1.attention.wk.weight"
    del ckpt[dropped]
    want = eager(lambda: t.Transformer(args))
    want.update(ckpt)
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/rank{dist.get_rank()}.safetensors"
        save_file(ckpt, path)
        model = t.parallelize(traced(lambda: t.Transformer(args)), mesh["tp"], mesh["dp"])
        keys = fxinit.materialize(model, state_dict=path, strict=False)  # a partial checkpoint, as load_state_dict
    errors = [] if (keys.missing_keys, keys.unexpected_keys) == ([dropped], []) else [f"incompatible keys {keys}"]
    return errors + compare(model, want, f"fsdp over tp from a checkpoint without {dropped}")


def distribute_directly(world: int) -> list[str]:
    """distribute_tensor with every kind of placement, uneven shapes, and distribute_module."""
    mesh = init_device_mesh("cpu", (2, world // 2))
    layouts = [[Shard(0), Shard(1)], [Shard(1), Shard(0)], [Shard(0), Shard(0)], [Replicate(), Shard(1)],
               [_StridedShard(0, split_factor=world // 2), Shard(0)], [Shard(0), Replicate()]]
    errors = []
    for shape in ((11, 7), (4, 6)):
        want = eager(lambda: nn.Linear(shape[1], shape[0]))
        for placements in layouts:
            if shape[0] % world and any(type(q) is _StridedShard for q in placements):
                continue  # torch scatters strided shards of evenly divisible dimensions only
            model = traced(lambda: nn.Linear(shape[1], shape[0]))
            for name in ("weight", "bias"):
                p = getattr(model, name)
                ps = [q if q.is_replicate() or q.dim < p.dim() else Replicate() for q in placements]
                model.register_parameter(name, nn.Parameter(distribute_tensor(p, mesh, ps)))
            fxinit.materialize(model)
            errors += compare(model, want, f"distribute_tensor {shape} {placements}")
    want = eager(MoE)
    model = traced(MoE)
    distribute_module(model, init_device_mesh("cpu", (world,)))  # replicates parameters and buffers
    fxinit.materialize(model)
    return errors + compare(model, want, "distribute_module")


def experts_and_hsdp(world: int) -> list[str]:
    """Expert parallel (Shard on the expert dimension), then HSDP over it; and HSDP alone."""
    from torch.distributed.fsdp import fully_shard

    want = eager(MoE)
    model = traced(MoE)
    expert_parallel(model, init_device_mesh("cpu", (world,)))
    fxinit.materialize(model)
    errors = compare(model, want, "expert parallel")
    t = titan()
    args = t.ModelArgs()
    want = eager(lambda: t.Transformer(args))
    model = traced(lambda: t.Transformer(args))
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    fxinit.materialize(model)
    return errors + compare(model, want, "hsdp")


def refusals(world: int) -> list[str]:
    """What cannot be exact raises, with a message that says why."""
    errors = []

    def expect(what: str, needle: str, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except fxinit.DeferredInitError as exc:
            if needle not in str(exc):
                errors.append(f"{what}: unexpected message {exc}")
        else:
            errors.append(f"{what}: no error")

    mesh = init_device_mesh("cpu", (world,))

    def seeded_per_rank() -> None:
        model = traced(lambda: nn.Linear(8, 6), seed=dist.get_rank())
        distribute_tensor(model.weight, mesh, [Shard(0)])

    expect("ranks seeded differently", "recorded different values", seeded_per_rank)

    def dropout_on_shards() -> None:
        model = traced(lambda: nn.Linear(8, 6))
        p = distribute_tensor(model.weight, mesh, [Shard(0)])
        torch.nn.functional.dropout(p, 0.5, training=True)

    expect("random op through DTensor dispatch", "on the local shards", dropout_on_shards)

    def gather_deferred() -> None:
        model = traced(lambda: nn.Linear(8, 6))
        distribute_tensor(model.weight, mesh, [Shard(0)]).full_tensor()

    expect("collective on a deferred DTensor", "collective", gather_deferred)

    def scatter_not_replayed() -> None:
        from fxinit.capture.deferred import IS_META_ANSWERS

        saved = dict(IS_META_ANSWERS)
        IS_META_ANSWERS.clear()  # as if fxinit did not know distribute_tensor's scatter
        try:
            model = traced(lambda: nn.Linear(8, 6))
            model.weight = nn.Parameter(distribute_tensor(model.weight, mesh, [Shard(0)]))
        finally:
            IS_META_ANSWERS.update(saved)
        fxinit.materialize(model)

    expect("safety net", "Linear.weight (placements (Shard(dim=0),))", scatter_not_replayed)

    def call_deferred() -> None:
        t = titan()
        model = traced(lambda: t.Transformer(t.ModelArgs()))
        t.parallelize(model, tp_mesh=mesh)
        model(torch.zeros(1, 4, dtype=torch.long))

    expect("calling a deferred model", "was called while its tensors are deferred", call_deferred)
    return errors


def portable(world: int) -> dict[str, dict[str, torch.Tensor]]:
    """Gathered values of portable materialization under several layouts."""
    t = titan()
    args = t.ModelArgs()
    out: dict[str, dict[str, torch.Tensor]] = {}
    layouts: list[tuple[str, int]] = [("tp", world)] if world > 1 else []
    layouts += [("fsdp", 1)] + ([("2d", 2)] if world == 4 else [])
    for label, tp in layouts:
        dp = world // tp
        mesh = init_device_mesh("cpu", (dp, tp), mesh_dim_names=("dp", "tp"))
        tp_mesh, dp_mesh = (mesh["tp"] if tp > 1 else None), (mesh["dp"] if dp > 1 else None)
        model = t.parallelize(traced(lambda: t.Transformer(args)), tp_mesh, dp_mesh)
        fxinit.materialize(model, rng="portable")
        out[f"traced/{label}"] = _full(model)
        torch.manual_seed(3)
        with torch.device("meta"):
            model = fxinit.trace_init(t.Transformer, args)
        t.parallelize(model, tp_mesh, dp_mesh)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=torch.device("cpu"))
        fxinit.materialize(model, rng="portable")
        out[f"titan/{label}"] = _full(model)
    return out


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
            for k, v in model.state_dict().items()}


SCENARIOS: dict[str, Callable[[int], Any]] = {
    "tensor_parallel": tensor_parallel,
    "tensor_parallel_bf16": tensor_parallel_bf16,
    "titan_tp": lambda w: titan_flow(w, tp=2) + titan_flow(w, tp=2, tie=True),
    "titan_fsdp": lambda w: titan_flow(w, tp=1),
    "titan_2d": lambda w: titan_flow(w, tp=2) + titan_flow(w, tp=2, tie=True),
    "titan_hsdp_tp": lambda w: titan_flow(w, tp=2, hsdp=True),
    "fsdp_over_tp": fsdp_over_tp,
    "distribute_directly": distribute_directly,
    "experts_and_hsdp": experts_and_hsdp,
    "refusals": refusals,
    "portable": portable,
}


def run(rank: int, world: int, port: int, scenarios: list[str], queue: Any) -> None:
    serve(rank, world, port, queue, lambda: {name: SCENARIOS[name](world) for name in scenarios})
