"""Running a program: ``FuzzModule`` (a generic ``nn.Module`` whose ``__init__`` executes a
program's init steps and whose ``init_weights()`` its post-construction steps) and ``build``,
which constructs it eagerly or under fxinit (trace, post-init, materialize) with the global
state (default dtype, RNG, threads) saved and put back. Part of the capture fuzzer (see
``fuzz_programs``)."""

from __future__ import annotations

import collections
import contextlib
import copy
import hashlib
import linecache
import math
import os
import re
import shutil
import tempfile
import types
import warnings
from typing import Any

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxinit

from fuzz_source import Program


# ============================================================================ the interpreter

_CURRENT_TMP: list[str] = []  # the TMP directory of the build in progress (read by programs' code)


def _compiled(program: Program, phase: str):
    src = program.body(phase)
    name = f"<fuzz-{phase}-{hashlib.sha1(src.encode()).hexdigest()[:10]}>"
    linecache.cache[name] = (len(src), None, [ln + "\n" for ln in src.splitlines()], name)
    return compile(src, name, "exec")


def _namespace(self_: nn.Module) -> dict[str, Any]:
    return {"self": self_, "torch": torch, "nn": nn, "F": F, "np": np, "math": math, "os": os, "copy": copy,
            "types": types, "collections": collections,
            "fxinit": fxinit,
            "TMP": _CURRENT_TMP[-1] if _CURRENT_TMP else tempfile.gettempdir()}


class FuzzModule(nn.Module):
    """A module whose ``__init__`` runs a program's init steps and ``init_weights`` its post steps."""

    def __init__(self, program: Program, *args: Any) -> None:
        super().__init__()
        self.__dict__["_fuzz_program"] = program
        ns = _namespace(self)
        ns.update({f"arg{i}": a for i, a in enumerate(args)})
        exec(_compiled(program, "init"), ns)  # noqa: S102

    def init_weights(self) -> None:
        exec(_compiled(self.__dict__["_fuzz_program"], "post"), _namespace(self))  # noqa: S102


@contextlib.contextmanager
def _global_state(default_dtype: str):
    dtype = torch.get_default_dtype()
    rng = torch.get_rng_state()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch.set_default_dtype(getattr(torch, default_dtype))
    try:
        yield
    finally:
        torch.set_default_dtype(dtype)
        torch.set_rng_state(rng)
        torch.set_num_threads(threads)
        fxinit.clear_meta_init_cache()


class Built:
    def __init__(self) -> None:
        self.module: nn.Module | None = None
        self.args: list[Any] = []
        self.after: torch.Tensor | None = None
        self.tmp = tempfile.mkdtemp(prefix="fxfuzz-")
        self.phase = "setup"
        self.lost_grad_fns = 0  # tensors fxinit said keep eager's values but not its grad_fn

    def cleanup(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


def _materialize(m: nn.Module, order: str) -> None:
    if order == "whole":
        fxinit.materialize(m)
    elif order == "reverse":
        for sub in reversed(list(m.modules())):
            fxinit.materialize(sub)
    else:
        for _, t in reversed(list(m.state_dict(keep_vars=True).items())):
            fxinit.materialize(t)
        fxinit.materialize(m)


def _lost_grad_fns(message: str) -> int:
    """How many tensors an fxinit warning says keep eager's values but lose eager's grad_fn."""
    many = re.match(r"fxinit: (\d+) tensor\(s\) computed with autograd .* not eager's grad_fn", message)
    if many:
        return int(many.group(1))
    return int(message.startswith("fxinit: a tensor computed with autograd from parameters keeps its value but not"))


def build(program: Program, trace: bool, out: Built) -> Built:
    """Construct (and for ``trace``, trace, post-init and materialize); exceptions propagate, with
    ``out.phase`` saying where."""
    ns = {"torch": torch, "np": np, "math": math, "nn": nn}
    _CURRENT_TMP.append(out.tmp)
    try:
        with _global_state(program.default_dtype), warnings.catch_warnings(record=True) as said:
            warnings.simplefilter("always")
            for name, expr in program.files:
                torch.save(eval(expr, ns), os.path.join(out.tmp, name))  # noqa: S307
            torch.manual_seed(1234)
            out.args = [eval(a, ns) for a in program.args]  # noqa: S307
            torch.manual_seed(program.seed)
            out.phase = "construct"
            m = fxinit.trace_init(FuzzModule, program, *out.args) if trace else FuzzModule(program, *out.args)
            out.module = m
            if program.post:
                out.phase = "init_weights"
                rec = fxinit.recording(m) if trace and program.post_mode == "recording" else contextlib.nullcontext()
                with rec:
                    m.init_weights()
            if trace:
                out.phase = "materialize"
                _materialize(m, program.order)
            out.phase = "done"
            out.after = torch.rand(3)
            out.lost_grad_fns = sum(_lost_grad_fns(str(w.message)) for w in said)
    finally:
        _CURRENT_TMP.pop()
    return out


#: The size thresholds of fxinit's element analyses and their values at their minimum.
SMALL_THRESHOLDS = (
    ("fxinit.passes.demand", "PARTIAL_COPY_MIN", 0), ("fxinit.passes.demand", "PARTIAL_CONSTANT_MIN", 0),
    ("fxinit.passes.demand", "FORWARD_RUN_MIN", 1), ("fxinit.passes.fills", "EXACT_SKIP_MIN", 1),
    ("fxinit.passes.fills", "PORTABLE_SKIP_MIN", 1), ("fxinit.passes.fills", "MIN_ELEMENTS", 1),
)


@contextlib.contextmanager
def small_thresholds() -> Any:
    """Fill pieces, partial copies, copies that draw and partial zeros at any size: the paths
    a big model's layout takes, on a program's small tensors."""
    import importlib

    saved = [(importlib.import_module(m), name, getattr(importlib.import_module(m), name))
             for m, name, _ in SMALL_THRESHOLDS]
    try:
        for (module, name, _), (_, _, value) in zip(saved, SMALL_THRESHOLDS):
            setattr(module, name, value)
        yield
    finally:
        for module, name, value in saved:
            setattr(module, name, value)
