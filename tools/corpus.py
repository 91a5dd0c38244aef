"""The fidelity corpus: every transformers architecture, bit for bit against eager.

    python tools/corpus.py                       # all listed models, seed 0, float32
    python tools/corpus.py --seeds 0,1 --dtypes float32,bfloat16,float64 --jobs 2
    python tools/corpus.py --models llama,vit --json out.json
    python tools/corpus.py --refresh-list        # rebuild tools/corpus_models.json
    python tools/corpus.py --device cuda --jobs 1 # eager and trace under `with torch.device("cuda")`
    python tools/corpus.py --from-pretrained     # AutoModel.from_pretrained of a partial checkpoint
    python tools/corpus.py --rng portable --compile  # compiled portable fills against the C kernel
    FXINIT_NVRTC_ON_CPU=1 python tools/corpus.py --rng portable --compile nvrtc  # fxinit's CUDA kernel, as C
    python tools/corpus.py --grad-mode inference_mode  # eager and trace under `with torch.inference_mode()`

For each architecture (``AutoModel.from_config`` on a tiny config), seed and default
dtype it builds the eager reference, then with fxinit: trace + materialize whole, and
trace + materialize leaf module by leaf module in reverse order. Every parameter and
buffer (persistent or not) must match bitwise, with the same dtype, shape, device,
requires_grad, Parameter type, tying, storage sharing and views; trace_init must leave the
global RNG where eager construction leaves it, and materialize must not change it.
With ``--device D`` both eager construction and the trace run under ``with torch.device(D)``
(a GPU when D is cuda: values stay on it, and D's generator is checked as well). With
``--grad-mode M`` both run under ``torch.inference_mode()`` or ``torch.no_grad()`` (parameters
made under inference mode are inference tensors, on which torch's C++ takes other branches).
Tensors that no op writes (``InitGraph.uninitialized``: allocated and left as they are, as
``from_pretrained`` leaves missing tensors that ``_init_weights`` does not cover) hold
whatever memory held, in eager too: their values are not compared.
Prints one line per check and the figure N/M bitwise-equal per (seed, dtype, order).
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing as mp
import os
import sys
import time
import traceback
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # save_pretrained / from_pretrained, per model
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

LIST_PATH = Path(__file__).with_name("corpus_models.json")
MAX_PARAMS = 20_000_000
DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float64": "float64"}


# ----------------------------------------------------------------------------- comparing
def _tensors(model: Any) -> dict[str, Any]:
    out = dict(model.named_parameters(remove_duplicate=False))
    out.update(dict(model.named_buffers(remove_duplicate=False)))
    return out


def _bits(t: Any) -> Any:
    import torch

    t = t.detach().reshape(-1).contiguous()
    return t.view(torch.uint8) if t.numel() else t


def compare(ref: Any, got: Any) -> list[str]:
    """Names (with the reason) of every tensor of ``got`` that differs from ``ref``."""
    import torch

    r, g = _tensors(ref), _tensors(got)
    problems = [f"{k}: missing" for k in r if k not in g] + [f"{k}: unexpected" for k in g if k not in r]
    for k in r:
        if k not in g:
            continue
        a, b = r[k], g[k]
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            problems.append(f"{k}: {a.dtype}{tuple(a.shape)}@{a.device} vs {b.dtype}{tuple(b.shape)}@{b.device}")
        elif a.requires_grad != b.requires_grad:
            problems.append(f"{k}: requires_grad")
        elif type(a) is not type(b):
            problems.append(f"{k}: type {type(a).__name__} vs {type(b).__name__}")
        elif not torch.equal(_bits(a), _bits(b)):
            problems.append(f"{k}: values")
        elif getattr(a, "_is_hf_initialized", None) != getattr(b, "_is_hf_initialized", None):
            problems.append(f"{k}: _is_hf_initialized")
    for what, key in (("tying", id), ("storage sharing", lambda t: t.untyped_storage().data_ptr())):
        def groups(d: dict[str, Any]) -> set[frozenset[str]]:
            gs: dict[Any, set[str]] = defaultdict(set)
            for name, t in d.items():
                if t.numel():
                    gs[key(t)].add(name)
            return {frozenset(v) for v in gs.values() if len(v) > 1}
        if groups(r) != groups(g):
            problems.append(f"{what} differs: {sorted(map(sorted, groups(r) ^ groups(g)))[:2]}")
    if not problems and _views(r) != _views(g):
        problems.append(f"views differ (each view's base, '?' none of them): {_views(g)} vs eager {_views(r)}")
    return problems


def _views(named: dict[str, Any]) -> dict[str, str]:
    """Each view of memory its base has, with the name of its ``_base`` among ``named`` (or ``?``)."""
    by_id = {id(t): name for name, t in named.items()}
    return {name: by_id.get(id(t._base), "?") for name, t in named.items()
            if t._is_view() and t._base.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()}


# ----------------------------------------------------------------------------- one check
def build_config(model_type: str, variant: str) -> Any:
    from tiny_configs import candidate_configs

    for label, cfg in candidate_configs(model_type):
        if label == variant:
            return cfg
    raise KeyError(variant)


def _in_default_dtype(check: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Run ``check(model_type, seed, dtype, ...)`` with ``dtype`` as torch's default dtype."""
    @functools.wraps(check)
    def run(model_type: str, seed: int = 0, dtype: str = "float32", *args: Any, **kwargs: Any) -> dict[str, Any]:
        import torch

        saved = torch.get_default_dtype()
        torch.set_default_dtype(getattr(torch, dtype))
        try:
            return check(model_type, seed, dtype, *args, **kwargs)
        finally:
            torch.set_default_dtype(saved)

    return run


def _materialize(m: Any, order: str, **options: Any) -> None:
    """Materialize ``m`` whole, or leaf module by leaf module from the last one, then the rest."""
    import fxinit

    if order == "reverse":
        for mod in reversed(list(m.modules())):
            if any(True for _ in mod.parameters(recurse=False)) or any(True for _ in mod.buffers(recurse=False)):
                fxinit.materialize(mod, **options)
    fxinit.materialize(m, **options)


def _uninitialized(m: Any) -> set[str]:
    """Names of ``m``'s deferred tensors that no op writes (``InitGraph.uninitialized``)."""
    import fxinit

    try:
        graph = fxinit.init_graph(m)
    except ValueError:  # nothing deferred
        return set()
    return set(graph.uninitialized())


def _rng_states(device: str | None) -> list[Any]:
    """The global CPU generator's state, and ``device``'s when it has its own."""
    import torch

    states = [torch.get_rng_state()]
    if device is not None and torch.device(device).type == "cuda":
        states.append(torch.cuda.get_rng_state(torch.device(device)))
    return states


def _rng_equal(a: list[Any], b: list[Any]) -> bool:
    import torch

    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def _partial_checkpoint(cfg: Any, seed: int, directory: str) -> None:
    """``save_pretrained`` of a donor model into ``directory``, without every third tensor:
    ``from_pretrained`` then loads two thirds and initializes the rest."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModel

    torch.manual_seed(seed + 1000)
    AutoModel.from_config(cfg).save_pretrained(directory)
    path = os.path.join(directory, "model.safetensors")
    tensors = load_file(path)
    save_file({k: v for i, (k, v) in enumerate(sorted(tensors.items())) if i % 3 != 1}, path,
              metadata={"format": "pt"})


@_in_default_dtype
def check_model(model_type: str, seed: int = 0, dtype: str = "float32", variant: str = "tiny",
                orders: tuple[str, ...] = ("whole", "reverse"), cast: str | None = None,
                device: str | None = None, pretrained: bool = False, grad_mode: str | None = None) -> dict[str, Any]:
    """Check one architecture; returns {order: "ok" | "mismatch: ..." | "cannot defer: ..." | "crash: ..."}.

    ``cast``: materialize with ``dtype=cast`` and compare with eager construction followed
    by ``Module.to(cast)``. ``device``: eager construction and trace both run under
    ``with torch.device(device)``, and ``grad_mode`` (``torch.inference_mode`` or
    ``torch.no_grad``) too. ``pretrained``: build with ``AutoModel.from_pretrained``
    of a checkpoint that lacks every third tensor (``_partial_checkpoint``) instead of
    ``from_config``."""
    import contextlib
    import tempfile

    import torch
    from transformers import AutoModel

    import fxinit

    cfg = build_config(model_type, variant)
    result: dict[str, Any] = {"model": model_type, "seed": seed, "dtype": dtype}
    def on_device() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        if device is not None:
            stack.enter_context(torch.device(device))
        if grad_mode is not None:
            stack.enter_context(getattr(torch, grad_mode)())
        return stack

    checkpoint = tempfile.TemporaryDirectory() if pretrained else contextlib.nullcontext()
    try:
        if pretrained:
            _partial_checkpoint(cfg, seed, checkpoint.name)
            build: Callable[[], Any] = functools.partial(AutoModel.from_pretrained, checkpoint.name)
        else:
            build = functools.partial(AutoModel.from_config, cfg)
        torch.manual_seed(seed)
        t0 = time.perf_counter()
        with on_device():
            ref = build()
        result["eager_s"] = time.perf_counter() - t0
        rng_after_eager = _rng_states(device)
        to = {} if cast is None else {"dtype": getattr(torch, cast)}
        if cast is not None:
            ref = ref.to(getattr(torch, cast))
        for order in orders:
            try:
                torch.manual_seed(seed)
                t0 = time.perf_counter()
                with on_device():
                    m = fxinit.trace_init(build)
                result[f"trace_s_{order}"] = time.perf_counter() - t0
                problems = []
                if not _rng_equal(_rng_states(device), rng_after_eager):
                    problems.append("global RNG after trace_init differs from eager")
                uninitialized = _uninitialized(m)
                torch.manual_seed(seed + 12345)  # materialize must not depend on the global state
                before = _rng_states(device)
                t0 = time.perf_counter()
                _materialize(m, order, **to)
                result[f"materialize_s_{order}"] = time.perf_counter() - t0
                if not _rng_equal(before, _rng_states(device)):
                    problems.append("materialize changed the global RNG")
                if fxinit.is_deferred(m):
                    problems.append("still deferred after materialize")
                # Values of tensors that no op writes are whatever memory held, in eager too.
                problems += [p for p in compare(ref, m)
                             if not (p.endswith(": values") and p[: -len(": values")] in uninitialized)]
                result["uninitialized"] = sorted(uninitialized)
                result[order] = "ok" if not problems else "mismatch: " + "; ".join(problems[:4]) + (
                    f" (+{len(problems) - 4} more)" if len(problems) > 4 else "")
            except fxinit.DeferredInitError as exc:
                result[order] = "cannot defer: " + " | ".join(str(exc).splitlines()[:3])
            except Exception as exc:  # noqa: BLE001
                tb = traceback.extract_tb(exc.__traceback__)
                where = next((f"{Path(f.filename).name}:{f.lineno}" for f in reversed(tb) if "fxinit" in f.filename), "")
                result[order] = f"crash: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''} {where}"
    except Exception as exc:  # noqa: BLE001
        for order in orders:
            result[order] = f"eager failed: {type(exc).__name__}: {str(exc)[:200]}"
    finally:
        if pretrained:
            checkpoint.cleanup()
    return result


@_in_default_dtype
def check_model_portable(model_type: str, seed: int = 0, dtype: str = "float32", variant: str = "tiny",
                         orders: tuple[str, ...] = ("whole", "reverse"), compile: bool | str = False) -> dict[str, Any]:
    """Portable mode: materializing the module (whole, or leaf by leaf in reverse) gives the
    values its init graph gives for all tensors at once; "unsupported: ..." when a
    random op has no portable sampler. ``compile``: the module is materialized with
    compiled kernels (``compile=True``, or fxinit's own ``"nvrtc"``/``"triton"``), the
    reference without (fxinit's C kernel)."""
    import torch
    from transformers import AutoModel

    import fxinit

    cfg = build_config(model_type, variant)
    result: dict[str, Any] = {"model": model_type, "seed": seed, "dtype": dtype}
    try:
        torch.manual_seed(seed)
        graph = fxinit.init_graph(fxinit.trace_init(AutoModel.from_config, cfg))
        ref = graph.materialize(rng="portable")
        for order in orders:
            try:
                torch.manual_seed(seed)
                m = fxinit.trace_init(AutoModel.from_config, cfg)
                _materialize(m, order, rng="portable", compile=compile)
                got = _tensors(m)
                problems = [f"{k}: missing" for k in ref if k not in got]
                problems += [f"{k}: values" for k in ref if k in got and not torch.equal(_bits(ref[k]), _bits(got[k]))]
                result[order] = "ok" if not problems else "mismatch: " + "; ".join(problems[:4])
            except fxinit.DeferredInitError as exc:
                msg = " | ".join(str(exc).splitlines()[:2])
                result[order] = ("unsupported: " if "no portable implementation" in msg else "cannot defer: ") + msg
    except fxinit.DeferredInitError as exc:
        for order in orders:
            msg = " | ".join(str(exc).splitlines()[:2])
            result[order] = ("unsupported: " if "no portable implementation" in msg else "cannot defer: ") + msg
    except Exception as exc:  # noqa: BLE001
        for order in orders:
            result[order] = f"crash: {type(exc).__name__}: {str(exc)[:200]}"
    return result


def check_model_settings(model_type: str, settings: list[tuple[int, str]], variant: str,
                         orders: tuple[str, ...], rng: str = "exact", cast: str | None = None,
                         device: str | None = None, pretrained: bool = False,
                         compile: bool | str = False, grad_mode: str | None = None) -> list[dict[str, Any]]:
    """``check_model`` (or ``check_model_portable``) for several (seed, dtype) settings in
    one process (one import of the model)."""
    if rng == "exact":
        return [check_model(model_type, seed, dtype, variant, orders, cast, device, pretrained, grad_mode)
                for seed, dtype in settings]
    return [check_model_portable(model_type, seed, dtype, variant, orders, compile) for seed, dtype in settings]


# ----------------------------------------------------------------------------- the list
def probe(model_type: str) -> dict[str, Any]:
    """Find the first config variant of ``model_type`` that builds with < MAX_PARAMS parameters."""
    import torch
    from transformers import AutoModel

    tried = []
    try:
        from tiny_configs import candidate_configs

        for label, cfg in candidate_configs(model_type):
            try:
                with torch.device("meta"):
                    n = sum(p.numel() for p in AutoModel.from_config(cfg).parameters())
            except Exception as exc:  # noqa: BLE001
                if label == "default":
                    tried.append(f"{label}: meta build failed: {type(exc).__name__}: {str(exc)[:120]}")
                    continue
                n = None
            if n is not None and n >= MAX_PARAMS:
                tried.append(f"{label}: {n / 1e6:.1f}M parameters")
                continue
            try:
                torch.manual_seed(0)
                t0 = time.perf_counter()
                model = AutoModel.from_config(cfg)
                secs = time.perf_counter() - t0
            except Exception as exc:  # noqa: BLE001
                tried.append(f"{label}: {type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
                continue
            n = sum(p.numel() for p in model.parameters())
            if n >= MAX_PARAMS:
                tried.append(f"{label}: {n / 1e6:.1f}M parameters")
                continue
            return {"model": model_type, "variant": label, "params": n, "eager_s": round(secs, 3)}
    except Exception as exc:  # noqa: BLE001
        tried.append(f"config: {type(exc).__name__}: {str(exc)[:160]}")
    return {"model": model_type, "variant": None, "why": tried}


def all_model_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    return [t for t in CONFIG_MAPPING_NAMES if t in MODEL_MAPPING_NAMES]


# ----------------------------------------------------------------------------- running in workers
def _worker(fn_name: str, args: tuple, queue: Any) -> None:
    import torch

    torch.set_num_threads(1)
    try:
        queue.put(globals()[fn_name](*args))
    except BaseException as exc:  # noqa: BLE001
        queue.put({"error": f"{type(exc).__name__}: {exc}"})


#: transformers' modules every model's code imports (``PreTrainedModel``, generation, masks):
#: 2-3 s on this machine, once here instead of once in each forked worker, where it was half of
#: the corpus's time. Each worker still imports its own model's module.
SHARED_MODULES = ("transformers.modeling_utils", "transformers.generation.utils", "transformers.masking_utils",
                  "transformers.modeling_layers", "transformers.processing_utils")


def _import_shared() -> None:
    """Import what every forked worker needs, once, in the parent."""
    import importlib

    import torch  # noqa: F401
    from transformers import AutoModel  # noqa: F401

    import fxinit  # noqa: F401
    for name in SHARED_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:  # another transformers' layout: the worker imports what it needs
            pass


def run_parallel(fn_name: str, jobs: list[tuple], n_workers: int, timeout: float,
                 on_result: Any) -> None:
    """Run ``fn(*args)`` for each args in a fresh forked process, ``n_workers`` at a time."""
    ctx = mp.get_context("fork")
    pending = list(enumerate(jobs))
    running: dict[int, tuple[Any, Any, float, tuple]] = {}
    while pending or running:
        while pending and len(running) < n_workers:
            i, args = pending.pop(0)
            q = ctx.Queue()
            p = ctx.Process(target=_worker, args=(fn_name, args, q), daemon=True)
            p.start()
            running[i] = (p, q, time.monotonic(), args)
        time.sleep(0.02)
        for i, (p, q, started, args) in list(running.items()):
            res = None
            try:
                res = q.get_nowait()
            except Exception:  # noqa: BLE001
                if p.is_alive() and time.monotonic() - started < timeout:
                    continue
                if p.is_alive():
                    p.kill()
                    res = {"error": f"timeout after {timeout:.0f}s"}
                else:
                    try:
                        res = q.get(timeout=1)
                    except Exception:  # noqa: BLE001
                        res = {"error": f"worker died (exit code {p.exitcode})"}
            p.join(timeout=5)
            del running[i]
            on_result(args, res)


def refresh_list(jobs: int, only_failed: bool = False) -> list[dict[str, Any]]:
    types = all_model_types()
    found: list[dict[str, Any]] = []
    if only_failed and LIST_PATH.exists():
        found = [r for r in json.loads(LIST_PATH.read_text()) if r.get("variant")]
        kept = {r["model"] for r in found}
        types = [t for t in types if t not in kept]
    kept_count = len(found)

    def done(args: tuple, res: dict[str, Any]) -> None:
        if "error" in res:
            res = {"model": args[0], "variant": None, "why": [res["error"]]}
        found.append(res)
        status = f"{res['variant']} {res['params'] / 1e6:.2f}M" if res.get("variant") else f"-- {res['why'][-1:]}"
        print(f"[{len(found) - kept_count}/{len(types)}] {res['model']}: {status}", flush=True)

    run_parallel("probe", [(t,) for t in types], jobs, 300, done)
    found.sort(key=lambda r: r["model"])
    LIST_PATH.write_text(json.dumps(found, indent=1) + "\n")
    return found


def _settings(seeds: str, dtypes: str, pair: bool) -> list[tuple[int, str]]:
    ss = [int(x) for x in seeds.split(",")]
    ds = dtypes.split(",")
    if pair:
        if len(ss) != len(ds):
            raise SystemExit("--pair needs as many seeds as dtypes")
        return list(zip(ss, ds))
    return [(s, d) for s in ss for d in ds]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", help="comma-separated model types (default: every buildable one)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--dtypes", default="float32")
    ap.add_argument("--pair", action="store_true",
                    help="pair seeds with dtypes (0,float32 1,bfloat16 ...) instead of taking every combination")
    ap.add_argument("--orders", default="whole,reverse")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--limit", type=int, default=0, help="only the first K models")
    ap.add_argument("--every", type=int, default=1, help="only every K-th model (a spread-out sample)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="write per-check results here")
    ap.add_argument("--rng", choices=["exact", "portable"], default="exact",
                    help="portable: check order independence of the portable stream instead of eager equality")
    ap.add_argument("--compile", nargs="?", const=True, default=False, choices=[True, "nvrtc", "triton"],
                    help="with --rng portable: materialize with compile=True (kernels torch.compile generates), or "
                         "with fxinit's own kernel ('nvrtc': the CUDA kernel, compiled as C with "
                         "FXINIT_NVRTC_ON_CPU=1 on the CPU; 'triton': under TRITON_INTERPRET=1), against the C "
                         "kernel's values")
    ap.add_argument("--cast", choices=["bfloat16", "float16", "float32", "float64"],
                    help="materialize with dtype=CAST and compare with eager followed by Module.to(CAST)")
    ap.add_argument("--device", help="build eager and trace under `with torch.device(DEVICE)` (cuda: on the GPU)")
    ap.add_argument("--grad-mode", choices=["inference_mode", "no_grad"],
                    help="build eager and trace under `with torch.inference_mode()` or `torch.no_grad()`")
    ap.add_argument("--from-pretrained", action="store_true",
                    help="build with AutoModel.from_pretrained of a saved checkpoint lacking every third tensor: "
                         "what it initializes is deferred, and must equal eager from_pretrained")
    ap.add_argument("--refresh-list", action="store_true", help="re-probe which architectures build")
    ap.add_argument("--reprobe-failed", action="store_true", help="re-probe only those that did not build")
    args = ap.parse_args(argv)

    t_start = time.time()
    _import_shared()
    if args.refresh_list or args.reprobe_failed or not LIST_PATH.exists():
        listing = refresh_list(args.jobs, only_failed=args.reprobe_failed)
    else:
        listing = json.loads(LIST_PATH.read_text())
    buildable = {r["model"]: r for r in listing if r.get("variant")}
    names = args.models.split(",") if args.models else sorted(buildable)
    names = names[:: args.every]
    if args.limit:
        names = names[: args.limit]
    missing = [n for n in names if n not in buildable]
    if missing:
        print(f"not in the buildable list (see {LIST_PATH.name}): {missing}")
        names = [n for n in names if n in buildable]
    installed = set(all_model_types())
    absent = [n for n in names if n not in installed]
    if absent:  # the list was probed with a newer transformers than this machine's (a GPU machine's, say)
        import transformers

        print(f"{len(absent)} listed architectures are not in transformers {transformers.__version__} here, "
              f"skipped: {absent}")
        names = [n for n in names if n in installed]
    orders = tuple(args.orders.split(","))
    settings = _settings(args.seeds, args.dtypes, args.pair)
    if args.cast and args.rng != "exact":
        raise SystemExit("--cast checks exact mode against eager + Module.to")
    if args.device and args.rng != "exact":
        raise SystemExit("--device checks exact mode; tools/gpu_check.py compares portable values across devices")
    if args.grad_mode and args.rng != "exact":
        raise SystemExit("--grad-mode checks exact mode")
    if args.from_pretrained and args.rng != "exact":
        raise SystemExit("--from-pretrained checks exact mode against eager from_pretrained")
    if args.compile and args.rng != "portable":
        raise SystemExit("--compile checks portable mode: compiled kernels against fxinit's C kernel")
    jobs = [(n, settings, buildable[n]["variant"], orders, args.rng, args.cast, args.device, args.from_pretrained,
             args.compile, args.grad_mode) for n in names]
    print(f"{len(names)} architectures x {len(settings)} (seed, dtype) x {len(orders)} orders; "
          f"{len(listing) - len(buildable)} of {len(listing)} model types do not build tiny")
    results: list[dict[str, Any]] = []

    def done(job: tuple, res: Any) -> None:
        model = job[0]
        if isinstance(res, dict) and "error" in res:
            res = [{"model": model, "seed": s, "dtype": d, **{o: f"crash: {res['error']}" for o in orders}}
                   for s, d in settings]
        for r in res:
            results.append(r)
            status = "  ".join(f"{o}={r[o] if r[o] == 'ok' else r[o][:300]}" for o in orders)
            print(f"[{len(results)}/{len(jobs) * len(settings)}] {model} seed={r['seed']} {r['dtype']}: {status}",
                  flush=True)

    run_parallel("check_model_settings", jobs, args.jobs, args.timeout * len(settings), done)

    print("\n== corpus figure ==")
    wrong = 0
    for s, d in settings:
        for o in orders:
            rs = [r for r in results if r["seed"] == s and r["dtype"] == d]
            ok = sum(r[o] == "ok" for r in rs)
            refused = sum(r[o].startswith(("cannot defer", "unsupported")) for r in rs)
            wrong += sum(r[o].startswith(("mismatch", "crash")) for r in rs)
            what = "bitwise-equal" if args.rng == "exact" else "portable, order-independent"
            if args.compile:
                what += ", compiled = C kernel bit for bit"
            if args.cast:
                what += f" to eager + .to({args.cast})"
            if args.from_pretrained:
                what += " (from_pretrained, a third of the checkpoint missing)"
            if args.grad_mode:
                what += f" under torch.{args.grad_mode}()"
            print(f"seed={s} dtype={d:8s} order={o:7s}: {ok}/{len(rs)} {what}"
                  + (f", {refused} refused with DeferredInitError" if refused else ""))
    kinds: dict[str, list[str]] = defaultdict(list)
    for r in results:
        for o in orders:
            if r[o] != "ok":
                kinds[r[o].split(":")[0]].append(f"{r['model']}({r['seed']},{r['dtype']},{o})")
    for k, v in kinds.items():
        print(f"{k}: {len(v)}: {', '.join(v[:30])}")
    print(f"wall time {time.time() - t_start:.0f}s")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    # A clear DeferredInitError is an honest refusal; a wrong value or a crash fails the run.
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
