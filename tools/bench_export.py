"""Exporting a model larger than memory to a checkpoint: time, rate against the disk, peak RSS.

In one run: trace a Llama config to an init-graph file; measure the disk's sequential write
rate (``dd if=/dev/zero ... bs=1M conv=fdatasync``, in the directory the checkpoint goes
to); export with ``fxinit materialize --format hf|dcp`` in a child process, whose peak RSS
is its ``ru_maxrss`` (from ``wait4``); then check the result in another process: every tensor
present with its shape and dtype, sampled tensors (the largest included, which is written in
pieces) equal to ``load_graph(...).materialize(names)``, or for dcp, ``dcp.load`` of them.

``rate_vs_disk`` is the bytes over the export command's whole time (start-up, planning and
``--resume``'s verification included) against ``dd``'s rate; ``writing_vs_disk`` over the
time from the first byte written to the last.

    python tools/bench_export.py --model 8b                 # the judged run: 32 GB of float32
    python tools/bench_export.py --model tiny --dd-gb 0.2   # a quick look (CI)
    python tools/bench_export.py --model 8b --kill-after 30 # kill the export, then --resume it
    python tools/bench_export.py --model 405b --only model.layers.0.mlp.down_proj.weight
                                                            # one 3.5 GB tensor of a 405B, in pieces

The checkpoint is deleted afterwards unless ``--keep``. Timings on a shared machine are
noisy: compare the export's rate with the disk's measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODELS = {
    "tiny": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=32000),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "405b": dict(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                 num_key_value_heads=8, vocab_size=128256),
}


def run_child(argv: list[str], timeout: float | None = None) -> tuple[int, float, int, str]:
    """Run ``argv``; (exit status, seconds, peak RSS in bytes of that process, stdout+stderr)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        if timeout is not None:
            time.sleep(timeout)
            if proc.poll() is None:
                proc.send_signal(signal.SIGKILL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        seconds = time.perf_counter() - t0
        out.seek(0)
        text = out.read().decode(errors="replace")
    return proc.returncode, seconds, usage.ru_maxrss * 1024, text


def disk_rate(directory: Path, nbytes: int) -> float:
    """The disk's sequential write rate (bytes/s), as ``dd ... conv=fdatasync`` reports it."""
    target = directory / "dd.bin"
    count = max(1, nbytes >> 20)
    proc = subprocess.run(["dd", "if=/dev/zero", f"of={target}", "bs=1M", f"count={count}", "conv=fdatasync"],
                          capture_output=True, text=True)
    target.unlink(missing_ok=True)
    match = re.search(r"(\d+) bytes .* copied, ([0-9.]+) s", proc.stderr)
    if proc.returncode != 0 or not match:
        raise RuntimeError(f"dd failed: {proc.stderr}")
    return int(match.group(1)) / float(match.group(2))


_TRACE = r"""
import json, sys, torch, fxinit
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
m = fxinit.trace_init(LlamaForCausalLM, LlamaConfig(**json.loads(sys.argv[1])))
g = fxinit.init_graph(m)
g.save(sys.argv[2])
"""

_CHECK = r"""
import json, random, sys, warnings, torch, fxinit
from pathlib import Path
from fxinit.export.source import Source
graph_path, out, fmt, samples, only, rng, dtype = sys.argv[1:8]
dtype = getattr(torch, dtype) if dtype != "none" else None
graph = fxinit.load_graph(graph_path)
source = Source.of(graph)
from fxinit.report import matching
names = matching(source.names, only if only != "none" else None)
first = {n: g[0] for g in source.ties for n in g}
stored = [n for n in names if first.get(n, n) == n] if fmt == "hf" else names
big = max(names, key=lambda n: source.nbytes(n, dtype))
pick = sorted(set(random.Random(0).sample(names, min(int(samples), len(names))) + [big])) if int(samples) else []
bad = []
if fmt == "hf":
    from safetensors import safe_open
    found = {}
    for f in sorted(Path(out).glob("*.safetensors")):
        with safe_open(str(f), "pt") as h:
            for k in h.keys():
                found[k] = f
                sl = h.get_slice(k)
                if tuple(sl.get_shape()) != source.shapes[k]:
                    bad.append(f"{k}: shape")
    if sorted(found) != sorted(stored):
        bad.append(f"tensors: {len(found)} found, {len(stored)} expected")
    for k in pick:
        with safe_open(str(found[k]), "pt") as h:
            got = h.get_tensor(k)
        ref = graph.materialize([k], rng=rng, dtype=dtype)[k]
        if not torch.equal(got.view(torch.uint8), ref.contiguous().view(torch.uint8)):
            bad.append(f"{k}: values")
else:
    import torch.distributed.checkpoint as dcp
    warnings.simplefilter("ignore")
    md = dcp.FileSystemReader(out).read_metadata()
    if sorted(md.state_dict_metadata) != sorted(stored):
        bad.append(f"tensors: {len(md.state_dict_metadata)} found, {len(stored)} expected")
    state = {k: torch.zeros(source.shapes[k], dtype=source.written_dtype(k, dtype)) for k in pick}
    dcp.load(state, checkpoint_id=out, planner=dcp.DefaultLoadPlanner(allow_partial_load=True))
    for k in pick:
        ref = graph.materialize([k], rng=rng, dtype=dtype)[k]
        if not torch.equal(state[k].view(torch.uint8), ref.contiguous().view(torch.uint8)):
            bad.append(f"{k}: values")
print(json.dumps({"tensors": len(stored), "sampled": pick, "bad": bad}))
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=sorted(MODELS), default="8b")
    ap.add_argument("--format", choices=["hf", "dcp"], default="hf")
    ap.add_argument("--rng", choices=["exact", "portable"], default="exact")
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], help="export dtype (default: the model's, float32)")
    ap.add_argument("--only", help="export only these tensors (glob or module prefix)")
    ap.add_argument("--dir", type=Path, help="where the checkpoint goes (default: a new directory under /tmp)")
    ap.add_argument("--extra", default="", help="more options for fxinit materialize, e.g. '--memory 512MB'")
    ap.add_argument("--dd-gb", type=float, default=8.0, help="GB that dd writes to measure the disk (default 8)")
    ap.add_argument("--check", type=int, default=4, help="tensors compared with materialize (plus the largest)")
    ap.add_argument("--kill-after", type=float, help="SIGKILL the export after this many seconds, then --resume it")
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)

    work = Path(tempfile.mkdtemp(prefix="fxinit-bench-export-", dir=args.dir.parent if args.dir else None))
    out = args.dir or work / "ckpt"
    graph = work / "llama.pt"
    figures: dict[str, object] = {"model": args.model, "format": args.format, "rng": args.rng, "dtype": args.dtype}
    try:
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", _TRACE, json.dumps(MODELS[args.model]), str(graph)], check=True,
                       cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
        figures["trace_s"] = time.perf_counter() - t0
        cmd = [sys.executable, "-m", "fxinit.cli", "materialize", str(graph), "-o", str(out), "--format", args.format,
               "--rng", args.rng, "-q", *(["--dtype", args.dtype] if args.dtype else []),
               *(["--only", args.only] if args.only else []), *args.extra.split()]
        if args.kill_after is not None:
            code, seconds, _, _ = run_child(cmd, timeout=args.kill_after)
            done = sorted(p.name for p in out.iterdir() if p.is_file())
            figures["killed_after_s"] = round(seconds, 1)
            figures["files_before_resume"] = done
            cmd.append("--resume")
        out.mkdir(parents=True, exist_ok=True)
        rate_disk = disk_rate(out, int(args.dd_gb * 1e9))
        code, seconds, peak, text = run_child(cmd)
        if code != 0:
            print(text, file=sys.stderr)
            return 1
        match = re.search(r"wrote (\d+) files? \(([0-9,]+) bytes\) .* in ([0-9.]+) s", text)
        assert match, text
        written = int(match.group(2).replace(",", ""))
        figures.update(files=int(match.group(1)), bytes=written, process_s=round(seconds, 1),
                       writing_s=float(match.group(3)), rate_gb_s=round(written / seconds / 1e9, 3),
                       disk_gb_s=round(rate_disk / 1e9, 3), rate_vs_disk=round(written / seconds / rate_disk, 3),
                       writing_vs_disk=round(written / float(match.group(3)) / rate_disk, 3),
                       peak_rss_gb=round(peak / 1e9, 3), output=text.strip().splitlines()[-1])
        if args.check >= 0:
            check = subprocess.run([sys.executable, "-c", _CHECK, str(graph), str(out), args.format, str(args.check),
                                    args.only or "none", args.rng, args.dtype or "none"],
                                   capture_output=True, text=True, cwd=ROOT,
                                   env={**os.environ, "PYTHONPATH": str(ROOT)})
            if check.returncode != 0:
                print(check.stderr, file=sys.stderr)
                return 1
            figures["check"] = json.loads(check.stdout.strip().splitlines()[-1])
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
            if args.dir:
                shutil.rmtree(args.dir, ignore_errors=True)
    for key, value in figures.items():
        print(f"{key:>20}: {value}")
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2))
    bad = figures.get("check", {}).get("bad")  # type: ignore[union-attr]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
