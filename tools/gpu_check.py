"""The checks and figures of the GPU issues (32, 33): one command, exit status 1 on any difference.

Run them on a machine with one (through ``device``, from the work tree):

    PYTHONPATH=. python tools/gpu_check.py                    # contexts, corpus sample, portable, bench
    PYTHONPATH=. python tools/gpu_check.py --only portable
    PYTHONPATH=. python tools/corpus.py --device cuda --jobs 1  # exact mode on the GPU, every architecture
    python tools/gpu_check.py --device cpu --small --corpus-every 0   # the same code on CPU (the tests run parts)

contexts
    ``tools/gpu_contexts.py``: every random op and init function alone (4 dtypes, sizes
    around the kernels' thresholds), ``nn.init`` on matrices, LSTM/GRU, dropout, factories a
    device context does and does not place, built under ``with torch.device(DEVICE)`` eagerly
    and with fxinit, bit for bit, whole and leaf by leaf in reverse; on CUDA also traced in a
    process that sees no GPU and materialized here from the saved init graphs.

corpus
    ``tools/corpus.py --device DEVICE`` on every ``--corpus-every``-th architecture.

portable
    Tiny transformers models and torch.nn modules, traced for DEVICE and for the CPU and
    materialized with ``rng="portable"``: each tensor's values on DEVICE against the CPU's
    (fxinit's C kernel), as distances in units in the last place, grouped by the random ops
    that wrote the tensor. Three paths on DEVICE: torch ops (``compile=False``), the default
    (``compile=None``: fxinit's Triton kernel on CUDA) and Inductor's kernels
    (``compile=True``); on the CPU, torch ops with ``FXINIT_NO_NATIVE=1`` (the code CUDA runs
    without a compiler), ``compile='triton'`` under Triton's interpreter, and Inductor's C++.
    float32 and bfloat16 tensors written by uniform-family, normal-family and
    ``trunc_normal_`` ops must be bitwise equal; anything else is reported, not judged
    (float64 normals and the rarer samplers use torch's ``log1p``/``exp``, whose last bit may
    differ between devices; non-random buffers are eager's own arithmetic on each device).

bench
    An 8B Llama (hidden 4096, intermediate 14336, 32 layers, 32 heads, 8 kv heads, vocab
    128256) built in bfloat16 on DEVICE: eager under ``with torch.device(DEVICE)``, then
    fxinit traced for DEVICE and materialized there, exact (checked bit for bit against the
    eager model), then portable (``tools/gpu_portable.py``): the default path first in the
    process with no warm-up (worker threads; compile time reported apart), warm, Inductor's
    kernels, torch ops; every tensor's first row against the CPU's, bit for bit; compile time
    cold and warm, each in a fresh process. Each row reports its time, its ratio to eager and
    the achieved bandwidth (output bytes / time) against DEVICE's copy bandwidth (bytes read +
    written per second by one large copy). ``--small`` uses a ~25M-parameter Llama instead.

Exit status 1 when a portable tensor breaks its bound, a portable row differs from the CPU's, or the exact
bench model differs from eager.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

import fxinit  # noqa: E402
from fxinit.backends.compiled import nvrtc_available  # noqa: E402
from gpu_contexts import SIZES, check_device_contexts, report  # noqa: E402

if __name__ == "__main__":  # gpu_portable imports this file as gpu_check: one module, one _PROFILE_LATER
    sys.modules.setdefault("gpu_check", sys.modules[__name__])

BENCH_CONFIGS = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "small": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=2, vocab_size=8000),
}
PORTABLE_MODELS = ("llama", "bert", "gpt2", "t5", "vit", "mixtral")
UNIFORM_FAMILY = {"uniform_", "rand", "rand_like", "random_", "randint", "randint_like", "randperm", "bernoulli_",
                  "bernoulli"}
NORMAL_FAMILY = {"normal_", "normal", "randn", "randn_like"}
TRUNC_NORMAL = {"torch.nn.init.trunc_normal_"}  # portable's rejection sampler on the normal stream


# ----------------------------------------------------------------------------- helpers
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


#: GPU memory the last ``_timed`` call took at its peak beyond what was allocated before it
#: (the bytes it kept and its temporaries); None on the CPU.
LAST_PEAK: list[int | None] = [None]


def _timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    _sync(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    seconds = time.perf_counter() - t0
    LAST_PEAK[0] = torch.cuda.max_memory_allocated(device) - before if device.type == "cuda" else None
    return seconds, out


def kernel_seconds(fn: Callable[[], Any], device: torch.device) -> float | None:
    """Seconds the GPU's kernels, copies and memsets ran during ``fn()`` (torch's profiler,
    one more run): what is left of a row's time is the host's, Python per node. None on the CPU."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    _sync(device)
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            _sync(device)
        total = 0.0
        for event in prof.key_averages():
            total += getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0) or 0
    except Exception as exc:  # noqa: BLE001 - a profiler that does not work here costs a column, not the run
        print(f"  (no kernel time: torch's profiler failed: {type(exc).__name__}: {exc})", flush=True)
        return None
    return total / 1e6


#: Rows whose kernels' GPU time is still to be measured: ``(row, setup, run)``, profiled as
#: ``run(setup())`` once every row is timed. torch's profiler leaves CUPTI attached when it
#: stops (pytorch/pytorch#144455), and that slowed every later launch: the 8B exact row took
#: 72 ms after a profiled row and 40 ms in a process never profiled, on one H100.
_PROFILE_LATER: list[tuple[dict, Callable[[], Any], Callable[[Any], Any]]] = []


def profile_later(row: dict, setup: Callable[[], Any], run: Callable[[Any], Any], device: torch.device) -> None:
    """Measure ``row``'s kernel seconds (``kernel_seconds(lambda: run(setup()))``, the setup
    outside the profile) in ``profile_pending``, after the timed rows."""
    if device.type == "cuda":
        _PROFILE_LATER.append((row, setup, run))


def profile_pending(device: torch.device) -> None:
    """The kernel seconds of every row ``profile_later`` holds, each in one more run."""
    while _PROFILE_LATER:
        row, setup, run = _PROFILE_LATER.pop(0)
        made = setup()
        row["kernels_s"] = kernel_seconds(lambda: run(made), device)
        del made
        if device.type == "cuda":
            torch.cuda.empty_cache()


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


#: The portable paths checked on each device: torch ops, fxinit's Triton kernel (CUDA's default;
#: on the CPU under Triton's interpreter), fxinit's CUDA kernel (NVRTC; on the CPU compiled as
#: C), Inductor's kernels.
PATHS = {"cuda": (False, None, "nvrtc", True), "cpu": (False, "triton", "nvrtc", True)}
PATH_NAMES = {False: "torch ops", None: "default", True: "inductor", "triton": "triton", "nvrtc": "nvrtc"}


@contextlib.contextmanager
def _path(device: torch.device, compile: bool | str | None) -> Iterator[None]:
    """On the CPU: torch ops instead of fxinit's C kernel (``compile=False``), Triton's
    interpreter for ``compile='triton'``, fxinit's CUDA kernel compiled as C for ``'nvrtc'``."""
    if device.type != "cpu" or compile not in (False, "triton", "nvrtc"):
        yield
        return
    if compile is False:
        with _torch_op_samplers():
            yield
        return
    with _env("TRITON_INTERPRET" if compile == "triton" else "FXINIT_NVRTC_ON_CPU", "1"):
        yield


@contextlib.contextmanager
def _torch_op_samplers() -> Iterator[None]:
    """The portable samplers as torch ops (what CUDA runs) instead of fxinit's C kernels."""
    from fxinit.rng import native

    with _env("FXINIT_NO_NATIVE", "1"):
        native.portable_library.cache_clear()
        try:
            yield
        finally:
            native.portable_library.cache_clear()


@contextlib.contextmanager
def _env(name: str, value: str) -> Iterator[None]:
    """Environment variable ``name`` set to ``value`` inside, restored after."""
    saved = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ[name]
        else:
            os.environ[name] = saved


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> int:
    """The largest distance between corresponding floats, in representable values (0: the
    same bits up to the sign of zero); -1 when one is NaN and the other is not."""
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    if not a.is_floating_point():
        return 0 if torch.equal(a, b) else -1
    if a.numel() == 0:
        return 0
    nan_a, nan_b = torch.isnan(a), torch.isnan(b)
    if not torch.equal(nan_a, nan_b):
        return -1
    keep = ~nan_a
    bits = {torch.float64: torch.int64, torch.float32: torch.int32, torch.bfloat16: torch.int16,
            torch.float16: torch.int16}[a.dtype]

    def ordinal(x: torch.Tensor) -> torch.Tensor:  # floats in order as integers, -0.0 == +0.0
        i = x[keep].view(bits).to(torch.int64)
        magnitude = i & ((1 << (torch.iinfo(bits).bits - 1)) - 1)
        return torch.where(i < 0, -magnitude, magnitude)

    return int((ordinal(a) - ordinal(b)).abs().max()) if keep.any() else 0


def random_kinds(graph: fxinit.InitGraph, name: str) -> set[str]:
    """Names of the random ops (and opaque init functions) that run for output ``name``."""
    kinds = set()
    for n in graph.required_nodes([name]):
        if n.meta.get("generators"):
            kinds.add(n.meta.get("opaque") or getattr(getattr(n.target, "overloadpacket", n.target), "__name__", "?"))
    return kinds


def _rank(dist: int) -> float:
    return float("inf") if dist < 0 else dist


def _family(kinds: set[str]) -> str:
    if not kinds:
        return "not random"
    if kinds <= UNIFORM_FAMILY:
        return "uniform"
    if kinds <= UNIFORM_FAMILY | NORMAL_FAMILY:
        return "normal"
    if kinds <= UNIFORM_FAMILY | NORMAL_FAMILY | TRUNC_NORMAL:
        return "trunc_normal"
    return "other"


# ----------------------------------------------------------------------------- portable across devices
def _nn_models() -> dict[str, Callable[[], torch.nn.Module]]:
    nn = torch.nn

    def orthogonal() -> nn.Module:
        m = nn.Linear(24, 24, dtype=torch.float32)  # QR has no bfloat16 kernel, in eager either
        nn.init.orthogonal_(m.weight)
        return m

    return {
        "nn.Linear": lambda: nn.Linear(300, 70),
        "nn.Conv2d": lambda: nn.Conv2d(8, 16, 3),
        "nn.Embedding": lambda: nn.Embedding(1000, 48, padding_idx=0),
        "nn.LSTM": lambda: nn.LSTM(16, 32, num_layers=2),
        "nn.MultiheadAttention": lambda: nn.MultiheadAttention(64, 4),
        "nn.init.orthogonal_": orthogonal,
    }


def _transformers_models(names: tuple[str, ...]) -> dict[str, Callable[[], torch.nn.Module]]:
    from transformers import AutoModel

    import corpus

    listing = {r["model"]: r for r in json.loads(corpus.LIST_PATH.read_text()) if r.get("variant")}
    out = {}
    for name in names:
        if name in listing:
            cfg = corpus.build_config(name, listing[name]["variant"])
            out[name] = lambda cfg=cfg: AutoModel.from_config(cfg)
    return out


def portable_values(factory: Callable[[], torch.nn.Module], device: torch.device, seed: int,
                    compile: bool | None = False) -> tuple[fxinit.InitGraph, dict[str, torch.Tensor]]:
    """The portable values of a model traced for ``device``, materialized there."""
    torch.manual_seed(seed)
    with device:
        m = fxinit.trace_init(factory)
    graph = fxinit.init_graph(m)
    return graph, graph.materialize(rng="portable", compile=compile)


def check_portable(device: torch.device, dtypes: list[torch.dtype], seed: int = 0) -> tuple[list[dict], bool]:
    """Per model, dtype, path (torch ops, compiled) and family of random ops: the worst ulp
    distance DEVICE vs CPU (fxinit's C kernel)."""
    cpu = torch.device("cpu")
    models = {**_nn_models(), **_transformers_models(PORTABLE_MODELS)}
    rows, ok = [], True
    paths = PATHS[device.type]
    if device.type == "cuda" and (why := nvrtc_available(device)) is not None:
        print(f"fxinit's CUDA kernel (compile='nvrtc') cannot run here: {why}", flush=True)
        paths, ok = tuple(p for p in paths if p != "nvrtc"), False
    for dtype, (label, factory), compile in ((d, m, c) for d in dtypes for m in models.items() for c in paths):
        with _default_dtype(dtype):
            graph, ref = portable_values(factory, cpu, seed)
            with _path(device, compile):
                _, got = portable_values(factory, device, seed, compile=compile)
        worst: dict[str, tuple[int, str]] = {}
        for name, value in ref.items():
            family = _family(random_kinds(graph, name))
            if got[name].dtype != value.dtype or got[name].shape != value.shape:
                dist = -1
            else:
                dist = ulp_distance(got[name], value)
            if family not in worst or _rank(dist) > _rank(worst[family][0]):
                worst[family] = (dist, name)
        for family, (dist, name) in sorted(worst.items()):
            low_precision = dtype in (torch.float32, torch.bfloat16)
            bound = {"uniform": 0, "normal": 0 if low_precision else None,
                     "trunc_normal": 0 if low_precision else None}.get(family)
            good = dist >= 0 and (bound is None or dist <= bound)
            ok &= good
            rows.append({"model": label, "dtype": str(dtype).removeprefix("torch."), "family": family,
                         "path": PATH_NAMES[compile], "max_ulp": dist, "bound": bound, "worst": name, "ok": good})
    return rows, ok


def print_portable(rows: list[dict], device: torch.device) -> None:
    side = "cpu (torch-op samplers)" if device.type == "cpu" else str(device)
    print(f"\nportable values on {side} against the CPU's (ulp: units in the last place; -1: NaN pattern, "
          f"dtype or shape differs)")
    print(f"{'model':<24}{'dtype':<10}{'path':<11}{'written by':<12}{'max ulp':>8}{'bound':>7}  worst tensor")
    for r in rows:
        bound = "-" if r["bound"] is None else str(r["bound"])
        flag = "" if r["ok"] else "  <-- over the bound"
        print(f"{r['model']:<24}{r['dtype']:<10}{r['path']:<11}{r['family']:<12}{r['max_ulp']:>8}{bound:>7}  "
              f"{r['worst']}{flag}")


# ----------------------------------------------------------------------------- bench
def copy_bandwidth(device: torch.device, nbytes: int, repeat: int = 5) -> float:
    """Bytes read + written per second by one large device-to-device copy (best of ``repeat``)."""
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = min(_timed(lambda: dst.copy_(src), device)[0] for _ in range(repeat))
    return 2 * nbytes / best


def _nbytes(m: torch.nn.Module) -> int:
    seen, total = set(), 0
    for t in [*m.parameters(), *m.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _fxinit_row(label: str, cls: Any, cfg: Any, device: torch.device, repeat: int = 1,
                **options: Any) -> tuple[dict, Any]:
    """Trace ``cls(cfg)`` for ``device`` from seed 0 and materialize it there, ``repeat``
    times, timing both (the best of each); the last model."""
    rows = []
    for _ in range(repeat):
        m = None  # the last model's memory back to the allocator's cache before the next
        torch.manual_seed(0)
        with device:
            trace_s, m = _timed(lambda: fxinit.trace_init(cls, cfg), device)
        seconds, _ = _timed(lambda: fxinit.materialize(m, **options), device)
        rows.append((seconds, trace_s))
    row = {"row": label, "seconds": min(r[0] for r in rows), "trace_s": min(r[1] for r in rows),
           "bytes": _nbytes(m), "repeats": [round(r[0], 4) for r in rows], "peak": LAST_PEAK[0]}
    def trace() -> torch.nn.Module:
        torch.manual_seed(0)
        with device:
            return fxinit.trace_init(cls, cfg)

    profile_later(row, trace, lambda again: fxinit.materialize(again, **options), device)
    return row, m


def floor_seconds(m: torch.nn.Module, device: torch.device, repeat: int) -> float:
    """Allocating ``m``'s parameters and buffers on ``device`` and writing each once (best of
    ``repeat``): what no initialization can beat."""
    shapes = [(t.shape, t.dtype) for t in {id(t): t for t in [*m.parameters(), *m.buffers()]}.values()]

    return min(_timed(lambda: [torch.empty(s, dtype=d, device=device).zero_() for s, d in shapes], device)[0]
               for _ in range(repeat))


def bench(device: torch.device, size: str, exact: bool = True, timing_compiles: bool = True) -> tuple[list[dict], bool]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from gpu_portable import compile_times, portable_rows, print_compile_times

    cfg, small = LlamaConfig(**BENCH_CONFIGS[size]), LlamaConfig(**BENCH_CONFIGS["small"])
    rows: list[dict] = []
    repeat = 3
    with _default_dtype(torch.bfloat16):
        with device:  # the allocator and torch's own kernels warm: eager first, on the small model, then once
            LlamaForCausalLM(small)
            LlamaForCausalLM(cfg)
            times = []
            for _ in range(repeat):
                eager = None
                torch.manual_seed(0)
                seconds, eager = _timed(lambda: LlamaForCausalLM(cfg), device)
                times.append(seconds)
        nbytes = _nbytes(eager)
        rows.append({"row": "eager", "seconds": min(times), "trace_s": None, "bytes": nbytes,
                     "repeats": [round(t, 4) for t in times], "peak": LAST_PEAK[0]})
        eager = None

        def build_eager(_: Any) -> torch.nn.Module:
            torch.manual_seed(0)
            with device:
                return LlamaForCausalLM(cfg)

        profile_later(rows[-1], lambda: None, build_eager, device)
        eager = build_eager(None)
        rows.append({"row": "floor (allocate, write once)", "seconds": floor_seconds(eager, device, repeat),
                     "trace_s": None, "bytes": nbytes})
        if exact:
            with device:
                fxinit.materialize(fxinit.trace_init(LlamaForCausalLM, small))
            row, m = _fxinit_row("fxinit exact", LlamaForCausalLM, cfg, device, repeat)
            ref = dict(eager.named_parameters()) | dict(eager.named_buffers())
            row["mismatched"] = [k for k, v in [*m.named_parameters(), *m.named_buffers()]
                                 if v.device != ref[k].device or v.dtype != ref[k].dtype or not torch.equal(
                                     v.detach().reshape(-1).view(torch.uint8),
                                     ref[k].detach().reshape(-1).view(torch.uint8))]
            rows.append(row)
            del ref, m
        del eager
        if device.type == "cuda":
            torch.cuda.empty_cache()
        portable, same = portable_rows(cfg, small, device)
        profile_pending(device)  # after every timed row: see _PROFILE_LATER
    for r in portable:
        r["bytes"] = nbytes
    rows += portable
    copy = copy_bandwidth(device, min(1 << 30, nbytes))
    for r in rows:
        r["gb_s"] = r["bytes"] / r["seconds"] / 1e9
        r["of_copy"] = r["bytes"] / r["seconds"] / copy
        r["of_eager"] = r["seconds"] / rows[0]["seconds"]
        r["of_floor"] = r["seconds"] / rows[1]["seconds"]
    print(f"\n{size} Llama in bfloat16 on {device}: {nbytes / 1e9:.2f} GB of parameters and buffers; "
          f"copy bandwidth {copy / 1e9:.0f} GB/s (read + write)")
    print(f"{'row':<30}{'build s':>9}{'x eager':>8}{'x floor':>8}{'trace s':>9}{'GB/s':>8}{'of copy':>9}"
          f"{'compile s':>10}{'peak GB':>9}{'kernels s':>10}  note  (build: eager construction, or materialize; best "
          f"of {repeat} where repeated, the allocator's cache warm; peak: GPU memory the build took beyond what it "
          "began with; kernels: GPU time of its kernels, in one more run under torch's profiler once every row is timed)")
    for r in rows:
        trace = "-" if r["trace_s"] is None else f"{r['trace_s']:.3f}"
        compiled = f"{r['compile_s']:.2f}" if "compile_s" in r else "-"
        peak = "-" if r.get("peak") is None else f"{r['peak'] / 1e9:.2f}"
        kernels = "-" if r.get("kernels_s") is None else f"{r['kernels_s']:.4f}"
        note = r.get("note", "")
        if "mismatched" in r:
            note = "bitwise equal to eager" if not r["mismatched"] else f"DIFFERS from eager: {r['mismatched'][:3]}"
        print(f"{r['row']:<30}{r['seconds']:>9.3f}{r['of_eager']:>8.2f}{r['of_floor']:>8.2f}{trace:>9}{r['gb_s']:>8.1f}"
              f"{r['of_copy']:>8.0%}{compiled:>10}{peak:>9}{kernels:>10}  {note}", flush=True)
    if timing_compiles:
        times = compile_times(device, ("None", "nvrtc", "True") if device.type == "cuda" else ("True",))
        print_compile_times(times, device)
        rows += [{"row": f"compile={t['compile']} in a fresh process", **t} for t in times]
    return rows, same and not any(r.get("mismatched") for r in rows)


def exact_corpus(device: torch.device, every: int) -> int:
    """``tools/corpus.py`` built under ``with torch.device(DEVICE)``: eager and fxinit, whole
    and leaf by leaf in reverse, float32 and bfloat16; its exit code."""
    print(f"\nexact corpus on {device} (every {every}th architecture, float32 and bfloat16, whole and reverse)",
          flush=True)
    jobs = max(1, min(8, (os.cpu_count() or 2) // 2))  # one GPU takes several processes' small models
    cmd = [sys.executable, str(Path(__file__).resolve().parent / "corpus.py"), "--device", str(device),
           "--seeds", "0,1", "--dtypes", "float32,bfloat16", "--pair", "--every", str(every), "--jobs", str(jobs)]
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", choices=["contexts", "corpus", "portable", "bench"])
    ap.add_argument("--sizes", help="comma-separated tensor sizes of the contexts section (default: "
                                    "those around the CUDA kernels' thresholds)")
    ap.add_argument("--corpus-every", type=int, default=4,
                    help="the exact corpus on DEVICE: every K-th architecture, float32 and bfloat16 (0: skip)")
    ap.add_argument("--small", action="store_true", help="bench a ~25M-parameter Llama instead of the 8B one")
    ap.add_argument("--dtypes", default="float32,bfloat16", help="default dtypes of the portable check")
    ap.add_argument("--compile-times", action=argparse.BooleanOptionalAction, default=True,
                    help="bench: time compiling portable kernels in fresh processes, cold and warm caches")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device here: run on a machine with a GPU, or pass --device cpu")
    print(f"torch {torch.__version__}, device {device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else ""))
    out: dict[str, Any] = {}
    ok = True
    if args.only in (None, "contexts"):
        sizes = tuple(int(s) for s in args.sizes.split(",")) if args.sizes else SIZES
        problems, count = check_device_contexts(device, sizes)
        out["contexts"], ok = problems, report(problems, count, device) and ok
    if args.only in (None, "corpus") and args.corpus_every:
        out["corpus"] = code = exact_corpus(device, args.corpus_every)
        ok = ok and code == 0
    if args.only in (None, "portable"):
        rows, good = check_portable(device, [getattr(torch, d) for d in args.dtypes.split(",")])
        print_portable(rows, device)
        out["portable"], ok = rows, ok and good
    if args.only in (None, "bench"):
        rows, good = bench(device, "small" if args.small else "8b", timing_compiles=args.compile_times)
        out["bench"], ok = rows, ok and good
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print("\nall within bounds" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
