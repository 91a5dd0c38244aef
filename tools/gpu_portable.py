"""Portable mode on a device (issue 33), the rows ``tools/gpu_check.py``'s bench section adds.

For the bench model (an 8B Llama in bfloat16 on an H100), traced for DEVICE and materialized
there with ``rng="portable"``:

- ``compile=None`` (fxinit's Triton kernel on CUDA) first in the process, with no warm-up:
  the default path, on the materializer's worker threads, compiling or loading its kernels
  on the way (the crash of issue 33 was there); then again, warm; then again with a kernel
  launch per fill ("unbatched": no ``passes.batched_fills``), to see what batching gains;
- ``compile=True`` (Inductor's kernels), compiled first on a small model, then timed;
- ``compile="nvrtc"`` (fxinit's CUDA kernel, NVRTC: what runs where Triton cannot), compiled
  and checked on the way;
- ``compile=False`` (torch ops, no compiler);
- every tensor of the default path's model, its first row against the CPU's (fxinit's C
  kernel), bit for bit;
- compile time of each compiled path in a fresh process with empty Triton and Inductor caches
  (cold), and in a second fresh process with those caches (warm).

``python tools/gpu_portable.py --device cpu --small`` runs it all on the CPU, where the
default path is the C kernel and ``compile='triton'`` runs Triton's interpreter.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Iterator

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import fxinit  # noqa: E402
from fxinit.backends.compiled import STATS, nvrtc_available  # noqa: E402
from gpu_check import LAST_PEAK, _timed, profile_later  # noqa: E402  (tools/ is on the path: run from there, or by gpu_check)


def _trace(cfg: Any, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with device:
        return fxinit.trace_init(LlamaForCausalLM, cfg)


@contextlib.contextmanager
def _batching(batched: bool) -> Iterator[None]:
    """Fills batched as fxinit batches them, or (False) each its own kernel call."""
    from fxinit.passes import batched_fills

    decide = batched_fills._portable_batchable
    batched_fills._portable_batchable = decide if batched else (lambda *a: False)
    try:
        yield
    finally:
        batched_fills._portable_batchable = decide


def _row(label: str, cfg: Any, device: torch.device, compile: bool | str | None,
         repeat: int = 1, batched: bool = True) -> tuple[dict, torch.nn.Module]:
    """Materialize the traced ``cfg`` ``repeat`` times (the best time); the last model.
    ``batched=False``: every fill its own kernel call (no ``passes.batched_fills``)."""
    times, compiled_before = [], STATS.seconds
    for _ in range(repeat):
        m = None  # the last model's memory back to the allocator's cache before the next
        m = _trace(cfg, device)
        with _batching(batched):
            times.append(_timed(lambda: fxinit.materialize(m, rng="portable", compile=compile), device)[0])
    row = {"row": label, "seconds": min(times), "trace_s": None, "compile": repr(compile),
           "compile_s": STATS.seconds - compiled_before, "repeats": [round(t, 4) for t in times],
           "peak": LAST_PEAK[0]}
    if repeat > 1:  # a timed row, not a first call: its kernels' GPU time in one more run, after the timed rows

        def run(again: torch.nn.Module) -> None:
            with _batching(batched):
                fxinit.materialize(again, rng="portable", compile=compile)

        profile_later(row, lambda: _trace(cfg, device), run, device)
    return row, m


def first_rows_equal_cpu(m: torch.nn.Module, cfg: Any) -> list[str]:
    """Names of ``m``'s tensors whose first row (dimension 0) differs, in bits, from the CPU's
    portable values (the same trace for the CPU, only those rows materialized)."""
    graph = fxinit.init_graph(_trace(cfg, torch.device("cpu")))
    names = list(graph.outputs)
    rows = {n: (0, 1) for n in names if len(graph.spec(n).shape) and graph.spec(n).shape[0] >= 1}
    want = graph.materialize(names, rng="portable", rows=rows)
    got = dict(m.named_parameters(remove_duplicate=False)) | dict(m.named_buffers(remove_duplicate=False))
    differ = []
    for name, value in want.items():
        mine = got[name].detach()[:1] if name in rows else got[name].detach()
        if mine.shape != value.shape or mine.dtype != value.dtype or not torch.equal(
                mine.cpu().reshape(-1).view(torch.uint8), value.reshape(-1).view(torch.uint8)):
            differ.append(name)
    return differ


def portable_rows(cfg: Any, small_cfg: Any, device: torch.device) -> tuple[list[dict], bool]:
    """The portable rows of the bench (see the module's docstring) and whether every sampled
    row was bit for bit the CPU's."""
    rows = []
    row, m = _row("portable default, cold", cfg, device, None)  # no warm-up: the default path first
    rows.append(row)
    del m
    row, m = _row("portable default", cfg, device, None, repeat=3)
    rows.append(row)
    differ = first_rows_equal_cpu(m, cfg)
    row["note"] = ("first rows bitwise equal to the CPU's" if not differ
                   else f"first rows DIFFER from the CPU's: {len(differ)} tensors, {differ[:3]}")
    del m
    row, m = _row("portable unbatched", cfg, device, None, repeat=3, batched=False)
    rows.append(row)
    del m
    _empty_cache(device)
    if device.type == "cuda" or os.environ.get("TRITON_INTERPRET") != "1":
        warm, _ = _row("", small_cfg, device, True)  # Inductor compiles on the small model first
        row, m = _row("portable inductor", cfg, device, True, repeat=3)
        row["compile_s"] += warm["compile_s"]
        rows.append(row)
        del m
        _empty_cache(device)
    if device.type == "cuda":  # fxinit's CUDA kernel, compiled by NVRTC: where Triton cannot run
        why = nvrtc_available(device)
        if why is None:
            row, m = _row("portable nvrtc", cfg, device, "nvrtc", repeat=3)
            rows.append(row)
            del m
            _empty_cache(device)
        else:
            print(f"portable nvrtc: fxinit's CUDA kernel cannot run here: {why}", flush=True)
            differ.append(f"nvrtc: {why}")
    row, m = _row("portable torch ops", cfg, device, False)
    rows.append(row)
    del m
    _empty_cache(device)
    return rows, not differ


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def compile_times(device: torch.device, compiles: tuple[str, ...] = ("None", "True")) -> list[dict]:
    """Per compiled path: seconds compiling the small model's kernels in a fresh process with
    empty caches (cold), then in another fresh process with the caches the first one left."""
    out = []
    for compile in compiles:
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRITON_CACHE_DIR=f"{cache}/triton", TORCHINDUCTOR_CACHE_DIR=f"{cache}/inductor",
                       FXINIT_CACHE_DIR=f"{cache}/fxinit")
            times = []
            for _ in ("cold", "warm"):
                cmd = [sys.executable, __file__, "--child", "--device", str(device), "--compile", compile]
                done = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if done.returncode != 0:  # reported, and the other paths still timed
                    print(f"compile={compile}: the compile-time child failed:\n{done.stderr[-3000:]}", flush=True)
                    break
                times.append(json.loads(done.stdout.strip().splitlines()[-1]))
            if len(times) == 2:
                out.append({"compile": compile, "cold_s": times[0]["compile_s"], "warm_s": times[1]["compile_s"],
                            "kernels": times[0]["kernels"]})
            else:
                out.append({"compile": compile, "cold_s": float("nan"), "warm_s": float("nan"), "kernels": 0,
                            "failed": True})
    return out


def print_compile_times(rows: list[dict], device: torch.device) -> None:
    print(f"\ncompiling portable kernels on {device} (small Llama, bfloat16), each in a fresh process")
    print(f"{'compile=':<10}{'kernels':>8}{'cold s':>9}{'warm s':>9}")
    for r in rows:
        print(f"{r['compile']:<10}{r['kernels']:>8}{r['cold_s']:>9.2f}{r['warm_s']:>9.3f}")


def _child(device: torch.device, compile: bool | None) -> None:
    from transformers import LlamaConfig

    from gpu_check import BENCH_CONFIGS

    torch.set_default_dtype(torch.bfloat16)
    m = _trace(LlamaConfig(**BENCH_CONFIGS["small"]), device)
    fxinit.materialize(m, rng="portable", compile=compile)
    print(json.dumps({"compile_s": STATS.seconds, "kernels": STATS.kernels}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="the small Llama as the bench model")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--compile", default="None", choices=["None", "True", "False", "triton", "nvrtc"])
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    compile = {"None": None, "True": True, "False": False, "triton": "triton", "nvrtc": "nvrtc"}[args.compile]
    if args.child:
        _child(device, compile)
        return 0
    from gpu_check import bench

    _, ok = bench(device, "small" if args.small else "8b", exact=False)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
