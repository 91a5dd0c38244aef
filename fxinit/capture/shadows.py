"""Shadows: exact values of deferred tensors, for the Python that reads them while recording.

Vision models compute drop-path schedules with ``torch.linspace(...).item()`` inside
``__init__``. Tensors computed only from constants (no random ancestry) with at most
``EAGER_SHADOW_LIMIT`` elements keep a real *shadow* as they are recorded, maintained through
in-place ops and views; other values Python asks for are computed from their slice of the
graph (``execute``: random ops replay their snapshots) when that slice holds at most
``EVAL_BUDGET`` bytes at once (``plan.peak_bytes``), and a storage of at most ``SHADOW_LIMIT`` elements keeps the value
until it is next written. Anything else raises ``DeferredInitError``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch._C import TensorBase
from torch._C import _VariableFunctions as FACTORIES  # torch's own, whatever a caller patched

from fxinit import execute
from fxinit.capture.deferred import is_deferred_tensor, state_of
from fxinit.capture.devices import CPU, META, output_device, unavailable_to_cpu
from fxinit.capture.real import adopt_deferred, is_strided_result
from fxinit.capture.schema import WHAT_THE_USER_WROTE
from fxinit.capture.trees import leaves, map_tree, tensors_in
from fxinit.ops import draws_random
from fxinit.passes.ranges import storage_extent
from fxinit.plan import peak_bytes
from fxinit.spec import TensorSpec

#: Tensors up to this many elements computed only from constants get an exact shadow as
#: they are recorded.
EAGER_SHADOW_LIMIT = 1 << 12
#: Storages up to this many elements keep the exact value computed when Python first
#: reads them (and lifted constants keep theirs from the start).
SHADOW_LIMIT = 1 << 16
#: When Python needs the value of a deferred tensor, its slice is run for real if the slice
#: allocates at most this many bytes (counting every intermediate).
EVAL_BUDGET = 16 << 20


def value_hint() -> str:
    return ("values are computed while recording only when that costs at most 16 MiB of tensors; "
            "materialize the tensor first, move this computation out of __init__, or guard it with "
            "`if not fxinit.is_meta_init():`")


def _covers(elements: int, t: torch.Tensor) -> bool:
    """A storage of ``elements`` elements holds every element of ``t``'s view."""
    with torch._C.DisableTorchFunctionSubclass():
        extent = storage_extent(TensorSpec.of(t, META))
    return extent is not None and extent[1] <= elements


class Shadows:
    """The Recorder's reading of values (a mixin: it uses the recorder's storages, graph,
    ``suspended``, ``fail`` and ``_record``)."""

    def shadow_of(self, t: torch.Tensor) -> torch.Tensor | None:
        """The exact real value of deferred ``t`` if it is known (small, constant-derived)."""
        if not is_deferred_tensor(t):
            return t
        info = self.storages.info(t)
        flat = info.shadow
        if flat is None or flat.dtype != t.dtype or not _covers(flat.numel(), t):
            return None  # (a storage grown by resize_ since: its new elements are not known)
        with self.suspended():  # also reached outside the dispatch mode's handler (from property hooks)
            return flat.as_strided(t.size(), t.stride(), t.storage_offset())

    def value_of(self, t: torch.Tensor, bounded: bool = True) -> torch.Tensor | None:
        """The exact current value of deferred ``t`` on the CPU, if it is cheap to know
        (or whatever it costs, with ``bounded=False``: for a real tensor that takes it).

        Small constant-derived tensors have a shadow. Others whose slice holds at most
        EVAL_BUDGET bytes at once are computed by running that slice of the graph recorded so far:
        every random op in it carries its generator snapshot, so this is exact and touches
        no user generator; a small storage keeps the result as its shadow until it is next
        written. Costlier ones return None (the caller refuses).
        """
        shadow = self.shadow_of(t)
        if shadow is not None:
            return shadow
        node = state_of(t).node
        targets = [(node, self.storage_id(t))]
        todo = execute.plan(self, targets, devices=unavailable_to_cpu, eliminate_dead=False)
        if bounded and peak_bytes(todo) > EVAL_BUDGET:
            return None
        with self.suspended():
            value = execute.run(self, todo, workers=1)[node].to("cpu")
            if value.untyped_storage().nbytes() <= SHADOW_LIMIT * value.element_size():
                self.set_shadow(t, value)  # the whole storage, as it is now: the next read is free
            return value

    def set_shadow(self, t: torch.Tensor, real: torch.Tensor) -> None:
        if real.stride() != t.stride() or real.storage_offset() != t.storage_offset() or real.dtype != t.dtype:
            return
        if real.device.type != "cpu":
            return
        with self.suspended():  # also reached outside the dispatch mode's handler (lift from a function mode)
            flat = FACTORIES.empty(0, dtype=real.dtype, device=CPU).set_(real.detach().untyped_storage())
        self.storages.info(t).shadow = flat

    def set_real_data(self, t: torch.Tensor, src: torch.Tensor) -> None:
        """``t.data = src`` for a real ``t``: ``t`` becomes deferred, sharing ``src``'s
        storage (``capture.real.adopt_deferred``). Where it cannot be swapped (views of it
        exist), during capture ``src``'s value is computed now and ``t`` takes a copy: eager's
        ``t`` and ``src`` share memory, these two do not, so a later write to either while
        recording is refused; after the trace no mode would see such a write: refused."""
        if adopt_deferred(self, t, src):
            return
        if not self.capturing:
            raise self.fail(
                "fxinit cannot give a real tensor the .data of a deferred one after the trace: eager's would share "
                "the deferred tensor's memory from here on, and that memory does not exist yet",
                op="Tensor.data",
                hint="materialize the model before this line, or assign the other way round (deferred.data = real)")
        value = self.value_of(src)
        if value is None:
            raise self.fail(
                "fxinit cannot set the .data of a real tensor to a deferred value too large to compute while "
                "recording", op="Tensor.data",
                hint="compute this value outside the constructor, or let the tensor be deferred too")
        with self.suspended(), torch._C.DisableTorchFunctionSubclass():
            TensorBase.data.__set__(t, value.to(t.device, copy=True))
        # Eager's ``t`` now shares ``src``'s storage: a later write to either would reach the
        # other there, not here. Such writes are refused (``Recorder._record``, ``capture.real``).
        self.copied_out[self.storage_id(src)] = "a real tensor took its value through `.data = ...`"
        self.lifted_reals[t.untyped_storage().data_ptr()] = "it took a deferred tensor's value through `.data = ...`"

    # ------------------------------------------------------------------ value reads
    def read_values(self, func: Any, t: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        # after the trace, whatever it costs: an init step (mmengine's init_weights compares each
        # parameter's mean) reads what eager's reads, where no trace waits to stay cheap
        shadow = self.value_of(t, bounded=self.capturing)
        if shadow is None:
            raise self.fail(
                f"fxinit cannot read the values of a deferred tensor that is too large to compute while recording "
                f"({getattr(func, '__name__', func)})",
                op=f"Tensor.{getattr(func, '__name__', func)}",
                hint=value_hint(),
            )
        with self.suspended():
            return func(shadow, *args, **kwargs)

    def update_shadows(self, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
                        mutated: list[torch.Tensor], fresh: list[tuple[torch.Tensor, int]], random: bool,
                        real_out: Any) -> None:
        # A random op has no shadow, on meta too (``random`` is False there): computing one
        # would draw from the user's generator, which eager's meta op leaves alone.
        small_fresh = fresh and all(w.numel() <= EAGER_SHADOW_LIMIT for w, _ in fresh)
        if random or draws_random(func, args, kwargs) or not (mutated or small_fresh) \
                or not all(self.shadow_of(t) is not None for t in inputs):
            for t in mutated:
                self.storages.info(t).shadow = None
            return
        if real_out is None:
            real_out = self.compute_real(func, args, kwargs)
        flat_real = leaves(real_out)
        for w, j in fresh:
            r = flat_real[j]
            if isinstance(r, torch.Tensor):
                self.set_shadow(w, r)

    def compute_real(self, func: Any, args: tuple, kwargs: dict) -> Any:
        def real(x: Any) -> Any:
            return self.value_of(x, bounded=self.capturing) if is_deferred_tensor(x) else x

        rkwargs = map_tree(real, kwargs)
        if "device" in rkwargs:
            rkwargs["device"] = CPU
        with self.suspended(), torch.no_grad():
            return func(*map_tree(real, args), **rkwargs)

    def via_values(self, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor],
                     data_dependent: bool, cause: Exception | None = None) -> Any:
        """Ops whose result depends on values (or that have no meta kernel): run them on exact values, or refuse."""
        if not draws_random(func, args, kwargs) and all(self.value_of(t, bounded=self.capturing) is not None
                                                         for t in inputs):
            real_out = self.compute_real(func, args, kwargs)
            if not tensors_in(real_out) or not is_strided_result(real_out):
                return real_out  # a Python value (item, bool), or a sparse tensor: kept real (capture.real)
            device = output_device(func, inputs, kwargs, self._intended)
            with torch._C._DisableTorchDispatch():
                mout = map_tree(
                    lambda r: FACTORIES.empty_strided(r.size(), r.stride(), dtype=r.dtype, device=META)
                    if isinstance(r, torch.Tensor) else r, real_out)
            return self._record(func, args, kwargs, inputs, mout, device, real_out=real_out)
        if data_dependent:
            what = WHAT_THE_USER_WROTE.get(func, str(func))
            raise self.fail(
                f"fxinit cannot defer {what}: it needs the value of a deferred tensor that is too large "
                "to compute while recording",
                op=str(func),
                hint=value_hint(),
            )
        raise self.fail(
            f"fxinit cannot defer {func}: {type(cause).__name__}: {str(cause).splitlines()[0] if cause else ''}",
            op=str(func),
            hint="this operator has no meta implementation or needs data; compute it outside the constructor "
                 "or guard it with `if not fxinit.is_meta_init():`",
        )
