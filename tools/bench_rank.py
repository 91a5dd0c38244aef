"""One rank of a big mesh, simulated in one process: what materializing its shards costs.

torch's fake process group (``torch.testing._internal.distributed.fake_pg``) lets one
process be rank ``r`` of a job of any size: collectives do nothing, and a traced model laid
out on the mesh holds only rank ``r``'s shards. This tool traces a model, lays it out as
torchtitan does (tensor parallel Colwise/Rowwise on "tp", ``fully_shard`` of every layer
and of the root over ("dp_replicate", "dp_shard"), HSDP where dp_replicate > 1), materializes
it and reports: the rank's shard bytes, the elements the plan drew against the rank's own
random-filled elements, the time against the floor (allocating and writing the shard's
bytes once, measured in the same process twice before materializing and twice after: the
best, and the first, which on a VM pays the first touch of memory the process had not used)
and the peak RSS growth against the shard.

    python tools/bench_rank.py --preset 405b --mesh 4 32 8 --rank 517          # the issue's rank
    python tools/bench_rank.py --preset 405b --mesh 4 32 8 --rank 517 --layers 2
    python tools/bench_rank.py --preset tiny --mesh 2 4 2 --ranks 0 5 15 --check   # and equal eager?
    python tools/bench_rank.py --model linears --mesh 1 8 4 --ranks 0 30 --check --json
    python tools/bench_rank.py --model titan --mesh 2 4 2 --ranks 0 9 --check   # torchtitan's flow
    python tools/bench_rank.py --model experts --dim 512 --mesh 1 4 4 --ranks 0 13 --check  # expert parallel

``--model titan`` is the guide's torchtitan-style Llama (``docs/examples/titan_llama.py``)
in torchtitan's flow: traced under ``torch.device("meta")``, parallelized, ``to_empty``,
``init_weights(buffer_device=None)`` (``trunc_normal_``), then materialized.

``--check`` compares each local shard with the matching slice of eager construction (the
positions ``capture.layout.local_runs`` gives), so keep the model small there. The bars
(issue "Exact mode at the floor"): drawn <= 1.05 x own elements, time <= 3 x floor, peak RSS
growth <= 1.5 x shard + 1 GB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import fxinit  # noqa: E402
from fxinit import execute  # noqa: E402

sys.path.insert(0, str(ROOT / "tools"))
from bench_export import MODELS  # noqa: E402

PRESETS = {  # transformers LlamaConfig fields: the benchmarks' Llama configs, and two small ones
    "405b": MODELS["405b"],
    "8b": MODELS["8b"],
    "small": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=2, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4096),
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=4, vocab_size=250),
}


class Linears(nn.Module):
    """``pairs`` of column- then row-parallel Linears (the issue's plain example)."""

    def __init__(self, dim: int = 4096, pairs: int = 1) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim, bias=False), nn.Linear(dim, dim, bias=False))
                                    for _ in range(pairs))


class Experts(nn.Module):
    """``layers`` mixtures of experts stored as one tensor per weight (torchtitan's
    GroupedExperts): a router and ``experts`` SwiGLU experts."""

    def __init__(self, dim: int = 512, layers: int = 2, experts: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_ExpertLayer(dim, experts) for _ in range(layers))


class _ExpertLayer(nn.Module):
    def __init__(self, dim: int, experts: int) -> None:
        super().__init__()
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, dim, 2 * dim))
        self.w2 = nn.Parameter(torch.empty(experts, 2 * dim, dim))
        self.w3 = nn.Parameter(torch.empty(experts, dim, 2 * dim))
        for w in (self.w1, self.w2, self.w3):
            nn.init.trunc_normal_(w, std=0.02)


def titan():  # noqa: ANN201
    """docs/examples/titan_llama.py as a module."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("titan_llama", ROOT / "docs" / "examples" / "titan_llama.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["titan_llama"] = module
    spec.loader.exec_module(module)
    return module


def titan_args(args: argparse.Namespace):  # noqa: ANN201
    return titan().ModelArgs(dim=1024, n_layers=args.layers or 2, n_heads=8, n_kv_heads=4, vocab_size=2049,
                             hidden_dim=2816)


def build(args: argparse.Namespace) -> tuple[type, tuple]:
    if args.model == "titan":
        return titan().Transformer, (titan_args(args),)
    if args.model == "linears":
        return Linears, (args.dim, args.layers or 1)
    if args.model == "experts":
        return Experts, (args.dim, args.layers or 2)
    from transformers import LlamaConfig, LlamaForCausalLM

    fields = dict(PRESETS[args.preset])
    if args.layers:
        fields["num_hidden_layers"] = args.layers
    return LlamaForCausalLM, (LlamaConfig(**fields, tie_word_embeddings=False),)


def lay_out(model: nn.Module, mesh, model_kind: str) -> None:  # noqa: ANN001
    """torchtitan's layout: TP on "tp", then FSDP2 (HSDP) per layer and at the root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel,
                                                   parallelize_module)

    tp = mesh["tp"]
    names = tuple(n for n in ("dp_replicate", "dp_shard") if mesh[n].size() > 1) or ("dp_shard",)
    dp = mesh[names] if len(names) > 1 else mesh[names[0]]
    if model_kind == "titan":  # its own parallelize, then torchtitan's init steps
        sys.modules["titan_llama"].parallelize(model, tp if tp.size() > 1 else None, dp if dp.size() > 1 else None)
        model.to_empty(device="cpu")
        with torch.no_grad():
            model.init_weights(buffer_device=None)
        return
    if model_kind == "experts":
        _expert_parallel(model, mesh, tp, dp)
        return
    if tp.size() > 1:
        if model_kind == "linears":
            plan = {}
            for i in range(len(model.layers)):
                plan[f"layers.{i}.0"] = ColwiseParallel()
                plan[f"layers.{i}.1"] = RowwiseParallel()
        else:
            plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
                    "model.norm": SequenceParallel(),
                    "lm_head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}
            for i in range(len(model.model.layers)):
                p = f"model.layers.{i}"
                plan[f"{p}.input_layernorm"] = SequenceParallel()
                plan[f"{p}.post_attention_layernorm"] = SequenceParallel()
                for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                             "mlp.up_proj"):
                    plan[f"{p}.{name}"] = ColwiseParallel()
                for name in ("self_attn.o_proj", "mlp.down_proj"):
                    plan[f"{p}.{name}"] = RowwiseParallel()
        parallelize_module(model, tp, plan)
    if dp.size() > 1:
        blocks = model.layers if model_kind == "linears" else model.model.layers
        for block in blocks:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)


def _expert_parallel(model: nn.Module, mesh, ep, dp) -> None:  # noqa: ANN001
    """torchtitan's expert parallel: the expert weights sharded on the expert dimension over
    "tp" (standing for the EP mesh), then FSDP2 per layer over dp, on the expert weights' second
    dimension (as torchtitan shards experts when there are fewer of them than ranks)."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_module, distribute_tensor

    for layer in model.layers:
        if ep.size() > 1:
            def partition(name: str, mod: nn.Module, mesh, layer=layer) -> None:  # noqa: ANN001
                if mod is layer:
                    for pname in ("w1", "w2", "w3"):
                        mod.register_parameter(pname, nn.Parameter(distribute_tensor(getattr(mod, pname), mesh,
                                                                                     [Shard(0)])))

            distribute_module(layer, ep, partition)
        if dp.size() > 1:
            fully_shard(layer, mesh=dp, shard_placement_fn=lambda p: Shard(1) if p.dim() == 3 else Shard(0))
    if dp.size() > 1:
        fully_shard(model, mesh=dp)


def _peak_reset() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def floor_seconds(nbytes: int) -> list[float]:
    """Allocating and writing ``nbytes`` once (fresh pages), twice: the seconds of each."""
    runs = []
    for _ in range(2):
        t0 = time.perf_counter()
        t = torch.empty(nbytes, dtype=torch.uint8)
        t.fill_(1)
        runs.append(time.perf_counter() - t0)
        del t
    return runs


def _local_bytes(model: nn.Module) -> int:
    """The bytes of the rank's shards of ``model``'s state (materialized or not)."""
    from torch.distributed.tensor import DTensor

    total = 0
    for t in model.state_dict().values():
        t = t.to_local() if isinstance(t, DTensor) else t
        total += t.numel() * t.element_size()
    return total


def one_rank(args: argparse.Namespace, rank: int) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fxinit.capture.layout import local_runs, take

    shape = tuple(args.mesh)
    world = shape[0] * shape[1] * shape[2]
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp_replicate", "dp_shard", "tp"))
        cls, cargs = build(args)
        torch.manual_seed(args.seed)
        t0 = time.perf_counter()
        with torch.device("meta" if args.model == "titan" else "cpu"):
            model = fxinit.trace_init(cls, *cargs)
        lay_out(model, mesh, args.model)
        traced_s = time.perf_counter() - t0
        # the floor before materializing as well as after: on a VM the first touch of memory the
        # guest never used costs several times a later one, and this puts both on used memory
        floor_before = floor_seconds(_local_bytes(model))
        plans = []
        plan_fn = execute.plan

        def recording(*a, **k):  # noqa: ANN002, ANN003
            p = plan_fn(*a, **k)
            plans.append(p)
            return p

        execute.plan = recording
        try:
            rss0 = _status("VmRSS")
            _peak_reset()
            t0 = time.perf_counter()
            fxinit.materialize(model, rng=args.rng)
            seconds = time.perf_counter() - t0
            growth = _status("VmHWM") - rss0
        finally:
            execute.plan = plan_fn
        local = {n: (t.to_local() if isinstance(t, DTensor) else t) for n, t in model.state_dict().items()}
        shard = sum(t.numel() * t.element_size() for t in local.values())
        own = sum(t.numel() for n, t in local.items() if t.dim() >= 2)  # the random-filled weights
        drawn = sum(p.elements_drawn() for p in plans)
        row = dict(rank=rank, mesh=list(shape), shard_bytes=shard, own_elements=own, drawn_elements=drawn,
                   drawn_ratio=drawn / max(own, 1), seconds=seconds, traced_seconds=traced_s,
                   rss_growth=growth)
        if args.check:
            torch.manual_seed(args.seed)
            eager = (sys.modules["titan_llama"].single_process_reference(cargs[0], args.seed) if args.model == "titan"
                     else cls(*cargs).state_dict())
            bad = []
            for n, t in model.state_dict().items():
                if isinstance(t, DTensor):
                    runs = local_runs(t.shape, t.placements, t.device_mesh.shape, t.device_mesh.get_coordinate())
                    want = take(eager[n], runs)
                    got = t.to_local()
                else:
                    want, got = eager[n], t
                if got.shape != want.shape or not torch.equal(got, want):
                    bad.append(n)
            row["mismatches"] = bad
        del model
        floors = [*floor_before, *floor_seconds(shard)]
        row["floor_seconds"], row["floor_first_seconds"] = min(floors), floors[0]
        return row
    finally:
        dist.destroy_process_group()


def in_child(argv: list[str], rank: int) -> dict:
    """``one_rank`` in a fresh process: a process group re-made in the same process keeps
    state of the previous rank (device meshes, FSDP's caches)."""
    rest, skip = [], False
    for a in argv:
        if skip and not a.startswith("--"):
            continue
        skip = a in ("--ranks", "--rank")
        if not skip:
            rest.append(a)
    out = subprocess.run([sys.executable, __file__, *[a for a in rest if a != "--json"], "--rank", str(rank), "--json"],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=("llama", "linears", "titan", "experts"), default="llama")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--layers", type=int, default=0,
                    help="layers (llama, titan, experts) or Linear pairs (linears); 0: the default")
    ap.add_argument("--dim", type=int, default=4096, help="width of --model linears and experts")
    ap.add_argument("--mesh", type=int, nargs=3, default=(1, 4, 2), metavar=("REPLICATE", "SHARD", "TP"))
    ap.add_argument("--rank", type=int, default=None)
    ap.add_argument("--ranks", type=int, nargs="*", default=None)
    ap.add_argument("--rng", choices=("exact", "portable"), default="exact")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--check", action="store_true", help="compare the local shards with eager construction")
    ap.add_argument("--json", action="store_true", help="one JSON object per rank")
    args = ap.parse_args(argv)
    ranks = args.ranks if args.ranks else [args.rank if args.rank is not None else 0]
    failed = False
    for rank in ranks:
        row = one_rank(args, rank) if len(ranks) == 1 else in_child(argv if argv is not None else sys.argv[1:], rank)
        failed |= bool(row.get("mismatches"))
        if args.json:
            print(json.dumps(row), flush=True)
            continue
        gb = row["shard_bytes"] / 1e9
        print(f"rank {rank} of {'x'.join(map(str, args.mesh))}: shard {gb:.3f} GB, drew {row['drawn_ratio']:.3f}x "
              f"its elements ({row['drawn_elements']:,} / {row['own_elements']:,}); materialize {row['seconds']:.2f} s "
              f"= {row['seconds'] / row['floor_seconds']:.2f}x floor ({row['floor_seconds']:.2f} s; the first floor run "
              f"{row['floor_first_seconds']:.2f} s: {row['seconds'] / row['floor_first_seconds']:.2f}x); peak RSS growth "
              f"{row['rss_growth'] / 1e9:.3f} GB = {row['rss_growth'] / max(row['shard_bytes'], 1):.2f}x shard "
              f"(bar 1.5x shard + 1 GB: {'ok' if row['rss_growth'] <= 1.5 * row['shard_bytes'] + 1e9 else 'OVER'})"
              + (f"; mismatches: {row['mismatches'] or 'none'}" if args.check else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
