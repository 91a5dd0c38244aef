"""Per-rank memory and time of sharded materialization (FSDP2 on CPU, gloo).

Each rank traces a Llama (~1B parameters by default), applies ``fully_shard`` to every
decoder layer and to the root, and materializes; it reports the bytes of its own shards,
how much its peak RSS grew during ``materialize`` and how long that took, in exact and in
portable mode (one fresh set of processes per mode).

    python tools/bench_distributed.py                 # 4 ranks, ~1B Llama
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


def _worker(rank: int, world: int, port: int, layers: int, rng: str, backend: str, check: bool, queue) -> None:
    sys.path.insert(0, str(ROOT))
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    import fxinit

    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, rank=rank, world_size=world)
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers, num_attention_heads=16,
                      num_key_value_heads=4, vocab_size=32000)
    torch.manual_seed(0)
    model = fxinit.trace_init(LlamaForCausalLM, cfg)
    for block in model.model.layers:
        fully_shard(block)
    fully_shard(model)
    dist.barrier()
    before = _rss()
    peak_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    t0 = time.perf_counter()
    fxinit.materialize(model, rng=rng)
    seconds = time.perf_counter() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    shard = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
    shard += sum(b.numel() * b.element_size() for b in model.buffers())
    total = sum(p.numel() for p in model.parameters())
    mismatches = -1
    if check and rng == "exact":  # gathered tensors against eager construction on the CPU
        torch.manual_seed(0)
        eager = dict(LlamaForCausalLM(cfg).named_parameters())
        mismatches = sum(not torch.equal(p.full_tensor().cpu(), eager[n]) for n, p in model.named_parameters())
    buf = io.BytesIO()
    torch.save({"rank": rank, "shard": shard, "growth": max(peak, peak_before) - before, "seconds": seconds,
                "params": total, "mismatches": mismatches,
                "device": str(next(model.parameters()).to_local().device)}, buf)
    queue.put(buf.getvalue())
    dist.barrier()
    dist.destroy_process_group()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(world: int, layers: int, rng: str, backend: str = "gloo", check: bool = False) -> list[dict]:
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    port = _port()
    procs = [ctx.Process(target=_worker, args=(r, world, port, layers, rng, backend, check, queue))
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
    ap.add_argument("--check", action="store_true", help="exact mode: compare gathered tensors with eager (slow)")
    args = ap.parse_args(argv)
    ok = True
    for rng in ("exact", "portable"):
        rows = run(args.world, args.layers, rng, args.backend, args.check)
        print(f"\n{rng} mode, {args.world} ranks ({args.backend}, shards on {rows[0]['device']}), "
              f"{rows[0]['params'] / 1e9:.2f}B parameters")
        if rows[0]["mismatches"] >= 0:
            bad = sum(r["mismatches"] for r in rows)
            ok &= bad == 0
            print(f"gathered tensors equal to eager construction: {'all' if bad == 0 else f'{bad} MISMATCHES'}")
        print(f"{'rank':>4} {'shard MiB':>10} {'RSS growth MiB':>15} {'growth/shard':>13} {'bar MiB':>9} {'time s':>7}")
        for r in rows:
            bar = 1.2 * r["shard"] + 200 * 2**20
            ok &= r["growth"] <= bar
            print(f"{r['rank']:>4} {r['shard'] / 2**20:>10.0f} {r['growth'] / 2**20:>15.0f} "
                  f"{r['growth'] / r['shard']:>13.2f} {bar / 2**20:>9.0f} {r['seconds']:>7.2f}")
    print("\nwithin the bar (and equal to eager where checked) on every rank" if ok
          else "\nABOVE the bar or MISMATCH on some rank")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
