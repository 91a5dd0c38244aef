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

exit codes:
  0    success
  1    fxinit refused or failed (the message says why and what to do), or `check` found a difference
  2    bad command line
  130  interrupted (Ctrl-C); `materialize --format hf|dcp` says the command that resumes
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import shlex
import sys
from pathlib import Path
from typing import Any, Callable, Sequence

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class UsageError(Exception):
    """A command line that names something that does not exist or cannot be used."""


def resolve_target(spec: str, app_dir: str | None = ".") -> Callable[..., Any]:
    """``pkg.module:attr.path`` or ``path/to/file.py:attr.path`` -> the callable.

    A module name is looked up in ``app_dir`` first (the working directory by default), as
    ``python -m`` and CLIs that take ``module:attr`` (uvicorn's ``--app-dir``) do: a console
    script does not put the working directory on ``sys.path`` by itself."""
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
        searched = str(Path(app_dir).resolve()) if app_dir else None
        if searched is not None and searched not in sys.path:
            sys.path.insert(0, searched)
        try:
            module = importlib.import_module(where)
        except ImportError as exc:
            place = f" (looked in {searched} and on sys.path)" if searched else " (looked on sys.path)"
            raise UsageError(f"cannot import module {where!r}{place}: {exc}; pass --app-dir DIR for a module "
                             f"that lives elsewhere") from exc
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
    fn = resolve_target(args.target, args.app_dir)
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
    """Every format goes through ``fxinit.save``: bounded memory, whatever the model's size."""
    import torch

    import fxinit
    from fxinit.export.plan import parse_part, parse_size

    if args.format == "safetensors":
        for option in ("max_shard_size", "part"):
            if getattr(args, option) is not None:
                raise UsageError(f"--{option.replace('_', '-')} is for --format hf or dcp")
        if args.resume:
            raise UsageError("--resume is for --format hf or dcp")
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
                       quiet=args.quiet, compile=args.compile, device=args.device)
    rate = done.bytes / done.seconds / 1e9 if done.seconds else 0.0
    what = f"{_count(done.files, 'file')} ({done.bytes:,} bytes)" if args.format != "safetensors" else \
        f"{done.bytes:,} bytes"
    line = f"wrote {what} to {args.output} in {done.seconds:.1f} s ({rate:.2f} GB/s)"
    if done.skipped:
        names = done.skipped if len(done.skipped) <= 3 else [*done.skipped[:2], "...", done.skipped[-1]]
        line += f"; kept {_count(done.skipped, 'file')} complete and verified: {', '.join(names)}"
    print(line)
    if not done.finished:
        print("the checkpoint is not complete yet: the run that writes its last part writes the index")
    return EXIT_OK


def _count(items: Sequence[object], noun: str) -> str:
    return f"{len(items)} {noun}{'' if len(items) == 1 else 's'}"


def _add_call_arguments(p: argparse.ArgumentParser, seed_help: str) -> None:
    """TARGET and its arguments (``call_arguments`` reads them), and ``--seed``."""
    p.add_argument("target", metavar="TARGET", help="module:callable or path/to/file.py:callable returning an nn.Module")
    p.add_argument("--args", help="JSON list of positional arguments")
    p.add_argument("--kwargs", help="JSON object of keyword arguments")
    p.add_argument("--hf-config", help='JSON of a transformers config, passed first: {"model_type": "llama", ...}')
    p.add_argument("--seed", type=int, default=0, help=seed_help)
    p.add_argument("--app-dir", default=".", metavar="DIR",
                   help="directory searched first for TARGET's module (default: the working directory)")


def build_parser() -> argparse.ArgumentParser:
    summary, examples, exit_codes = __doc__.split("\n\n")[:3]
    parser = argparse.ArgumentParser(prog="fxinit", description=summary,
                                     epilog=f"examples:\n{examples}\n\n{exit_codes}\n\nRun `fxinit COMMAND --help` for "
                                            "the options of a command.",
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
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

    p = sub.add_parser("show", help="print the tensors of an init-graph file and how each is initialized",
                       description="Print a table of the tensors of GRAPH (name, shape, dtype, device, how each is "
                                   "initialized); --explain NAME prints the ops of one tensor with their source lines; "
                                   "--plan prints what materializing would run and what every pass decided.")
    p.add_argument("graph", metavar="GRAPH", help="an init-graph file (init.pt) written by `fxinit trace`")
    p.add_argument("--only", metavar="PATTERN", help="glob over tensor names, or a module prefix")
    p.add_argument("--explain", metavar="NAME", help="explain one tensor op by op")
    p.add_argument("--plan", action="store_true",
                   help="print the plan of materializing the tensors: what runs and what every pass decided")
    p.add_argument("--rng", default="exact", choices=["exact", "portable"], help="--plan: the random mode")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], help="--plan: the output dtype")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="--plan: portable fills as kernels torch.compile generates (default: the fastest)")
    p.set_defaults(run=cmd_show)

    p = sub.add_parser("viz", help="draw the init dependencies with graphviz",
                       description="Draw the init graph of GRAPH with graphviz: tensors, the ops that initialize "
                                   "them and what they read (ties, copies, shared generators); repeated layers are "
                                   "drawn once with a count unless --no-collapse. The legend lists what is drawn.")
    p.add_argument("graph", metavar="GRAPH", help="an init-graph file (init.pt) written by `fxinit trace`")
    p.add_argument("-o", "--output", required=True, help="the drawing: .svg, .png, .pdf or .dot")
    p.add_argument("--only", metavar="PATTERN", help="draw only the ancestry of the matching tensors")
    p.add_argument("--no-collapse", action="store_true", help="draw every repeated layer instead of one with a count")
    p.set_defaults(run=cmd_viz)

    p = sub.add_parser("materialize", help="compute the tensors and write them to a safetensors file or a checkpoint",
                       description="Compute the tensors of GRAPH and write them, in bounded memory whatever the "
                                   "model's size: to one safetensors file (its header first, then each tensor as it "
                                   "is computed), or, with --format hf or dcp, to a checkpoint directory.")
    p.add_argument("graph", metavar="GRAPH", help="an init-graph file (init.pt) written by `fxinit trace`")
    p.add_argument("-o", "--output", required=True, help="the .safetensors file, or the checkpoint directory, to write")
    p.add_argument("--format", default="safetensors", choices=["safetensors", "hf", "dcp"],
                   help="safetensors: one file; hf: save_pretrained's directory "
                        "(shards, index, config.json); dcp: a torch.distributed.checkpoint directory "
                        "(default %(default)s)")
    p.add_argument("--only", metavar="PATTERN", help="glob over tensor names, or a module prefix")
    p.add_argument("--device", help="compute the values on this device (default: where each was meant to be)")
    p.add_argument("--rng", default="exact", choices=["exact", "portable"],
                   help="exact: eager's values; portable: the counter-based stream (default %(default)s)")
    p.add_argument("--seed", type=int, help="portable mode's seed (default: the seed the trace saw)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="portable mode: run the fills as kernels torch.compile generates for the device (the same "
                        "values); default: the fastest (fxinit's Triton kernel on CUDA, its C kernel on the CPU)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"],
                   help="cast floating-point (and complex) tensors to this dtype as Module.to does, without the "
                        "full-precision model in memory")
    p.add_argument("--max-shard-size", metavar="SIZE", help="hf, dcp: the largest file (default 5GB; a larger "
                                                                "tensor gets a file of its own)")
    p.add_argument("--resume", action="store_true", help="hf, dcp: keep the files an interrupted run completed "
                                                         "(verified by size and checksum), write the others")
    p.add_argument("--part", metavar="K/N", help="hf, dcp: write the K-th of N parts of the checkpoint (consecutive "
                                                 "files of about equal size); N runs into one directory make it whole")
    p.add_argument("--memory", metavar="SIZE", help="bytes of tensors held at once (default 1GiB); "
                                                    "larger tensors are computed and written in pieces")
    p.add_argument("--workers", type=int, help="threads computing tensors (default: torch's thread count)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(run=cmd_materialize)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    from fxinit.errors import DeferredInitError

    try:
        return args.run(args)
    except UsageError as exc:
        print(f"fxinit {args.command}: error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except DeferredInitError as exc:
        print(f"fxinit {args.command}: error: {str(exc).splitlines()[0]}", file=sys.stderr)
        if exc.source:
            print(f"  source: {exc.source}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return EXIT_FAILED
    except (OSError, ImportError) as exc:
        print(f"fxinit {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        print(f"\nfxinit {args.command}: interrupted", file=sys.stderr)
        if args.command == "materialize" and args.format in ("hf", "dcp"):
            again = argv if "--resume" in argv else [*argv, "--resume"]
            print(f"  the files completed so far are kept; resume with: {shlex.join(['fxinit', *again])}",
                  file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
