"""Materialization speed and memory against eager construction, measured in one run.

Every figure is the median of several fresh processes (so imports, allocator state and
caches do not leak between measurements), with the spread (min-max) next to it.
Ratios are against eager construction and against the floor (allocating every byte and
writing it once, which any materialization into fresh memory does), both measured in the same run.

    python tools/bench.py                  # the ~0.5B Llama of the passes issue, CPU
    python tools/bench.py --model tiny     # a quick look
    python tools/bench.py --model launch --rows "fxinit materialize,fxinit materialize warm"  # per-node overhead
    python tools/bench.py --trace-405b     # also: tracing a 405B Llama vs meta construction
    python tools/bench.py --samplers       # only the portable samplers' ns per element vs torch's
    python tools/bench.py --kernels        # compiled portable fills of the 0.5B and 405B configs:
                                           # kernels, compile time cold and warm

Rows:
  eager                 torch.manual_seed(0); LlamaForCausalLM(config)
  floor                 meta construction, to_empty(cpu), zero_() of every tensor (on all threads):
                        allocating and writing every byte once
  meta+to_empty+init    meta construction, to_empty(cpu), model.init_weights() (not exact)
  fxinit exact          trace_init + materialize (bitwise equal to eager)
  fxinit materialize    the materialize of "fxinit exact" alone (timed after the trace)
  fxinit materialize warm   the same, after one materialize of another trace in the process (one-time
                        checks and caches done): the per-node cost alone
  fxinit materialize by layer   the same, one materialize per decoder layer, then the model (FSDP1's
                        param_init_fn materializes one wrapped module at a time)
  fxinit exact 1 thread   the same without concurrent tensor generation
  fxinit portable       trace_init + materialize(rng="portable"): counter-based stream, not eager's
                        values (compiled kernels cached by an earlier process)
  fxinit portable cold  the same with an empty kernel cache: the C compiler runs first
                        (its time is reported as compile_s)
  fxinit portable compiled  the same with compile=True: kernels torch.compile generates (Inductor's
                        C++ on CPU; cached by an earlier process), compile_s of the time spent compiling
  fxinit last layer     trace_init + materialize(model.model.layers[-1]) only
  eager + to(bf16)      eager construction, then model.to(torch.bfloat16)
  fxinit exact bf16     trace_init + materialize(dtype=torch.bfloat16): the same bits, the
                        float32 model never whole (fills run in chunks cast as they go)
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODELS = {
    "0.5b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, vocab_size=32000),
    "tiny": dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=8000),
    # launch-bound: ~820 init nodes of a few KiB each, so time goes to per-node work (issue 32's
    # CPU proxy for an 8B model on a GPU, where kernels take microseconds)
    "launch": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=32, num_attention_heads=4,
                   num_key_value_heads=2, vocab_size=1000),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                 num_key_value_heads=8, vocab_size=128256),
}

# Each row runs in a fresh interpreter; it prints one JSON line {"seconds", "peak_rss", "base_rss"}.
# Rows that do not use fxinit do not import it: eager's figures are those of a program
# without fxinit (importing it costs ~2.5 MiB, which only fxinit's rows should carry).
_CHILD = r"""
import json, resource, sys, time
sys.path.insert(0, {root!r})
import torch
{import_fxinit}
from transformers import LlamaConfig, LlamaForCausalLM

def rss():  # current resident set, bytes
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

cfg = LlamaConfig(**{cfg!r})
torch.manual_seed(0)
base = rss()
t0 = time.perf_counter()
{body}
seconds = time.perf_counter() - t0
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
if callable(extra):  # figures about the result, gathered outside the timed region
    extra = extra()
print(json.dumps({{"seconds": seconds, "peak_rss": peak, "base_rss": base, "extra": extra}}))
"""

ROWS = {
    "eager": "m = LlamaForCausalLM(cfg)\nextra = None",
    "floor": (
        "with torch.device('meta'):\n    m = LlamaForCausalLM(cfg)\n"
        "m.to_empty(device='cpu')\nwith torch.no_grad():\n"
        "    for t in [*m.parameters(), *m.buffers()]:\n        t.zero_()\nextra = None"
    ),
    "meta+to_empty+init": (
        "with torch.device('meta'):\n    m = LlamaForCausalLM(cfg)\n"
        "m.to_empty(device='cpu')\nm.init_weights()\nextra = None"
    ),
    "fxinit exact": (
        "m = fxinit.trace_init(LlamaForCausalLM, cfg)\nt_trace = time.perf_counter() - t0\n"
        "fxinit.materialize(m)\nextra = {'trace_s': t_trace}"
    ),
    "fxinit materialize": (  # the materialize alone, after the trace (first use: self-checks, caches)
        "m = fxinit.trace_init(LlamaForCausalLM, cfg)\nt0 = time.perf_counter()\nfxinit.materialize(m)\nextra = None"
    ),
    "fxinit materialize warm": (  # the same after one materialize of another trace: per-node cost alone
        "fxinit.materialize(fxinit.trace_init(LlamaForCausalLM, cfg))\ntorch.manual_seed(0)\n"
        "m = fxinit.trace_init(LlamaForCausalLM, cfg)\nt0 = time.perf_counter()\nfxinit.materialize(m)\nextra = None"
    ),
    "fxinit materialize by layer": (  # one call per decoder layer, then the rest (FSDP1's param_init_fn)
        "m = fxinit.trace_init(LlamaForCausalLM, cfg)\nt0 = time.perf_counter()\n"
        "for layer in m.model.layers:\n    fxinit.materialize(layer)\nfxinit.materialize(m)\nextra = None"
    ),
    "fxinit exact 1 thread": (
        "torch.set_num_threads(1)\nm = fxinit.trace_init(LlamaForCausalLM, cfg)\nfxinit.materialize(m)\nextra = None"
    ),
    "fxinit portable": (
        "m = fxinit.trace_init(LlamaForCausalLM, cfg)\nfxinit.materialize(m, rng='portable')\nextra = None"
    ),
    "fxinit portable cold": (
        "import os, tempfile\nos.environ['FXINIT_CACHE_DIR'] = tempfile.mkdtemp()\n"
        "from fxinit.rng import native\nnative.library(), native.portable_library()\n"
        "compile_s = time.perf_counter() - t0\n"
        "m = fxinit.trace_init(LlamaForCausalLM, cfg)\nfxinit.materialize(m, rng='portable')\n"
        "extra = {'compile_s': compile_s}"
    ),
    "fxinit portable compiled": (
        "from fxinit.backends.compiled import STATS\n"
        "m = fxinit.trace_init(LlamaForCausalLM, cfg)\nfxinit.materialize(m, rng='portable', compile=True)\n"
        "extra = {'compile_s': STATS.seconds, 'kernels': STATS.kernels}"
    ),
    "fxinit last layer": (
        "m = fxinit.trace_init(LlamaForCausalLM, cfg)\nfxinit.materialize(m.model.layers[-1])\nextra = None"
    ),
    "eager + to(bf16)": "m = LlamaForCausalLM(cfg).to(torch.bfloat16)\nextra = None",
    "fxinit exact bf16": (
        "m = fxinit.trace_init(LlamaForCausalLM, cfg)\nfxinit.materialize(m, dtype=torch.bfloat16)\nextra = None"
    ),
}

TRACE_ROWS = {
    "meta construction (405B)": "with torch.device('meta'):\n    m = LlamaForCausalLM(cfg)\nextra = None",
    "fxinit trace (405B)": (
        "m = fxinit.trace_init(LlamaForCausalLM, cfg)\n"
        "extra = lambda: {'nodes': fxinit.init_graph(m).stats()['nodes_captured']}"
    ),
}


# The kernels a config's portable fills compile to, and the time compiling them takes (in
# float32 and with dtype=bfloat16); nothing is materialized, so the 405B config fits.
KERNELS_ROW = (
    "import os\nos.environ['TORCHINDUCTOR_CACHE_DIR'] = @CACHE@\n"
    "from fxinit.backends.compiled import STATS, CompiledSampler\n"
    "m = fxinit.trace_init(LlamaForCausalLM, cfg)\ng = fxinit.init_graph(m)\nextra = {}\n"
    "for name, dtype in (('float32', None), ('bfloat16', torch.bfloat16)):\n"
    "    plan = g.plan(rng='portable', compile=True, dtype=dtype)\n"
    "    before = (STATS.kernels, STATS.seconds)\n"
    "    CompiledSampler(0, plan.streams, plan.kernels).prepare(plan.random_nodes)\n"
    "    extra[name] = {'fills': len(plan.kernels), 'kernels': len({k.signature for k in plan.kernels.values()}),\n"
    "                   'compiled': STATS.kernels - before[0], 'compile_s': STATS.seconds - before[1]}\n"
)


def kernels_table(repeat: int) -> str:
    """Compiled kernels of the 0.5B and 405B configs: fills, distinct kernels, compile time in
    a process with an empty Inductor cache (cold) and in later processes (warm)."""
    import tempfile

    lines = ["compiled portable fills: fills run as kernels, distinct kernels, compile seconds cold (empty "
             "Inductor cache) and warm (median of later processes)"]
    for model in ("0.5b", "405b"):
        cache = tempfile.mkdtemp(prefix="fxinit-inductor-")
        body = KERNELS_ROW.replace("@CACHE@", repr(cache))
        cold = run_child(MODELS[model], body)["extra"]
        warm = [run_child(MODELS[model], body)["extra"] for _ in range(repeat)]
        for dtype in ("float32", "bfloat16"):
            c = cold[dtype]
            w = statistics.median(r[dtype]["compile_s"] for r in warm)
            lines.append(f"  {model:>5} {dtype:<9}: {c['fills']:>5} fills, {c['kernels']} kernels; "
                         f"compile {c['compile_s']:.1f} s cold, {w:.1f} s warm")
    return "\n".join(lines)


STATS_ROW = (
    "m = fxinit.trace_init(LlamaForCausalLM, cfg)\ng = fxinit.init_graph(m)\n"
    "extra = {'float32': g.stats(), 'bfloat16': g.stats(dtype=torch.bfloat16)}"
)


def run_child(cfg: dict, body: str) -> dict:
    import_fxinit = "import fxinit" if "fxinit" in body else ""
    code = _CHILD.format(root=str(ROOT), cfg=cfg, body=body, import_fxinit=import_fxinit)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"benchmark child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure(cfg: dict, rows: dict[str, str], repeat: int) -> dict[str, list[dict]]:
    sys.path.insert(0, str(ROOT))
    from fxinit.rng import native

    native.library(), native.portable_library()  # warm rows find the kernels compiled
    results: dict[str, list[dict]] = {name: [] for name in rows}
    for _ in range(repeat):  # interleaved, so drifting machine load hits every row alike
        for name, body in rows.items():
            results[name].append(run_child(cfg, body))
    return results


def sampler_speed(n: int = 1 << 22, repeat: int = 7) -> str:
    """ns per element of fxinit's samplers, in memory already touched, next to torch's own CPU
    samplers (MT19937): the generator's cost without the page faults. "fxinit exact" is
    ``rng.fills`` (torch's bits, compiled), on one thread and on all; "fxinit portable" the
    portable streams on one thread. The median (min-max) of ``repeat`` timings, interleaved."""
    import time

    import torch
    from fxinit.rng import portable
    from fxinit.rng.fills import native_fill

    all_threads = torch.get_num_threads()
    lines = [f"samplers, memory already touched, ns per element, median (min-max) of {repeat}; CPU capability "
             f"{torch.backends.cpu.get_cpu_capability()}, {all_threads} threads for 'all':"]
    state = torch.Generator().manual_seed(1).get_state()
    with portable.serial_fills():
        for dtype in (torch.float32, torch.bfloat16, torch.float64):
            out = torch.empty(n, dtype=dtype)
            for kind, params in (("normal", (0.0, 0.02)), ("uniform", (-0.1, 0.1))):
                def torch_fill(threads: int) -> None:
                    torch.set_num_threads(threads)
                    getattr(out, kind + "_")(*params)

                fills = {"torch 1": lambda: torch_fill(1), "torch all": lambda: torch_fill(all_threads),
                         "fxinit exact 1": lambda: native_fill(kind, out, state, params, threads=1),
                         "fxinit exact all": lambda: native_fill(kind, out, state, params, threads=all_threads),
                         "fxinit portable 1": lambda: portable.fill_(
                             out, kind, 1, **dict(zip(("mean", "std") if kind == "normal" else ("low", "high"),
                                                      params)))}
                if not native_fill(kind, out, state, params):
                    fills = {k: v for k, v in fills.items() if "exact" not in k}  # fell back to torch's kernel
                timings: dict[str, list[float]] = {name: [] for name in fills}
                for _ in range(repeat + 1):
                    for name, fill in fills.items():
                        t = time.perf_counter()
                        fill()
                        timings[name].append((time.perf_counter() - t) / n * 1e9)
                parts = []
                for name, ts in timings.items():
                    ts = ts[1:]  # the first run warms up
                    parts.append(f"{name} {statistics.median(ts):.2f} ({min(ts):.2f}-{max(ts):.2f})")
                lines.append(f"  {str(dtype).removeprefix('torch.'):<9}{kind:<8} " + "   ".join(parts))
    torch.set_num_threads(all_threads)
    return "\n".join(lines)


def table(results: dict[str, list[dict]], references: list[str]) -> str:
    """One line per row: median time and peak RSS (spread min-max), each as a ratio against
    every row of ``references`` measured in the same run."""
    def median(name: str, key: str) -> float:
        return statistics.median(r[key] for r in results[name])

    refs = [(median(ref, "seconds"), median(ref, "peak_rss")) for ref in references]
    heads = "".join(f"{'x ' + ref[:9]:>12}" for ref in references)
    lines = [f"ratios (x ...) are against the rows {', '.join(map(repr, references))}",
             f"{'row':<26}{'time s (min-max)':>22}{heads}{'peak RSS MiB':>15}{heads}{'  +RSS MiB':>11}"]
    for name, rs in results.items():
        ts = [r["seconds"] for r in rs]
        grow = statistics.median(r["peak_rss"] - r["base_rss"] for r in rs)
        t, m = statistics.median(ts), median(name, "peak_rss")
        lines.append(f"{name:<26}{t:>9.3f} ({min(ts):.3f}-{max(ts):.3f})"
                     + "".join(f"{t / ref_t:>11.3f}x" for ref_t, _ in refs)
                     + f"{m / 2**20:>15.0f}" + "".join(f"{m / ref_m:>11.3f}x" for _, ref_m in refs)
                     + f"{grow / 2**20:>11.0f}")
        extras = [r["extra"] for r in rs if r.get("extra")]
        if extras:
            keys = extras[0].keys()
            lines.append("    " + ", ".join(f"{k} median {statistics.median(e[k] for e in extras):.3f}" for k in keys))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["0.5b", "tiny", "launch"], default="0.5b")
    ap.add_argument("--repeat", type=int, default=3, help="fresh processes per row (median reported)")
    ap.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of rows")
    ap.add_argument("--trace-405b", action="store_true", help="also time tracing the 405B config")
    ap.add_argument("--json", type=Path, help="write raw measurements here")
    ap.add_argument("--samplers", action="store_true", help="only time fxinit's samplers (exact: torch's bits compiled; portable) against torch's")
    ap.add_argument("--kernels", action="store_true",
                    help="only count and compile the kernels of compiled portable fills (0.5B and 405B)")
    args = ap.parse_args(argv)
    if args.samplers:
        sys.path.insert(0, str(ROOT))
        print(sampler_speed())
        return 0
    if args.kernels:
        print(kernels_table(args.repeat))
        return 0

    import torch  # only for the header

    rows = {k: ROWS[k] for k in args.rows.split(",")}
    rows = {"eager": ROWS["eager"], "floor": ROWS["floor"], **rows}  # the references, in every run
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, model {args.model}: {MODELS[args.model]}")
    results = measure(MODELS[args.model], rows, args.repeat)
    print(table(results, ["eager", "floor"]))
    print(sampler_speed())
    stats = run_child(MODELS[args.model], STATS_ROW)["extra"]
    plain, bf16 = stats["float32"], stats["bfloat16"]
    print("\ninit graph, as captured -> as run (slicing, dead-init elimination, CSE, in-place chains):")
    for key in ("nodes", "random_ops", "random_elements", "bytes_allocated"):
        print(f"  {key:<16}{plain[key + '_captured']:>16,} -> {plain[key]:>16,}")
    print(f"  CSE reused {plain['cse_reused']} nodes, {plain['in_place']} ran in place; output bytes "
          f"{plain['output_bytes']:,}")
    print(f"  with dtype=bfloat16: {bf16['fused_casts']} fills fused with their cast, bytes allocated "
          f"{bf16['bytes_allocated']:,} for {bf16['output_bytes_in_dtype']:,} output bytes")
    raw = {"model": args.model, "rows": results, "graph_stats": stats}
    if args.trace_405b:
        big = measure(MODELS["405b"], TRACE_ROWS, args.repeat)
        print()
        print(table(big, ["meta construction (405B)"]))
        raw["trace_405b"] = big
    if args.json:
        args.json.write_text(json.dumps(raw, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
