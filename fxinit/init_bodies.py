"""The bodies of torch's opaque init functions: which code an opaque node's replay runs.

An opaque node (``ops.call_init_function``) is replayed by calling the installed torch's
``trunc_normal_``, ``orthogonal_``... Its exact values are eager's only if that function
computes what the one that ran at capture computed: a graph saved with one torch and
materialized with another may replay other code (torch 2.11's ``trunc_normal_`` is an inverse
CDF, 2.13's a rejection sampler). Each opaque node keeps ``body_fingerprint`` of its function
at capture, and exact replay under another fingerprint is refused (``execute``).

>>> from fxinit.init_bodies import body_fingerprint
>>> len(body_fingerprint("torch.nn.init.trunc_normal_"))
16
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import types
from typing import Any, Callable

import torch

from fxinit.ops import TORCH_FUNCTIONS


def called(fn: types.FunctionType, functions: dict[str, types.FunctionType]) -> list[str]:
    """The qualnames of the init functions among ``functions`` that ``fn`` calls by name
    (``trunc_normal_`` calls ``_no_grad_trunc_normal_``)."""
    by_name = {f.__name__: q for q, f in functions.items() if f is not fn}
    return [by_name[name] for name in fn.__code__.co_names if name in by_name]


def original_name(fn: Callable[..., Any]) -> str:
    """The global under which ``capture.init_shims`` keeps a copy of ``fn``'s original body."""
    return f"__fxinit_original_{fn.__name__}__"


def original_body(fn: types.FunctionType) -> types.FunctionType:
    """``fn`` as torch defined it: the copy of its original body where it was given another."""
    return fn.__globals__.get(original_name(fn), fn)


@functools.lru_cache(maxsize=None)
def body_fingerprint(qualname: str) -> str:
    """A hash of the source of init function ``qualname`` and of the registered init functions
    it calls; where a source file is not there, of the function's name and torch's version
    (bytecode would differ between Python versions running the same torch); "" for a
    function torch does not have."""
    functions = {q: original_body(fn) for q, fn in TORCH_FUNCTIONS.items()}
    todo, seen, h = [qualname], set(), hashlib.sha256()
    while todo:
        q = todo.pop()
        if q in seen or q not in functions:
            continue
        seen.add(q)
        fn = functions[q]
        try:
            h.update(inspect.getsource(fn).encode())
        except (OSError, TypeError):
            h.update(f"{q} of torch {torch.__version__.split('+')[0]}".encode())  # one for +cpu and +cu130
        todo.extend(called(fn, functions))
    return h.hexdigest()[:16] if seen else ""
