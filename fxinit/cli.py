"""The ``fxinit`` command: trace a model to an init-graph file, show it, draw it, and
materialize it to safetensors or a checkpoint directory (Hugging Face or
torch.distributed.checkpoint), in a process that needs nothing of the model's code; check
that fxinit builds a model of yours bit for bit as eager construction does.

    fxinit trace my_pkg.models:build -o init.pt --kwargs '{"layers": 4}'
    fxinit trace transformers:AutoModelForCausalLM.from_config -o llama.pt \\
        --hf-config '{"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}'
    fxinit show init.pt [--only 'model.layers.0.*'] [--explain NAME] [--plan]
    fxinit viz init.pt -o deps.svg [--only NAME] [--no-collapse]
    fxinit materialize init.pt -o weights.safetensors [--only PATTERN] [--device cpu]
    fxinit materialize init.pt -o llama/ --format hf [--max-shard-size 5GB] [--resume] [--part 2/8]
    fxinit materialize init.pt -o step-0/ --format dcp [--only 'model.layers.31.*']
    fxinit check my_pkg.models:build --kwargs '{"layers": 2}' [--hf-config JSON] [--seed N]

Exit codes: 0 success, 1 fxinit refused or failed (the message says why and what to do) or
`check` found a difference, 2 bad command line.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class UsageError(Exception):
    """A command line that names something that does not exist or cannot be used."""


def resolve_target(spec: str) -> Callable[..., Any]:
    """``pkg.module:attr.path`` or ``path/to/file.py:attr.path`` -> the callable."""
    where, sep, attr = spec.rpartition(":")
    if not sep or not where or not attr:
        raise UsageError(f"TARGET must look like module:callable or file.py:callable, got {spec!r}")
    if where.endswith(".py") or "/" in where:
        path = Path(where)
        if not path.is_file():
            raise UsageError(f"no such file: {path}")
        mod_spec = importlib.util.spec_from_file_location(path.stem, path)
        if mod_spec is None or mod_spec.loader is None:
            raise UsageError(f"cannot import {path}")
        module = importlib.util.module_from_spec(mod_spec)
        sys.modules[path.stem] = module
        sys.path.insert(0, str(path.resolve().parent))
        mod_spec.loader.exec_module(module)
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            raise UsageError(f"cannot import module {where!r}: {exc}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"{where!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{spec!r} is not callable")
    return obj


def _json(text: str | None, kind: type, what: str) -> Any:
    if text is None:
        return kind()
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{what} is not valid JSON: {exc}") from exc
    if not isinstance(value, kind):
        raise UsageError(f"{what} must be a JSON {kind.__name__}")
    return value


def call_arguments(args: argparse.Namespace) -> tuple[Callable[..., Any], list[Any], dict[str, Any]]:
    """The callable TARGET names and its arguments: ``--args``, ``--kwargs``, and the
    transformers config ``--hf-config`` builds, passed first (``trace`` and ``check``)."""
    fn = resolve_target(args.target)
    call_args = list(_json(args.args, list, "--args"))
    call_kwargs = _json(args.kwargs, dict, "--kwargs")
    if args.hf_config is not None:
        from transformers import AutoConfig

        cfg = dict(_json(args.hf_config, dict, "--hf-config"))
        model_type = cfg.pop("model_type", None)
        if model_type is None:
            raise UsageError('--hf-config needs a "model_type" (e.g. "llama")')
        call_args.insert(0, AutoConfig.for_model(model_type, **cfg))
    return fn, call_args, call_kwargs


def cmd_trace(args: argparse.Namespace) -> int:
    import torch

    import fxinit

    fn, call_args, call_kwargs = call_arguments(args)
    torch.manual_seed(args.seed)
    saved = torch.get_default_dtype()
    if args.dtype:
        torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        model = fxinit.trace_init(fn, *call_args, **call_kwargs)
    finally:
        torch.set_default_dtype(saved)
    if not isinstance(model, torch.nn.Module):
        raise UsageError(f"{args.target} returned {type(model).__name__}, not an nn.Module")
    graph = fxinit.init_graph(model)
    graph.save(args.output)
    print(f"{args.output}: {graph}")
    return EXIT_OK


def cmd_check(args: argparse.Namespace) -> int:
    import torch

    from fxinit.check import check

    fn, call_args, call_kwargs = call_arguments(args)

    def build(*a: Any, **kw: Any) -> Any:
        model = fn(*a, **kw)
        if not isinstance(model, torch.nn.Module):
            raise UsageError(f"{args.target} returned {type(model).__name__}, not an nn.Module")
        return model

    report = check(build, *call_args, seed=args.seed, **call_kwargs)
    report.target = args.target
    print(report)
    return EXIT_OK if report.ok else EXIT_FAILED


def cmd_show(args: argparse.Namespace) -> int:
    import fxinit
    from fxinit.report import select, show_table

    graph = fxinit.load_graph(args.graph)
    if args.explain:
        if args.explain not in graph.outputs:
            raise UsageError(f"{args.explain!r} is not a tensor of this graph (see `fxinit show {args.graph}`)")
        print(graph.explain(args.explain))
        return EXIT_OK
    names = select(graph, args.only)
    if not names:
        raise UsageError(f"--only {args.only!r} matches no tensor")
    if args.plan:
        import torch

        print(graph.plan(names, rng=args.rng, dtype=getattr(torch, args.dtype) if args.dtype else None,
                         compile=args.compile))
        return EXIT_OK
    print(show_table(graph, names))
    return EXIT_OK


def cmd_viz(args: argparse.Namespace) -> int:
    import fxinit
    from fxinit.report import select
    from fxinit.viz import draw

    graph = fxinit.load_graph(args.graph)
    names = select(graph, args.only) if args.only else None
    if names is not None and not names:
        raise UsageError(f"--only {args.only!r} matches no tensor")
    out = draw(graph, Path(args.output), names=names, collapse=not args.no_collapse)
    print(f"wrote {out}")
    return EXIT_OK


def cmd_materialize(args: argparse.Namespace) -> int:
    import fxinit
    from fxinit.report import select
    from fxinit.tensors_io import save_safetensors

    if args.format in ("hf", "dcp"):
        return _export(args)
    for option in ("max_shard_size", "part", "memory", "workers"):
        if getattr(args, option) is not None:
            raise UsageError(f"--{option.replace('_', '-')} is for --format hf or dcp")
    if args.resume:
        raise UsageError("--resume is for --format hf or dcp")
    graph = fxinit.load_graph(args.graph)
    names = select(graph, args.only)
    if not names:
        raise UsageError(f"--only {args.only!r} matches no tensor")
    import torch

    dtype = getattr(torch, args.dtype) if args.dtype else None
    values = _materialize_with_progress(graph, names, args.device, args.rng, args.seed, quiet=args.quiet, dtype=dtype,
                                        compile=args.compile)
    save_safetensors(values, graph, Path(args.output))
    print(f"wrote {len(values)} tensors to {args.output}")
    return EXIT_OK


def _export(args: argparse.Namespace) -> int:
    """``--format hf | dcp``: a checkpoint directory, written in bounded memory."""
    import torch

    import fxinit

    from fxinit.export.plan import parse_part, parse_size

    if args.device:
        raise UsageError("--device is for the single safetensors file; a checkpoint is written from the CPU")
    try:
        part = parse_part(args.part)
        max_shard_size = parse_size(args.max_shard_size or "5GB")
        memory = parse_size(args.memory or "1GiB")
    except ValueError as exc:
        raise UsageError(str(exc)) from exc
    if args.workers is not None and args.workers < 1:
        raise UsageError("--workers must be at least 1")
    done = fxinit.save(args.graph, args.output, format=args.format, rng=args.rng, seed=args.seed,
                       dtype=getattr(torch, args.dtype) if args.dtype else None, only=args.only, part=part,
                       max_shard_size=max_shard_size, resume=args.resume, memory=memory, workers=args.workers,
                       quiet=args.quiet, compile=args.compile)
    rate = done.bytes / done.seconds / 1e9 if done.seconds else 0.0
    line = f"wrote {_count(done.files, 'file')} ({done.bytes:,} bytes) to {args.output} in {done.seconds:.1f} s " \
           f"({rate:.2f} GB/s)"
    if done.skipped:
        line += f"; kept {_count(done.skipped, 'file')} complete and verified: {', '.join(done.skipped)}"
    print(line)
    if not done.finished:
        print("the checkpoint is not complete yet: the run that writes its last part writes the index")
    return EXIT_OK


def _count(items: Sequence[object], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _materialize_with_progress(graph: Any, names: list[str], device: str | None, rng: str, seed: int | None,
                               quiet: bool, dtype: Any = None, compile: bool | None = None) -> dict[str, Any]:
    """Materialize in batches of about 256 MiB so a long run shows progress; each tie
    group is computed once."""
    tied_to = {n: g[0] for g in graph.ties for n in g}
    first: dict[str, str] = {}
    for n in names:
        first.setdefault(tied_to.get(n, n), n)
    batches: list[list[str]] = [[]]
    size = 0
    for n in first.values():
        if size > 256 << 20:
            batches.append([])
            size = 0
        batches[-1].append(n)
        size += graph.spec(n).nbytes
    total = sum(graph.spec(n).nbytes for n in first.values())
    bar = None
    if not quiet and len(batches) > 1:
        try:
            from tqdm import tqdm

            bar = tqdm(total=total, unit="B", unit_scale=True, desc="materialize", file=sys.stderr)
        except ImportError:
            bar = None
    values: dict[str, Any] = {}
    for batch in batches:
        values.update(graph.materialize(batch, device=device, rng=rng, seed=seed, dtype=dtype, compile=compile))
        if bar is not None:
            bar.update(sum(graph.spec(n).nbytes for n in batch))
    if bar is not None:
        bar.close()
    return {n: values[first[tied_to.get(n, n)]] for n in names}


def _add_call_arguments(p: argparse.ArgumentParser, seed_help: str) -> None:
    """TARGET and its arguments (``call_arguments`` reads them), and ``--seed``."""
    p.add_argument("target", metavar="TARGET", help="module:callable or path/to/file.py:callable returning an nn.Module")
    p.add_argument("--args", help="JSON list of positional arguments")
    p.add_argument("--kwargs", help="JSON object of keyword arguments")
    p.add_argument("--hf-config", help='JSON of a transformers config, passed first: {"model_type": "llama", ...}')
    p.add_argument("--seed", type=int, default=0, help=seed_help)


def build_parser() -> argparse.ArgumentParser:
    summary, examples = __doc__.split("\n\n")[:2]
    parser = argparse.ArgumentParser(prog="fxinit", description=summary,
                                     epilog=f"examples:\n{examples}\n\nRun `fxinit COMMAND --help` for the options "
                                            "of a command.", formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("trace", help="trace a model constructor to an init-graph file",
                       description="Call TARGET under fxinit.trace_init (nothing is allocated) and save its init graph.")
    _add_call_arguments(p, seed_help="torch.manual_seed before tracing (default %(default)s)")
    p.add_argument("-o", "--output", required=True,
                   help="the init-graph file to write, e.g. init.pt (a torch.save archive)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                   help="torch's default dtype while tracing")
    p.set_defaults(run=cmd_trace)

    p = sub.add_parser("check", help="check that fxinit builds a model bit for bit as eager construction does",
                       description="Build TARGET eagerly and with fxinit (trace_init + materialize) from the same "
                                   "seed and compare every tensor and the global RNG afterwards, bit for bit "
                                   "(fxinit.check). Exit code 0: equal; 1: different or refused. Both models are "
                                   "built whole: check a small config.")
    _add_call_arguments(p, seed_help="torch.manual_seed before each build (default %(default)s)")
    p.set_defaults(run=cmd_check)

    p = sub.add_parser("show", help="print the tensors of an init-graph file and how each is initialized")
    p.add_argument("graph", metavar="GRAPH", help="an init-graph file (init.pt) written by `fxinit trace`")
    p.add_argument("--only", metavar="PATTERN", help="glob over tensor names, or a module prefix")
    p.add_argument("--explain", metavar="NAME", help="explain one tensor op by op")
    p.add_argument("--plan", action="store_true",
                   help="print the plan of materializing the tensors: what runs and what every pass decided")
    p.add_argument("--rng", default="exact", choices=["exact", "portable"], help="--plan: the random mode")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], help="--plan: the output dtype")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="--plan: portable fills as compiled kernels (default: where that is fastest)")
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("viz", help="draw the init dependencies with graphviz")
    p.add_argument("graph", metavar="GRAPH", help="an init-graph file (init.pt) written by `fxinit trace`")
    p.add_argument("-o", "--output", required=True, help="the drawing: .svg, .png, .pdf or .dot")
    p.add_argument("--only", metavar="PATTERN", help="draw only the ancestry of the matching tensors")
    p.add_argument("--no-collapse", action="store_true", help="draw every repeated layer instead of one with a count")
    p.set_defaults(run=cmd_viz)

    p = sub.add_parser("materialize", help="compute the tensors and write them to a safetensors file or a checkpoint",
                       description="Compute the tensors of GRAPH and write them: to one safetensors file (held in "
                                   "memory), or, with --format hf or dcp, to a checkpoint directory written in "
                                   "bounded memory whatever the model's size.")
    p.add_argument("graph", metavar="GRAPH", help="an init-graph file (init.pt) written by `fxinit trace`")
    p.add_argument("-o", "--output", required=True, help="the .safetensors file, or the checkpoint directory, to write")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "hf", "dcp"],
                   help="safetensors: one file, every tensor in memory first; hf: save_pretrained's directory "
                        "(shards, index, config.json); dcp: a torch.distributed.checkpoint directory "
                        "(default %(default)s)")
    p.add_argument("--only", metavar="PATTERN", help="glob over tensor names, or a module prefix")
    p.add_argument("--device", help="compute where eager would, then move here (default: the recorded device)")
    p.add_argument("--rng", default="exact", choices=["exact", "portable"],
                   help="exact: eager's values; portable: the counter-based stream (default %(default)s)")
    p.add_argument("--seed", type=int, help="portable mode's seed (default: the seed the trace saw)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="portable mode: run the fills as kernels torch.compile generates for the device (the same "
                        "values); default: where that is fastest (CUDA; the CPU keeps fxinit's C kernel)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                   help="cast floating-point (and complex) tensors to this dtype as Module.to does, without the "
                        "full-precision model in memory")
    p.add_argument("--max-shard-size", metavar="SIZE", help="hf, dcp: the largest file (default 5GB; a larger "
                                                                "tensor gets a file of its own)")
    p.add_argument("--resume", action="store_true", help="hf, dcp: keep the files an interrupted run completed "
                                                         "(verified by size and checksum), write the others")
    p.add_argument("--part", metavar="K/N", help="hf, dcp: write the K-th of N parts of the checkpoint (consecutive "
                                                 "files of about equal size); N runs into one directory make it whole")
    p.add_argument("--memory", metavar="SIZE", help="hf, dcp: bytes of tensors held at once (default 1GiB); "
                                                    "larger tensors are computed and written in pieces")
    p.add_argument("--workers", type=int, help="hf, dcp: threads computing tensors (default: torch's thread count)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_materialize)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from fxinit.errors import DeferredInitError

    try:
        return args.run(args)
    except UsageError as exc:
        print(f"fxinit {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DeferredInitError as exc:
        what, *rest = str(exc).splitlines()
        hint = next((r.strip().removeprefix("hint:").strip() for r in rest if r.strip().startswith("hint:")), None)
        print(f"fxinit {args.command}: error: {what}", file=sys.stderr)
        if hint:
            print(f"  hint: {hint}", file=sys.stderr)
        return EXIT_FAILED
    except (OSError, ImportError) as exc:
        print(f"fxinit {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
