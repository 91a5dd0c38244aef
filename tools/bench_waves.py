"""Exact materialize of a Llama in bfloat16 on a GPU with ``passes.waves`` cut several ways, in one process.

    PYTHONPATH=. python tools/bench_waves.py            # the 8B config on cuda
    python tools/bench_waves.py --device cpu --small     # a dry run: nothing is cut on the CPU

Each variant (waves off, and ``BOUNDS`` of 2, 3, 4 and 8 waves) is timed in turn, round after
round (the first round dropped), so that a machine's drift falls on all of them; prints the
best and the median of each against eager construction, then checks the default cut against
eager, bit for bit (exit status 1 if any tensor differs).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import fxinit  # noqa: E402
from gpu_check import BENCH_CONFIGS  # noqa: E402

waves_pass = importlib.import_module("fxinit.passes.waves")
VARIANTS = {"off": None, "2 waves": (0.1, 1.0), "3 waves": (0.05, 0.25, 1.0), "4 waves": (0.04, 0.12, 0.3, 1.0),
            "8 waves": (0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0)}


def main(argv: list[str] | None = None) -> int:
    from transformers import LlamaConfig, LlamaForCausalLM

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="the ~25M-parameter Llama instead of the 8B one")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    device = torch.device(args.device)

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    torch.set_default_dtype(torch.bfloat16)
    cfg = LlamaConfig(**BENCH_CONFIGS["small" if args.small else "8b"])
    eager_s = []
    for _ in range(4):
        eager = None
        sync()
        torch.manual_seed(0)
        t0 = time.perf_counter()
        with device:
            eager = LlamaForCausalLM(cfg)
        sync()
        eager_s.append(time.perf_counter() - t0)
    default = waves_pass.BOUNDS, waves_pass.MIN_COUNT
    times: dict[str, list[float]] = {}
    try:
        for round_ in range(args.rounds):
            for name, bounds in VARIANTS.items():
                waves_pass.BOUNDS = bounds or default[0]
                waves_pass.MIN_COUNT = sys.maxsize if bounds is None else default[1]
                m = None
                torch.manual_seed(0)
                with device:
                    m = fxinit.trace_init(LlamaForCausalLM, cfg)
                sync()
                t0 = time.perf_counter()
                fxinit.materialize(m)
                sync()
                if round_:
                    times.setdefault(name, []).append(time.perf_counter() - t0)
    finally:
        waves_pass.BOUNDS, waves_pass.MIN_COUNT = default
    print(f"{'8B' if not args.small else 'small'} Llama, bfloat16, exact, on {device}: eager {min(eager_s) * 1e3:.1f} ms")
    for name, ts in times.items():
        print(f"  {name:<8} best {min(ts) * 1e3:6.1f} ms  median {statistics.median(ts) * 1e3:6.1f} ms")
    m = None
    torch.manual_seed(0)
    with device:
        m = fxinit.trace_init(LlamaForCausalLM, cfg)
    fxinit.materialize(m)
    got = dict(m.named_parameters()) | dict(m.named_buffers())
    want = dict(eager.named_parameters()) | dict(eager.named_buffers())
    differ = [k for k, v in want.items() if got[k].dtype != v.dtype or got[k].shape != v.shape
              or not torch.equal(got[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8))]
    print(f"default cut against eager: {len(want) - len(differ)}/{len(want)} tensors bitwise equal"
          + (f", DIFFER: {differ[:5]}" if differ else ""))
    return 1 if differ else 0


if __name__ == "__main__":
    raise SystemExit(main())
