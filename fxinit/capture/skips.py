"""Lazy skips of the default CPU generator while a constructor is captured.

Eager construction moves the default CPU generator past every random op. Capture must
leave it where eager would, but computing each intermediate state is a jump-ahead of
MT19937 (~0.2 ms): for a 405B Llama that was a third of the trace. Inside a capture
scope the recorder instead notes each op's start as a ``PendingSnapshot`` (so many words
after the previous one) and leaves a *placeholder* state in the generator: the bytes of
the last real state with a marker in its first words. Only where the true state is
needed is it computed and set: before fxinit runs random code for real (opaque init
functions, ops whose consumption is not a pure advance), when ``torch.get_rng_state()``
is called (``torch.random.fork_rng`` calls it too), and when the scope ends.

The placeholder keeps the seed, so ``torch.initial_seed()`` is right. A user who sets the
generator (``manual_seed``, ``set_rng_state``) is seen at the next random op: the state is
then neither ours nor a placeholder, and it is taken as it is. A placeholder put back
later (``default_generator.set_state(saved)`` with a state read directly) is recognised
by its marker and stands for the position it marked, and so is one copied into another
generator (``g.set_state(torch.default_generator.get_state())``: ``true_snapshot`` gives it the
true state before its first recorded draw).

The doors through which real code could see a placeholder are closed while a scope is
active: ``torch.get_rng_state`` is patched at the level of its code object, so a
reference imported before fxinit reaches the patch too; the generator type's own reads
(``get_state``, ``clone_state``, ``graphsafe_get_state``, and ``__reduce__`` and
``__getstate__``, which ``copy.deepcopy`` and pickling call) set the true state first when
they read the default generator (``torch._C.Generator`` is a static type: its dict is
written directly, as the attribute cache then is told; its ``set_state`` and ``__setstate__``
take the values of deferred states, which unpickling or ``torch.load`` make); starting a thread sets the true
state first, and no skip is lazy while a thread started inside the scope is alive (it may
draw from the generator at any time; threads that were running before the capture began
are taken not to draw during it). A placeholder read so used to leave the constructor in
a copy, and to draw other numbers after the trace, silently. Where the type cannot be
written, no skip is lazy.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import os
import struct
import threading
import types
import weakref
from typing import Iterator

import torch

from fxinit.capture.deferred import is_deferred_tensor, state_of
from fxinit.capture.trees import map_tree
from fxinit.rng import PendingSnapshot, RngSnapshot, Snapshot, snapshot

_MARK_AT, _MARK_SIZE = 24, 32  # bytes: the first four word slots of a CPU state (see rng.mt19937)
_active: list["LazyCpuGenerator"] = []  # innermost last
_patch_lock = threading.Lock()
_GET_RNG_STATE = torch.random.get_rng_state  # torch.get_rng_state is the same function
_ORIGINAL_CODE = _GET_RNG_STATE.__code__
_ORIGINAL_THREAD_START = threading.Thread.start
_GENERATOR = torch._C.Generator
#: the generator type's methods that read a state out (the default generator's: made true first)
_READS = {name: getattr(_GENERATOR, name) for name in (
    "get_state", "clone_state", "graphsafe_get_state", "__getstate__", "__reduce__") if name in vars(_GENERATOR)}
#: the generator type's methods that take a state tensor in (which may be deferred: unpickled, loaded)
_TAKES = {name: getattr(_GENERATOR, name) for name in ("set_state", "__setstate__") if name in vars(_GENERATOR)}
_TORCHS_METHODS = {**_READS, **_TAKES}
_RAW_GET_STATE = _READS["get_state"]
_started: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()  # threads started inside a scope


class LazyCpuGenerator:
    """Where eager's default CPU generator would be, without moving the real one there."""

    def __init__(self) -> None:
        self._marks: dict[bytes, PendingSnapshot] = {}  # placeholder marker -> the position it stands for
        # Markers: three random 32-bit words of this generator's own, then a count. Each sits
        # in a 64-bit slot as the generator stores words, so set_state keeps it whole.
        self._base = struct.unpack("=3I", os.urandom(12))
        self._count = 0

    def position(self) -> Snapshot:
        """The state eager's default CPU generator has now."""
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            real = _RAW_GET_STATE(torch.default_generator)
            pending = self._marks.get(_marker(real))
        return pending if pending is not None else RngSnapshot("cpu", real)

    def skip(self, draws: int) -> Snapshot:
        """Eager's generator moves ``draws`` words on from where it is now: return that
        position and leave a placeholder for the one ``draws`` words later."""
        self._count += 1
        mark = struct.pack("=4Q", *self._base, self._count & 0xFFFFFFFF)
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            state = _RAW_GET_STATE(torch.default_generator)
            start = self._marks.get(_marker(state))
            if start is None:
                start = RngSnapshot("cpu", state.clone())
            ctypes.memmove(state.data_ptr() + _MARK_AT, mark, _MARK_SIZE)
            torch.default_generator.set_state(state)
        self._marks[mark] = PendingSnapshot(start, draws)
        return start

    def flush(self) -> None:
        """Set the real generator to the true state (before real draws, and at the end)."""
        with torch._C.DisableTorchFunction(), torch._C._DisableTorchDispatch():
            pending = self._marks.get(_marker(_RAW_GET_STATE(torch.default_generator)))
            if pending is not None:
                torch.default_generator.set_state(pending.state)

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """Skip lazily inside the block; the true state is in place when it ends."""
        with _patch_lock:
            _started.clear()
            _active.append(self)
            if len(_active) == 1:
                _GET_RNG_STATE.__code__ = _get_rng_state_code()
                threading.Thread.start = _start_thread  # type: ignore[method-assign]
                _set_generator_methods(_CAPTURE_METHODS)
        try:
            yield
        finally:
            with _patch_lock:
                _active.remove(self)
                if not _active:
                    _GET_RNG_STATE.__code__ = _ORIGINAL_CODE
                    threading.Thread.start = _ORIGINAL_THREAD_START  # type: ignore[method-assign]
                    _set_generator_methods(_TORCHS_METHODS)
            self.flush()

    @property
    def active(self) -> bool:
        """Skips may be lazy: this scope is active and no other Python thread could draw."""
        return self in _active and _READS_CLOSED[0] and not (_started and any(t.is_alive() for t in list(_started)))

    def true_snapshot(self, gen: torch.Generator) -> RngSnapshot:
        """``gen``'s state, read once; where it holds one of this capture's placeholders (copied
        into another generator, or left in the default one while skips are not lazy), the
        true state, which ``gen`` is then given."""
        snap = snapshot(gen)
        if snap.device == "cpu":
            pending = self._marks.get(_marker(snap.state))
            if pending is not None:
                gen.set_state(pending.state)
                snap = RngSnapshot("cpu", pending.state.clone())
        return snap


def _marker(state: torch.Tensor) -> bytes:
    """The bytes where a placeholder's marker sits, of a state read from the generator."""
    return ctypes.string_at(state.data_ptr() + _MARK_AT, _MARK_SIZE)


def flush_active() -> None:
    """Put the true state in place for every active capture scope (innermost first)."""
    for lazy in reversed(list(_active)):
        lazy.flush()


def _get_rng_state_during_capture():  # type: ignore[no-untyped-def]
    # Runs as the code of torch.random.get_rng_state, in that module's globals.
    from fxinit.capture.skips import flush_active
    flush_active()
    return default_generator.get_state()  # noqa: F821 (torch.random's global)


def _get_rng_state_code() -> "types.CodeType":
    names = {"co_name": _ORIGINAL_CODE.co_name}
    if hasattr(_ORIGINAL_CODE, "co_qualname"):  # Python >= 3.11
        names["co_qualname"] = _ORIGINAL_CODE.co_qualname
    return _get_rng_state_during_capture.__code__.replace(**names)


def _start_thread(self: threading.Thread) -> None:
    """``Thread.start`` during capture: the new thread may draw from the default generator."""
    flush_active()
    _started.add(self)
    _ORIGINAL_THREAD_START(self)


def _flushing(read: "types.MethodDescriptorType") -> "types.FunctionType":
    """``read`` of the generator type, setting the true state first where it reads the default generator."""
    @functools.wraps(read)
    def flushing_read(self: torch.Generator, *args: object, **kwargs: object) -> object:
        if self is torch.default_generator:
            flush_active()
        return read(self, *args, **kwargs)
    return flushing_read


def _taking_values(take: "types.MethodDescriptorType") -> "types.FunctionType":
    """``take`` of the generator type, given the exact values of deferred state tensors: a state
    unpickled (``pickle.loads``, ``copy`` through ``__reduce__``) or ``torch.load``-ed inside a
    constructor is a deferred constant, which torch's C++ would take for a wrong type."""
    @functools.wraps(take)
    def taking_values(self: torch.Generator, *args: object, **kwargs: object) -> object:
        return take(self, *map_tree(_value, args), **map_tree(_value, kwargs))
    return taking_values


def _value(x: object) -> object:
    if not is_deferred_tensor(x):
        return x
    value = state_of(x).recorder.value_of(x, bounded=False)
    return x if value is None else value


_CAPTURE_METHODS = {**{name: _flushing(read) for name, read in _READS.items()},
                    **{name: _taking_values(take) for name, take in _TAKES.items()}}
_READS_CLOSED = [True]  # whether the type's methods could be patched (else no skip is lazy)


def _set_generator_methods(methods: dict) -> None:
    """Put ``methods`` in the generator type's dict (a static type: through its real dict)."""
    if not _READS_CLOSED[0]:
        return
    try:
        _write_type_dict(methods)
        taken = all(getattr(_GENERATOR, name) is method for name, method in methods.items())
    except Exception:  # noqa: BLE001
        taken = False
    if not taken:
        _READS_CLOSED[0] = False
        with contextlib.suppress(Exception):
            _write_type_dict(_TORCHS_METHODS)


def _write_type_dict(methods: dict) -> None:
    real_dict = next(d for d in gc.get_referents(_GENERATOR.__dict__) if isinstance(d, dict))
    real_dict.update(methods)
    ctypes.pythonapi.PyType_Modified(ctypes.py_object(_GENERATOR))  # (its attribute cache)
