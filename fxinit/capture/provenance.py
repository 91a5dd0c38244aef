"""Where an init op came from: the user's source line, the module, the init function.

Capture calls these for every recorded op, so they only walk frames and keep strings
and weak references; module paths are resolved to fully qualified names once the
root module exists.
"""

from __future__ import annotations

import copy
import contextlib
import functools
import linecache
import os
import re
import sys
import types
import warnings
from dataclasses import dataclass
from typing import Iterator, NamedTuple

import torch

from fxinit.capture.frame_arguments import argument

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_FXINIT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_INIT_FILE = os.path.join(_TORCH_DIR, "nn", "init.py")
_INIT_METHOD_NAMES = {"_init_weights", "reset_parameters", "init_weights", "_initialize_weights", "post_init"}
_ASSIGN = re.compile(r"self\.(\w+)\s*(?:=|\.append\(|\.extend\(|\.add_module\(|\[)")


@dataclass(frozen=True)
class Provenance:
    """Where one recorded op came from (strings only, cheap to keep and to save)."""

    source: str | None  # "path/to/file.py:123: the line"
    init_fn: str | None  # the innermost torch.nn.init function: "torch.nn.init.kaiming_uniform_"
    module_class: str | None  # class of the module the op initializes
    init_method: str | None = None  # the outermost init method: "LlamaPreTrainedModel._init_weights"


def _frames(start: types.FrameType | None) -> Iterator[types.FrameType]:
    f = start
    while f is not None:
        yield f
        f = f.f_back


_DEMO_FILE = os.path.join(_FXINIT_DIR, "demo.py")


#: Wrappers between a caller and what it calls: ``typing_extensions.deprecated`` (around
#: ``nn.utils.weight_norm``), Python's own in ``warnings``, ``functools``, ``contextlib`` and
#: ``copy`` (``copy.deepcopy`` calls a tensor's ``__deepcopy__``).
_WRAPPER_FILES = frozenset(os.path.abspath(m.__file__) for m in (functools, contextlib, warnings, copy)) | frozenset(
    f for f in (getattr(sys.modules.get("typing_extensions"), "__file__", None),) if f)


def _is_internal(filename: str) -> bool:
    if filename == _DEMO_FILE:  # the example model is user code
        return False
    return filename.startswith(_FXINIT_DIR) or filename.startswith(_TORCH_DIR) or filename in _WRAPPER_FILES


def user_frame(start: types.FrameType | None = None) -> types.FrameType | None:
    """The innermost frame that belongs neither to torch nor to fxinit."""
    for f in _frames(start or sys._getframe(1)):
        if not _is_internal(f.f_code.co_filename):
            return f
    return None


@contextlib.contextmanager
def source_lines_scope() -> Iterator[None]:
    """Files that linecache reads during the block (provenance reads one line of each
    source file the constructor runs: transformers' modeling_utils.py alone is 0.6 MiB)
    are dropped from its cache at the end, so capture does not keep them in memory."""
    before = set(linecache.cache)
    try:
        yield
    finally:
        for name in [n for n in linecache.cache if n not in before]:
            linecache.cache.pop(name, None)


def called_from(directory: str, start: types.FrameType | None = None) -> bool:
    """Whether code under ``directory`` is on the stack, below the first user frame."""
    for f in _frames(start or sys._getframe(1)):
        filename = f.f_code.co_filename
        if filename.startswith(directory):
            return True
        if not _is_internal(filename):
            return False
    return False


def format_source(frame: types.FrameType | None) -> str | None:
    if frame is None:
        return None
    filename, lineno = frame.f_code.co_filename, frame.f_lineno
    line = linecache.getline(filename, lineno).strip()
    loc = f"{filename}:{lineno}"
    return f"{loc}: {line}" if line else loc


def _frame_module(f: types.FrameType) -> torch.nn.Module | None:
    """The module a frame works on: ``self``, or the ``module`` argument of ``_init_weights(self, module)``."""
    code = f.f_code
    if code.co_argcount == 0:
        return None
    first = argument(f, 0)
    if code.co_argcount >= 2 and code.co_name in _INIT_METHOD_NAMES:
        second = argument(f, 1)
        if isinstance(second, torch.nn.Module):
            return second
    return first if isinstance(first, torch.nn.Module) else None


def _frame_self(f: types.FrameType) -> object:
    return argument(f, 0) if f.f_code.co_argcount else None


class _CodeKind(NamedTuple):
    internal: bool  # torch's or fxinit's own code
    init_fn: str | None  # the public torch.nn.init function this code is
    init_method: bool  # named like a model's init method (``_init_weights``, ``reset_parameters``)
    may_hold_module: bool  # its first (or, for init methods, second) argument can be a module


# Keyed by id: hashing a code object hashes its bytecode and constants, every time. The
# entry keeps its code object alive, so the id cannot be reused by another.
_CODE_KINDS: dict[int, tuple[types.CodeType, _CodeKind]] = {}


def _code_kind(code: types.CodeType) -> _CodeKind:
    filename = code.co_filename
    init_fn = f"torch.nn.init.{code.co_name}" if filename == _INIT_FILE and not code.co_name.startswith("_") \
        else None
    internal = _is_internal(filename)
    # Reading a frame's locals builds a dict; skip frames whose first argument is never a
    # module: fxinit's own methods (fxinit defines no modules outside the demo), nn.init,
    # and torch functions other than methods and those taking a ``module`` (weight_norm...).
    first = code.co_varnames[:1]
    if filename.startswith(_FXINIT_DIR):
        never = internal and first in (("self",), ("cls",))
    else:
        never = filename == _INIT_FILE or (internal and first not in (("self",), ("module",)))
    kind = _CodeKind(internal, init_fn, code.co_name in _INIT_METHOD_NAMES, code.co_argcount > 0 and not never)
    _CODE_KINDS[id(code)] = code, kind
    return kind


# One Provenance object per distinct (source line, init function, module class, init method):
# capture records thousands of ops from a handful of lines. Code objects by id, as above.
_INTERNED: dict[tuple, tuple[types.CodeType | None, Provenance]] = {}


def current_provenance(start: types.FrameType | None = None) -> tuple[Provenance, torch.nn.Module | None]:
    """Provenance of the op being recorded now, and the innermost module on the stack."""
    user = None
    init_fn = None
    outermost_init = None
    module = None
    kinds = _CODE_KINDS
    f = start or sys._getframe(1)
    while f is not None:  # runs for every recorded op: a plain loop over frames, kinds cached per code
        code = f.f_code
        entry = kinds.get(id(code))
        kind = entry[1] if entry is not None else _code_kind(code)
        if init_fn is None and kind.init_fn is not None:
            init_fn = kind.init_fn
        if kind.init_method:
            outermost_init = f
        if user is None and not kind.internal:
            user = f
        if module is None and kind.may_hold_module:
            module = _frame_module(f)
        f = f.f_back
    init_method = None
    if outermost_init is not None:
        owner = _frame_self(outermost_init)
        name = outermost_init.f_code.co_name
        init_method = f"{type(owner).__name__}.{name}" if isinstance(owner, torch.nn.Module) else name
    module_class = type(module).__name__ if module is not None else None
    code = user.f_code if user is not None else None
    key = id(code), user.f_lineno if user is not None else None, init_fn, module_class, init_method
    entry = _INTERNED.get(key)
    if entry is None:
        entry = _INTERNED[key] = code, Provenance(format_source(user), init_fn, module_class, init_method)
    return entry[1], module


def module_path_from_stack(
    start: types.FrameType | None = None, known: dict[int, str] | None = None
) -> str | None:
    """Best-effort dotted path of the module being built or initialized right now.

    A module whose constructor is still running is not attached to its parent yet, so
    its name is read from the parent's source line (``self.attn = Attention(...)``,
    ``self.layers.append(...)``); list comprehensions contribute their integer loop
    variable. Modules already attached are named exactly through ``known``.
    """
    known = known or {}
    chain: list[tuple[torch.nn.Module, types.FrameType]] = []
    comp_index: dict[int, str] = {}
    pending_index: str | None = None
    for f in _frames(start or sys._getframe(1)):
        m = _frame_module(f)
        if m is not None:
            if chain and chain[-1][0] is m:
                chain[-1] = (m, f)  # outermost frame of the same module carries the assignment line
                continue
            if pending_index is not None and chain:
                comp_index[id(chain[-1][0])] = pending_index
            pending_index = None
            chain.append((m, f))
        elif f.f_code.co_name in ("<listcomp>", "<genexpr>", "<dictcomp>"):
            ints = [v for k, v in f.f_locals.items() if not k.startswith(".") and isinstance(v, int)]
            pending_index = str(ints[-1]) if ints else "?"
    if not chain:
        return None
    chain.reverse()  # outermost first
    for i, (m, _) in enumerate(reversed(chain)):
        if id(m) in known:
            start_i = len(chain) - 1 - i
            parts = [known[id(m)]] if known[id(m)] else []
            break
    else:
        start_i = 0
        parts = [type(chain[0][0]).__name__]
    for (parent, pframe), (child, _) in zip(chain[start_i:], chain[start_i + 1 :]):
        line = linecache.getline(pframe.f_code.co_filename, pframe.f_lineno)
        match = _ASSIGN.search(line)
        name = match.group(1) if match else f"<{type(child).__name__}>"
        parts.append(name)
        if id(child) in comp_index:
            parts.append(comp_index[id(child)])
        elif match and ".append(" in line[match.start() :]:
            existing = getattr(parent, name, None)
            if isinstance(existing, (torch.nn.ModuleList, torch.nn.Sequential, list)):
                parts.append(str(len(existing)))
    return ".".join(p for p in parts if p)


def subclass_dispatch(frame: types.FrameType | None) -> str | None:
    """``Class.__torch_dispatch__`` of a tensor subclass (not fxinit's) whose dispatch code
    runs at ``frame`` or further up the stack (a few dozen frames), or None."""
    for _ in range(40):
        if frame is None:
            return None
        if frame.f_code.co_name == "__torch_dispatch__" and not frame.f_code.co_filename.startswith(_FXINIT_DIR):
            return f"{getattr(argument(frame, 0), '__name__', '?')}.__torch_dispatch__"
        frame = frame.f_back
    return None
