"""Exact replay of init-graph nodes with PyTorch's own kernels.

Each node runs the aten op it recorded, on the device eager construction would have
used, in program order. Random ops draw from a private generator restored from the
snapshot taken at capture, so the user's generators are neither read nor changed and
any subset of nodes can run alone.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.fx as fx

from fxinit.backends.fused import run_fused, runnable
from fxinit.backends.partial import fill_piece_exact, fill_whole_in_chunks
from fxinit.backends.portable import call_portable, fill_piece_portable
from fxinit.errors import DeferredInitError
from fxinit.spec import dtype_after_to
from fxinit.ops import replay_args
from fxinit.passes.cast_fusion import cast_points, fused_casts
from fxinit.passes.cse import common_subexpressions
from fxinit.passes.inplace import in_place_chains
from fxinit.passes.partition import independent_groups
from fxinit.passes.ranges import partial_fills
from fxinit.passes.slicing import metadata_only
from fxinit.rng import Snapshot, private_generator, swapped_default_generators
from fxinit.rng.snapshot import resolve
from fxinit.rng.portable import serial_fills


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    saved = torch.get_default_dtype()
    if saved == dtype:
        yield
        return
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _last_uses(nodes: Sequence[fx.Node], shared: Mapping[fx.Node, tuple[fx.Node, bool]]) -> dict[fx.Node, list[fx.Node]]:
    """For each node, the values that can be dropped once it ran (a value nothing uses,
    such as an in-place op's result, right after its own node); a value reused by CSE
    (``shared``) lives until its last reuse."""
    last: dict[fx.Node, fx.Node] = {n: n for n in nodes}
    for n in nodes:
        for inp in n.all_input_nodes:
            last[inp] = n
        if n in shared:
            last[shared[n][0]] = n
    drops: dict[fx.Node, list[fx.Node]] = {}
    for value, user in last.items():
        drops.setdefault(user, []).append(value)
    return drops


def run_nodes(
    nodes: Sequence[fx.Node],
    constants: Mapping[str, torch.Tensor],
    rng: Mapping[str, Snapshot],
    default_dtype: torch.dtype,
    keep: set[fx.Node] | None = None,
    device_map: Mapping[torch.device, torch.device] | None = None,
    streams: Mapping[fx.Node, int] | None = None,
    output_dtype: torch.dtype | None = None,
    shared: Mapping[fx.Node, tuple[fx.Node, bool]] | None = None,
    exposed: Mapping[fx.Node, tuple[int, int]] | None = None,
) -> dict[fx.Node, object]:
    """Execute ``nodes`` (a slice in program order); return the values of ``keep``.

    ``device_map`` replaces intended devices that are not available here; capture only
    allows that for graphs whose ops on those devices draw no random numbers.
    ``streams`` (portable mode) gives each random node its portable stream instead of
    its recorded generator snapshot. ``output_dtype`` casts the floating-point and complex
    values of ``keep`` (as ``Module.to(dtype)`` would), each as soon as nothing reads it any more.
    ``shared`` is the CSE map of ``nodes`` when the caller already has it. ``exposed``: kept
    nodes of which the caller reads only this storage extent (``passes.ranges``); random
    fills are restricted to it where they can be, elements outside it are left
    uninitialized, and these values are not cast to ``output_dtype`` (the caller casts
    the part it reads).
    """
    exposed = exposed or {}
    keep = keep if keep is not None else set(nodes)
    env: dict[fx.Node, object] = {}
    if shared is None:
        shared = common_subexpressions(nodes, keep)  # duplicate -> (first, needs a copy)
    in_place = in_place_chains(nodes, keep, shared)  # element-wise ops on dying temporaries
    drops = _last_uses(nodes, shared)
    pieces = partial_fills(nodes, keep, exposed)  # random fills of which only a range is read
    fused = runnable(fused_casts(nodes, keep, output_dtype), rng, streams)  # fill-then-cast, in chunks
    fused = {f: p for f, p in fused.items() if not exposed.keys() & {*p.members, *p.results}}
    skipped = {m for plan in fused.values() for m in plan.members} - set(fused)
    done_in_dtype = {r for plan in fused.values() for r in plan.results}
    casts = cast_points(nodes, set(keep) - done_in_dtype - set(exposed), shared) if output_dtype is not None else {}

    def load(a: object) -> object:
        return env[a] if isinstance(a, fx.Node) else a

    def load_spec(a: object) -> object:  # inputs of metadata-only nodes may not have run (passes.slicing)
        if not isinstance(a, fx.Node) or a in env:
            return load(a)
        spec = a.meta["spec"]
        device = device_map.get(spec.device, spec.device) if device_map else spec.device
        return torch.empty_strided(spec.shape, spec.stride, dtype=spec.dtype, device=device)

    with torch.no_grad(), _default_dtype(default_dtype):
        for n in nodes:
            if n in skipped:
                pass
            elif n in fused:
                out = run_fused(fused[n], rng, streams)
                env.update((r, out) for r in fused[n].results)
            elif n in shared:
                first, copy = shared[n]
                value = _copy(env[first]) if copy else env[first]
            elif n.op == "get_attr":
                value = _copy(constants[n.target])
            elif n.op == "call_function":
                args = fx.node.map_aggregate(n.args, load_spec if metadata_only(n) else load)
                kwargs = dict(fx.node.map_aggregate(n.kwargs, load))
                if device_map and kwargs.get("device") in device_map:
                    kwargs["device"] = device_map[kwargs["device"]]
                rng_keys = n.meta.get("generators")
                node_dtype = n.meta.get("default_dtype", default_dtype)
                try:
                    with _default_dtype(node_dtype):
                        if n in pieces and _fill_piece(n, args, kwargs, rng, streams, pieces[n]):
                            value = args[0]
                        elif rng_keys and streams is not None:
                            value = call_portable(n, args, kwargs, streams[n])
                        elif rng_keys and fill_whole_in_chunks(n, args, kwargs, rng):
                            value = args[0]
                        elif rng_keys:
                            value = _with_rng(n.target, args, kwargs, rng_keys, rng, "generator")
                        else:
                            value = in_place.get(n, n.target)(*replay_args(n.target, args), **kwargs)
                except DeferredInitError:
                    raise
                except Exception as exc:
                    raise DeferredInitError(
                        f"replaying init-graph node {n.name} failed: {type(exc).__name__}: {exc}",
                        op=str(n.target), module=n.meta.get("module"),
                        source=getattr(n.meta.get("prov"), "source", None),
                        hint="the graph asks for an op these arguments do not allow; if it was recorded by "
                             "fxinit, please report it with the model") from exc
            else:
                raise RuntimeError(f"fxinit cannot run init-graph node of kind {n.op!r}")
            if n not in skipped and n not in fused:
                env[n] = value
            for k in casts.get(n, ()):
                env[k] = _cast(env[k], output_dtype)
            for dead in drops.get(n, ()):
                if dead not in keep:
                    env.pop(dead, None)
    return {n: env[n] for n in keep if n in env}


def _copy(value: object) -> object:
    """A copy of a tensor with the same strides, in a storage of its own."""
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.size(), value.stride(), dtype=value.dtype, device=value.device).copy_(value)


def _cast(value: object, dtype: torch.dtype) -> object:
    if isinstance(value, torch.Tensor) and dtype_after_to(value.dtype, dtype) != value.dtype:
        return value.to(dtype)
    return value


def _fill_piece(n: fx.Node, args: tuple, kwargs: dict, rng: Mapping[str, Snapshot],
                streams: Mapping[fx.Node, int] | None, ranges: list[tuple[int, int]]) -> bool:
    """Fill only the elements in ``ranges`` of random node ``n``'s target; False if it must run whole."""
    if streams is not None:
        return fill_piece_portable(n, args, kwargs, streams[n], ranges)
    return fill_piece_exact(n, args, kwargs, rng, ranges)


def run_parallel(
    nodes: Sequence[fx.Node],
    constants: Mapping[str, torch.Tensor],
    rng: Mapping[str, Snapshot],
    default_dtype: torch.dtype,
    keep: set[fx.Node],
    device_map: Mapping[torch.device, torch.device] | None = None,
    workers: int | None = None,
    streams: Mapping[fx.Node, int] | None = None,
    output_dtype: torch.dtype | None = None,
    exposed: Mapping[fx.Node, tuple[int, int]] | None = None,
) -> dict[fx.Node, object]:
    """``run_nodes`` group by group: independent groups of nodes, on ``workers`` threads.

    Exact in any order and interleaving: groups share no value and no storage, and every
    random op draws from its own snapshot. Running a group to its end before the next
    starts also bounds memory: a model allocates all its tensors before it initializes any
    (``post_init``), and a layout step (a rank's shard copied out of a full tensor) comes
    after all of that, so program order would hold every full tensor at once. Slices whose
    ops were recorded under different default dtypes run on one thread (the default dtype
    is process-global).
    """
    workers = workers or torch.get_num_threads()
    if streams is None:  # exact mode: compute the snapshots' states in program order, one short jump each
        resolve([rng[k] for n in nodes for k in n.meta.get("generators", {}).values()])
    dtypes = {n.meta.get("default_dtype", default_dtype) for n in nodes}
    shared = common_subexpressions(nodes, keep)
    # a CSE duplicate runs in the group of the value it reuses
    groups = independent_groups(nodes, [(dup, first) for dup, (first, _) in shared.items()])
    if len(groups) < 2:
        return run_nodes(nodes, constants, rng, default_dtype, keep, device_map, streams, output_dtype, shared,
                         exposed)
    jobs = [(g, {d: v for d, v in shared.items() if d in members}) for g, members in ((g, set(g)) for g in groups)]
    env: dict[fx.Node, object] = {}
    if workers == 1 or len(dtypes) > 1:
        for g, group_shared in jobs:
            env.update(run_nodes(g, constants, rng, default_dtype, keep, device_map, streams, output_dtype,
                                 group_shared, exposed))
        return env
    (dtype,) = dtypes
    run = _serial_fills(run_nodes) if len(groups) >= workers else run_nodes  # every core has a group
    with _default_dtype(dtype), ThreadPoolExecutor(min(workers, len(groups)), "fxinit") as pool:
        futures = [pool.submit(run, g, constants, rng, dtype, keep, device_map, streams, output_dtype, group_shared,
                               exposed)
                   for g, group_shared in jobs]
        for f in futures:
            env.update(f.result())
    return env


def _serial_fills(fn: Callable[..., dict]) -> Callable[..., dict]:
    def run(*args: object) -> dict:
        with serial_fills():
            return fn(*args)
    return run


# Code that draws from the default generators implicitly must not overlap with other
# such code: the swap of the process-wide generator state would be seen by both.
_DEFAULT_GENERATORS = threading.Lock()


def _with_rng(fn: Callable[..., object], args: tuple, kwargs: dict, keys: Mapping[str, str],
              rng: Mapping[str, Snapshot], generator_kw: str) -> object:
    """Call ``fn`` drawing from the recorded snapshots: a private generator passed in, and
    the default generators temporarily set for code that draws from them implicitly."""
    if "gen" in keys:
        kwargs[generator_kw] = private_generator(rng[keys["gen"]])
    defaults = {k: rng[v] for k, v in keys.items() if k.startswith("default:")}
    if not defaults:
        return fn(*args, **kwargs)
    with _DEFAULT_GENERATORS, swapped_default_generators(defaults):
        return fn(*args, **kwargs)
