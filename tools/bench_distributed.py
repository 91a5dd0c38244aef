"""Per-rank memory and time of sharded materialization (CPU, gloo), against eager.

Each rank traces a Llama (~1B parameters by default) and lays it out: tensor parallel
(``--tp``, transformers' Llama plan: embeddings and heads Rowwise/Colwise) inside FSDP2 on
the rest of the ranks (``fully_shard`` of every decoder layer and of the root), so 4 ranks
make the 2 x 2 mesh torchtitan uses; then it materializes and reports the bytes of its own
shards, how much its peak RSS grew during ``materialize`` and how long that took, in exact
and in portable mode (one fresh set of processes per mode). ``--eager`` adds the row
without fxinit: every rank builds the whole model eagerly and lays it out (what
``distribute_tensor`` and ``fully_shard`` of real tensors do).

    python tools/bench_distributed.py                 # 4 ranks, ~1B Llama, 2 x 2 mesh
    python tools/bench_distributed.py --tp 1          # FSDP2 alone
    python tools/bench_distributed.py --layers 2 --world 2    # a quick look
    python tools/bench_distributed.py --layers 2 --world 2 --check   # and compare with eager
    python tools/bench_distributed.py --backend nccl --world 8       # GPUs (one per rank)

The bar (issue "Sharded and staged materialization"): growth <= 1.2 x shard + 200 MB.
"""

from __future__ import annotations

import argparse
import io
import os
import resource
import socket
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _reset_peak() -> None:
    """Start a new peak RSS (VmHWM) from the current RSS (Linux: /proc/self/clear_refs)."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _peak() -> int:
    """Peak RSS since the last reset (ru_maxrss would include the parent's, which a spawned
    process inherits across exec)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _lay_out(model: torch.nn.Module, mesh, tp: int) -> None:  # noqa: ANN001
    """Tensor parallel on the mesh's "tp" dimension inside FSDP2 on its "dp" dimension."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if tp > 1:
        plan = {"model.embed_tokens": RowwiseParallel(input_layouts=Replicate()),
                "lm_head": ColwiseParallel(output_layouts=Replicate())}
        for i in range(len(model.model.layers)):
            for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
                plan[f"model.layers.{i}.{name}"] = ColwiseParallel()
            for name in ("self_attn.o_proj", "mlp.down_proj"):
                plan[f"model.layers.{i}.{name}"] = RowwiseParallel()
        parallelize_module(model, mesh["tp"], plan)
    if mesh["dp"].size() > 1:
        for block in model.model.layers:
            fully_shard(block, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])


def _worker(rank: int, world: int, port: int, layers: int, rng: str, backend: str, check: bool, tp: int,
            queue) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import LlamaConfig, LlamaForCausalLM

    if rng != "eager":
        import fxinit

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    mesh = init_device_mesh("cuda" if backend == "nccl" else "cpu", (world // tp, tp), mesh_dim_names=("dp", "tp"))
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000)
    torch.manual_seed(0)
    dist.barrier()
    before = _rss()
    _reset_peak()
    t0 = time.perf_counter()
    if rng == "eager":  # the whole model on every rank, then laid out: the time and memory fxinit saves
        model = LlamaForCausalLM(cfg)
        _lay_out(model, mesh, tp)
    else:
        model = fxinit.trace_init(LlamaForCausalLM, cfg)
        _lay_out(model, mesh, tp)
        dist.barrier()
        before = _rss()
        _reset_peak()
        t0 = time.perf_counter()
        fxinit.materialize(model, rng=rng)
    seconds = time.perf_counter() - t0
    peak = _peak()
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    shard = sum(local(t).numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    total = sum(p.numel() for p in model.parameters())
    mismatches = -1
    if check and rng == "exact":  # gathered tensors against eager construction on the CPU, one process
        torch.manual_seed(0)
        eager = dict(LlamaForCausalLM(cfg).named_parameters())
        mismatches = sum(not torch.equal(full(p).cpu(), eager[n]) for n, p in model.named_parameters())
    buf = io.BytesIO()
    torch.save({"rank": rank, "shard": shard, "growth": peak - before, "kept": _rss() - before, "seconds": seconds,
                "params": total, "mismatches": mismatches,
                "device": str(local(next(model.parameters())).device)}, buf)
    queue.put(buf.getvalue())
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, layers: int, rng: str, backend: str = "gloo", check: bool = False, tp: int = 1) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, layers, rng, backend, check, tp, queue))
             for r in range(world)]
    for p in procs:
        p.start()
    rows = [torch.load(io.BytesIO(queue.get()), weights_only=True) for _ in procs]
    for p in procs:
        p.join()
    return sorted(rows, key=lambda r: r["rank"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--layers", type=int, default=20, help="decoder layers (20: ~1.0B parameters)")
    ap.add_argument("--backend", choices=["gloo", "nccl"], default="gloo",
                    help="nccl: one GPU per rank (shards live on the GPUs; RSS is host memory)")
    ap.add_argument("--tp", type=int, default=None, help="tensor-parallel degree (default: 2 from 4 ranks on, else 1)")
    ap.add_argument("--eager", action="store_true", help="add the row without fxinit (every rank builds everything)")
    ap.add_argument("--check", action="store_true", help="exact mode: compare gathered tensors with eager (slow)")
    args = ap.parse_args(argv)
    tp = args.tp or (2 if args.world >= 4 else 1)
    ok = True
    eager_seconds = None
    for rng in (("eager",) if args.eager else ()) + ("exact", "portable"):
        rows = run(args.world, args.layers, rng, args.backend, args.check and rng != "eager", tp)
        if rng == "eager":
            eager_seconds = max(r["seconds"] for r in rows)
        print(f"\n{rng} {'construction and layout' if rng == 'eager' else 'mode'}, {args.world} ranks "
              f"(mesh {args.world // tp} x {tp}: FSDP2 x TP, {args.backend}, shards on {rows[0]['device']}), "
              f"{rows[0]['params'] / 1e9:.2f}B parameters")
        if rows[0]["mismatches"] >= 0:
            bad = sum(r["mismatches"] for r in rows)
            ok &= bad == 0
            print(f"gathered tensors equal to eager construction: {'all' if bad == 0 else f'{bad} MISMATCHES'}")
        print(f"{'rank':>4} {'shard MiB':>10} {'peak growth MiB':>16} {'growth/shard':>13} {'bar MiB':>9} "
              f"{'kept MiB':>9} {'time s':>7} {'x eager':>8}")
        for r in rows:
            bar = 1.2 * r["shard"] + 200 * 2**20
            ok &= r["growth"] <= bar or rng == "eager"
            vs = f"{r['seconds'] / eager_seconds:>8.3f}" if eager_seconds else f"{'':>8}"
            print(f"{r['rank']:>4} {r['shard'] / 2**20:>10.0f} {r['growth'] / 2**20:>16.0f} "
                  f"{r['growth'] / r['shard']:>13.2f} {bar / 2**20:>9.0f} {r['kept'] / 2**20:>9.0f} "
                  f"{r['seconds']:>7.2f} {vs}")
    print("\nwithin the bar (and equal to eager where checked) on every rank" if ok
          else "\nABOVE the bar or MISMATCH on some rank")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
