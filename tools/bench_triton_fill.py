"""Time fxinit's Triton fill kernel (``rng.portable_triton``) for each launch shape, on a GPU.

    PYTHONPATH=. python tools/bench_triton_fill.py                 # 2^30 bfloat16 normals
    PYTHONPATH=. python tools/bench_triton_fill.py --elements 268435456 --dtype float32

For each ``BLOCK`` (Box-Muller pairs per program) and ``num_warps``, one fill of
``--elements`` values of each kind (uniform, normal): the best of ``--repeat`` launches, as
seconds, output GB/s and the fraction of one device-to-device copy's write rate (the copy's
bytes written per second). The launch shape decides how the work is cut, never a value: the
bits of every shape are checked equal to those of the shape fxinit launches (exit status 1
if any differ). Prints the shape fxinit uses now first.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from fxinit.rng import portable_triton  # noqa: E402


def _launch(out: torch.Tensor, kind: str, block: int, warps: int | None) -> None:
    import triton.language as tl

    kernel = portable_triton._kernel(out.device.type == "cpu")  # the CPU: Triton's interpreter (a dry run)
    grid = ((((out.numel() - 1) >> 1) + block) // block,)
    dtype = getattr(tl, portable_triton._TL_DTYPES[out.dtype])
    extra = {} if warps is None else {"num_warps": warps}
    kernel[grid](out, out, out.numel(), 0, 42, 1.0, 0.0, KIND=portable_triton.KINDS.index(kind), DTYPE=dtype,
                 OUT=dtype, BLOCK=block, TABLE=False, **portable_triton.OPTIONS, **extra)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _best(fn, repeat: int) -> float:
    fn()
    _sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        _sync()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--elements", type=int, default=1 << 30)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--blocks", default="256,512,1024,2048,4096")
    ap.add_argument("--warps", default="default,2,4,8,16")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under Triton's interpreter (small --elements)")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here")
    dtype = getattr(torch, args.dtype)
    out = torch.empty(args.elements, dtype=dtype, device=args.device)
    src = torch.empty_like(out)
    copy_s = _best(lambda: out.copy_(src), args.repeat)
    nbytes = out.numel() * out.element_size()
    name = torch.cuda.get_device_name() if args.device == "cuda" else "cpu (Triton's interpreter)"
    print(f"{name}, torch {torch.__version__}; {args.elements:,} {args.dtype} elements, "
          f"{nbytes / 1e9:.2f} GB; copy writes {nbytes / copy_s / 1e9:.0f} GB/s")
    print(f"{'kind':<8}{'BLOCK':>6}{'warps':>8}{'ms':>9}{'GB/s':>8}{'of copy':>9}  bits")
    ok = True
    for kind in portable_triton.KINDS:
        ref = torch.empty_like(out)
        _launch(ref, kind, portable_triton.BLOCK, None)
        shapes = [(portable_triton.BLOCK, None)] + [
            (int(b), None if w == "default" else int(w)) for b in args.blocks.split(",") for w in args.warps.split(",")
            if (int(b), w) != (portable_triton.BLOCK, "default")]
        for block, warps in shapes:
            try:
                seconds = _best(lambda: _launch(out, kind, block, warps), args.repeat)
            except Exception as exc:  # noqa: BLE001 - a shape Triton cannot build is reported, not fatal
                print(f"{kind:<8}{block:>6}{str(warps or 'default'):>8}  failed: {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:80]}")
                continue
            same = torch.equal(out.view(torch.int16 if out.element_size() == 2 else torch.int32),
                               ref.view(torch.int16 if ref.element_size() == 2 else torch.int32))
            ok &= same
            print(f"{kind:<8}{block:>6}{str(warps or 'default'):>8}{seconds * 1e3:>9.3f}{nbytes / seconds / 1e9:>8.0f}"
                  f"{copy_s / seconds:>9.0%}  {'equal' if same else 'DIFFER'}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
