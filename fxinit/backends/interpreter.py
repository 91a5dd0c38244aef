"""The interpreter: runs a ``Plan`` node by node with PyTorch's own kernels.

It is shaped like ``torch.fx.Interpreter`` (``run``, ``run_node``, ``fetch_args_kwargs``,
and a method per kind of node that a subclass can override: ``get_attr``,
``call_function``; ``random_op``, ``reuse`` and ``fused_cast`` for what the plan decided)
but is not one: an init slice is a subset of a larger graph, with no placeholders and no
output node, and values must be freed by the plan's last uses (CSE reuse and kept values
included), not by fx's graph-wide ones; and every method needs the node, not only its
target, because what runs depends on the node's plan entries.

How random nodes draw is a strategy the interpreter is given: ``backends.exact`` (the
generator snapshots: eager's values), ``backends.streams`` (portable mode's counter-based
streams), ``backends.compiled`` (those streams as kernels torch.compile generates).
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, Sequence

import torch
import torch.fx as fx

from fxinit.errors import DeferredInitError
from fxinit.numerics import Settings, settings_applied
from fxinit.ops import (DEVICE_KWARGS, constant_value, filled_argument, is_random, reads_grad_mode, reads_no_data,
                        replay_args)
from fxinit.passes.batched_fills import BatchedFill
from fxinit.passes.cast_fusion import FusedCast
from fxinit.passes import intervals
from fxinit.passes.fills import Ranges
from fxinit.passes.slicing import metadata_only
from fxinit.plan import Plan
from fxinit.spec import copy_with_strides, dtype_after_to

aten = torch.ops.aten


class Sampler(Protocol):
    """How random nodes draw (exact, portable, compiled)."""

    rng: str

    def prepare(self, random_nodes: list[fx.Node]) -> None: ...
    def call(self, node: fx.Node, args: tuple, kwargs: dict) -> Any: ...
    def fill_pieces(self, node: fx.Node, args: tuple, kwargs: dict, pieces: Ranges) -> None: ...
    def fill_chunks(self, node: fx.Node, args: tuple, kwargs: dict) -> None: ...
    def fill_cast(self, fused: FusedCast, out: torch.Tensor) -> None: ...
    def fill_runs(self, node: fx.Node, runs: Any, out: torch.Tensor) -> None: ...
    def fill_batch(self, fills: list[tuple[fx.Node, BatchedFill, torch.Tensor]]) -> None: ...


#: Factories called through torch's Python functions: the same kernels, a quarter of the
#: OpOverload's call cost (a model allocates every tensor it initializes). Keyed by the op's
#: identity (an OpOverload hashes in Python; ops are never freed).
_FACTORIES = {id(op): fn for op, fn in ((aten.empty.memory_format, torch.empty), (aten.ones.default, torch.ones),
                                         (aten.zeros.default, torch.zeros), (aten.full.default, torch.full))}


#: Batched fills run once the queue holds this many elements (~0.7 ms of an H100's portable
#: kernel): a GPU then fills while the interpreter runs the nodes after them, rather than all of
#: a model's fills waiting for the end, and an 8B model takes a few dozen launches.
LAUNCH_ELEMENTS = 1 << 28


def _as_recorded(value: Any, spec: Any) -> Any:
    """A ``*_like`` value of a meta stand-in with the strides the capture recorded for it,
    where the two differ only at dimensions of size one (a meta input's ``empty_like`` recomputes
    those; the memory layout is the same)."""
    if not isinstance(value, torch.Tensor) or spec is None or value.stride() == spec.stride \
            or tuple(value.shape) != spec.shape:
        return value
    if any(a != b and size != 1 for a, b, size in zip(value.stride(), spec.stride, spec.shape)):
        return value
    return value.as_strided(spec.shape, spec.stride, value.storage_offset())


def _stands_in(value: Any) -> bool:
    """Whether ``value`` is a meta tensor standing in for storage nothing needs."""
    return isinstance(value, torch.Tensor) and value.device.type == "meta"


class Interpreter:
    """Runs the nodes of ``plan`` (all, or one of its groups) and returns the kept values."""

    def __init__(self, plan: Plan, constants: Mapping[str, torch.Tensor], sampler: Sampler,
                 settings: Settings) -> None:
        self.plan = plan
        self.constants = constants
        self.sampler = sampler
        self.settings = settings  # torch's global settings when the graph was recorded
        self.env: dict[fx.Node, Any] = {}
        self._fused_away = plan.fused_away
        self._queued: list[tuple[fx.Node, torch.Tensor]] = []  # batched fills not run yet
        self._queued_elements = 0  # elements of those

    def run(self, nodes: Sequence[fx.Node] | None = None, finish: bool = True) -> dict[fx.Node, Any]:
        """Run ``nodes`` (default: the whole plan) in order; the kept values they computed.
        ``finish=False``: batched fills may still be queued (``finish`` runs them), so that
        one batch spans the groups one interpreter runs after one another."""
        plan, env = self.plan, self.env
        batched, flushes = plan.batches.fills, plan.batches.flushes
        kept = {}
        with torch.no_grad(), settings_applied(self.settings):
            for n in plan.nodes if nodes is None else nodes:
                if n in batched:
                    env[n] = self.queue(n, batched[n])
                elif n not in self._fused_away:
                    if n in flushes:
                        self.finish()
                    value = self.run_node(n)
                    if n in plan.fused_casts:
                        env.update((r, value) for r in plan.fused_casts[n].results)
                    else:
                        env[n] = value
                    if n in plan.kernels:  # the element-wise chain ran inside n's kernel
                        env.update((m, value) for m in plan.kernels[n].chain)
                casts = plan.casts.get(n)
                if casts:
                    self.finish()
                    for k in casts:
                        env[k] = _cast(env[k], plan.output_dtype)
                for value_node in plan.frees.get(n, ()):
                    env.pop(value_node, None)
            for n in [n for n in env if n in plan.keep]:
                kept[n] = env.pop(n)
            if finish:
                self.finish()
        return kept

    def queue(self, n: fx.Node, fill: BatchedFill) -> torch.Tensor:
        """A batched fill's turn: its tensor, filled when the queue runs (``finish``), or now
        where the queue holds ``LAUNCH_ELEMENTS``."""
        tensor = self.env[n.args[fill.index]]
        self._queued.append((n, tensor))
        self._queued_elements += tensor.numel()
        if self._queued_elements >= LAUNCH_ELEMENTS:
            self.finish()
        return tensor

    def finish(self) -> None:
        """Run the queued batched fills (``passes.batched_fills``) in one call of the sampler."""
        if self._queued:
            queued, self._queued, self._queued_elements = self._queued, [], 0
            try:
                with torch.no_grad():
                    self.sampler.fill_batch([(n, self.plan.batches.fills[n], t) for n, t in queued])
            except DeferredInitError:
                raise
            except Exception as exc:
                n = queued[0][0]
                raise DeferredInitError(
                    f"replaying the batched init-graph fills {', '.join(n.name for n, _ in queued[:3])}"
                    f"{' ...' if len(queued) > 3 else ''} failed: {type(exc).__name__}: {exc}",
                    op=str(n.target), module=n.meta.get("module"), source=getattr(n.meta.get("prov"), "source", None),
                    hint="please report it with the model") from exc

    def run_node(self, n: fx.Node) -> Any:
        """The value of ``n``: by the plan's decision about it, else by its kind."""
        if n in self.plan.fused_casts:
            return self.fused_cast(n, self.plan.fused_casts[n])
        if n in self.plan.reuse:
            return self.reuse(n, *self.plan.reuse[n])
        args, kwargs = self.fetch_args_kwargs(n)
        settings = self.settings.of(n)
        try:
            if settings is self.settings:  # ``run`` set them already
                return getattr(self, n.op)(n, args, kwargs)
            with settings_applied(settings):
                return getattr(self, n.op)(n, args, kwargs)
        except DeferredInitError:
            raise
        except Exception as exc:
            raise DeferredInitError(
                f"replaying init-graph node {n.name} failed: {type(exc).__name__}: {exc}",
                op=str(n.target), module=n.meta.get("module"), source=getattr(n.meta.get("prov"), "source", None),
                hint="the graph asks for an op these arguments do not allow; if it was recorded by "
                     "fxinit, please report it with the model") from exc

    def fetch_args_kwargs(self, n: fx.Node) -> tuple[tuple, dict]:
        """``n``'s arguments with values in place of nodes. A metadata-only node (``empty_like``)
        may have inputs that did not run (``passes.slicing``): an empty tensor of their spec
        stands in."""
        load = self._load_spec if metadata_only(n) else self._load
        args = fx.node.map_aggregate(n.args, load)
        kwargs = dict(fx.node.map_aggregate(n.kwargs, self._load))
        device_map = self.plan.device_map
        if device_map:
            for key in DEVICE_KWARGS:
                if kwargs.get(key) in device_map:
                    kwargs[key] = device_map[kwargs[key]]
        return args, kwargs

    def _load(self, a: Any) -> Any:
        return self.env[a] if isinstance(a, fx.Node) else a

    def _load_spec(self, a: Any) -> Any:
        if not isinstance(a, fx.Node) or a in self.env:
            return self._load(a)
        spec = a.meta["spec"]  # read for its metadata alone: nothing needs memory (``call_function``)
        return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")

    # ------------------------------------------------------------------ kinds of node
    def placeholder(self, n: fx.Node, args: tuple, kwargs: dict) -> Any:
        raise RuntimeError(f"fxinit: init graphs have no inputs, but {n.name} is a placeholder")

    def get_attr(self, n: fx.Node, args: tuple, kwargs: dict) -> torch.Tensor:
        """A graph constant, in a storage of its own (the graph keeps the original)."""
        return _copy(self.constants[n.target])

    def call_function(self, n: fx.Node, args: tuple, kwargs: dict) -> Any:
        if n in self.plan.unbacked:
            spec = n.meta["spec"]
            return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device="meta")
        if reads_no_data(n) and args and _stands_in(args[0]):
            spec = n.meta.get("spec")  # a meta stand-in's metadata: its own device is the one meant
            if kwargs.get("device") is None and spec is not None and spec.device.type != "meta":
                kwargs["device"] = self.plan.device_map.get(spec.device, spec.device)
            return _as_recorded(self._call(n, args, kwargs), spec)
        return self._call(n, args, kwargs)

    def _call(self, n: fx.Node, args: tuple, kwargs: dict) -> Any:
        if is_random(n):
            return self.random_op(n, args, kwargs)
        if n in self.plan.copies:
            return self.partial_copy(n, args, kwargs, self.plan.copies[n])
        if n in self.plan.constant_parts:
            return self.partial_constant(n, self.plan.constant_parts[n])
        fn = self.plan.in_place.get(n)
        if fn is not None:
            return fn(*replay_args(n.target, args), **kwargs)
        factory = _FACTORIES.get(id(n.target))
        if factory is not None and kwargs.get("device") is not None:  # no device context can move it
            return factory(*args, **kwargs)
        if reads_grad_mode(n.target) and not n.meta.get("no_grad"):
            with torch.enable_grad():  # (the replay's values need no graph: none of them requires grad)
                return n.target(*replay_args(n.target, args), **kwargs)
        return n.target(*replay_args(n.target, args), **kwargs)

    def partial_copy(self, n: fx.Node, args: tuple, kwargs: dict, ranges: Ranges) -> torch.Tensor:
        """A copy (``copy_``, ``clone``, ``_to_copy``, ``constant_pad_nd``) that writes only the
        storage elements ``ranges`` of its output (nothing reads the others, ``passes.demand``;
        a pad writes all of its padding), and draws the elements the plan forwards to it
        straight from their fills (``plan.forwards``)."""
        if n.target is aten.copy_.default:
            out = dst = args[0]
            src = args[1]
        else:
            spec = n.meta["spec"]
            device = self.plan.device_map.get(spec.device, spec.device)
            out = dst = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)
            src = args[0]
            if n.target is aten.constant_pad_nd.default:
                dst, src = _pad(out, src, args[1], args[2] if len(args) > 2 else kwargs.get("value", 0.0))
        if ranges:
            copy_ranges(dst, src, ranges)
        forwards = self.plan.forwards.get(n, ())
        if forwards:
            storage = _storage(out)
            for forward in forwards:
                self.sampler.fill_runs(forward.fill, forward.runs, storage)
        return out

    def partial_constant(self, n: fx.Node, ranges: Ranges) -> torch.Tensor:
        """A factory of a tensor of one value (``zeros``, ``new_full``) that writes only the
        storage elements ``ranges``: the others are overwritten before anything reads them."""
        spec = n.meta["spec"]
        device = self.plan.device_map.get(spec.device, spec.device)
        out = torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)
        if ranges:
            storage = _storage(out)
            value = constant_value(n)
            for lo, hi in ranges:
                storage[lo:hi].fill_(value)
        return out

    def random_op(self, n: fx.Node, args: tuple, kwargs: dict) -> Any:
        """A random node: only its pieces, in chunks, or whole, as the plan says."""
        pieces = self.plan.pieces.get(n)
        if pieces is not None:
            self.sampler.fill_pieces(n, args, kwargs, pieces)
            return args[filled_argument(n)]
        if n in self.plan.chunked:
            self.sampler.fill_chunks(n, args, kwargs)
            return args[filled_argument(n)]
        return self.sampler.call(n, args, kwargs)

    def reuse(self, n: fx.Node, first: fx.Node, copy: bool) -> Any:
        """CSE: the value of ``first``, which computed the same bits (copied if ``n`` needs a
        storage of its own)."""
        return _copy(self.env[first]) if copy else self.env[first]

    def fused_cast(self, n: fx.Node, fused: FusedCast) -> torch.Tensor:
        """The cast tensor of a fill-then-cast, without the full-precision tensor ever existing."""
        spec = fused.alloc.meta["spec"]
        out = torch.empty_strided(spec.shape, spec.stride, dtype=fused.dtype, device=spec.device)
        self.sampler.fill_cast(fused, out)
        return out


def copy_ranges(dst: torch.Tensor, src: torch.Tensor, ranges: Ranges) -> None:
    """``dst.copy_(src)`` for the storage elements ``ranges`` of ``dst`` only, one copy per
    piece where both views run contiguously (all of ``dst`` where the layouts are not followed)."""
    moves = None
    if dst.shape == src.shape:
        moves = intervals.correspondence(intervals.of(ranges), tuple(dst.shape), dst.stride(), src.stride(),
                                         dst.storage_offset(), src.storage_offset())
    if moves is None:
        dst.copy_(src)
        return
    pieces, shifts = moves
    for (lo, hi), shift in zip(pieces.tolist(), shifts.tolist()):
        dst.as_strided((hi - lo,), (1,), lo).copy_(src.as_strided((hi - lo,), (1,), lo + shift))


def _pad(out: torch.Tensor, src: torch.Tensor, pad: Sequence[int], value: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """``constant_pad_nd``'s padding written into ``out``; the views of ``out`` and of its
    input ``src`` between which it copies (a negative pad crops the input)."""
    dst, region = out, src
    for i in range(len(pad) // 2):
        d = out.dim() - 1 - i
        before, after = pad[2 * i], pad[2 * i + 1]
        if before > 0:
            out.narrow(d, 0, before).fill_(value)
        if after > 0:
            out.narrow(d, out.shape[d] - after, after).fill_(value)
        size = src.shape[d] - max(-before, 0) - max(-after, 0)
        region = region.narrow(d, max(-before, 0), size)
        dst = dst.narrow(d, max(before, 0), size)
    return dst, region


def _storage(t: torch.Tensor) -> torch.Tensor:
    """All of ``t``'s storage as a 1-D tensor of its dtype."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())


def _copy(value: Any) -> Any:
    """A copy of a tensor with the same strides, in a storage of its own."""
    return copy_with_strides(value) if isinstance(value, torch.Tensor) else value


def _cast(value: Any, dtype: torch.dtype | None) -> Any:
    if isinstance(value, torch.Tensor) and dtype_after_to(value.dtype, dtype) != value.dtype:
        return value.to(dtype)
    return value
