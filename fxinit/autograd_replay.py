"""The replay of the links ``fxinit.autograd_links`` planned: each kept tensor's recorded ops run
again on the real parameters with autograd on, after the swap (``relink``), so that it has
eager's ``grad_fn`` as well as eager's bits.

A kept tensor whose ops meet those of one rebuilt before it (``b7 = self.b0.clone()`` beside
``self.b0 = torch.sigmoid(self.lin.bias)``; a temporary both read) takes what those ops
computed, so that the graphs share autograd nodes as eager's do (one ``SigmoidBackward0``
taking the summed gradient: eager's last bit; a view of it a view of it), but for the storages
its own ops write in place, which it computes itself. A real tensor the replayed ops write (one
materialized in this call, a detached alias of the kept one) holds eager's write already: they
write a copy. A parameter written or rebound since eager's ops read it holds its value then
(``.data =``) while the ops run, and gets its own data back the same way: the ops save the
parameter itself with its version unchanged, so a backward sees it as it is now, as eager's
does after a ``.data`` write (where eager wrote in place otherwise, its backward through an op
that saved the parameter raises; this one runs).
"""

from __future__ import annotations

import contextlib
import threading
import warnings
from collections import Counter
from typing import AbstractSet, Any, Sequence

import torch
import torch.fx as fx

from fxinit.autograd_links import Link, roots_written_by, written_roots
from fxinit.capture.deferred import RETAINS_GRAD, dressed_as, is_deferred_tensor
from fxinit.capture.grad_hooks import HOOK_DICTS, UNTRACKED, backward_hooks, clear_hooks, register_hook_dict
from fxinit.capture.swap import swap
from fxinit.grad_graphs import graph_signature, signatures_match
from fxinit.numerics import Settings, settings_applied
from fxinit.ops import is_view
from fxinit.passes.roots import storage_root


def relink(links: list[Link], made: Sequence[torch.Tensor] = ()) -> None:
    """Rebuild each planned tensor from the now real parameters (after the swap; ``made``: the
    tensors the call materialized). The ops run
    in eager's order, so that autograd numbers its functions as eager's (a backward through
    several such tensors adds their gradients in eager's order, to eager's bits); the swaps go
    the other way, the ones computed last first: an older ``grad_fn`` of a later tensor holds
    the earlier tensors it read, and swapping those waits until it is gone."""
    rebuilt = []
    lost = []
    _REGISTERED.ids = []
    shared: dict[fx.Node, Any] = {}  # what the ops of rebuilt tensors computed, unwritten: later ones read it
    holders = Counter(p for p in map(_memory, made) if p) if links else Counter()
    bound: Bound = {}
    try:
        _replay_all(links, shared, holders, bound, rebuilt, lost)
    finally:
        _unbind(bound, list(bound))
    _swap_rebuilt(links, rebuilt, lost)


#: Parameters holding a value then (``.data =``) across the replays of one ``relink``, by id:
#: ``(parameter, its own data)``. Giving a parameter its own data back between two replays would
#: start another ``AccumulateGrad`` where the dtype differs (``materialize(dtype=)``), where
#: eager's graphs, all made before ``Module.to``, share one.
Bound = dict[int, tuple[torch.Tensor, torch.Tensor]]


def _unbind(bound: Bound, ids: list[int], advance: bool = False) -> None:
    """Give the parameters of ``ids`` their own data back (last bound first), ``advance``: their versions advanced."""
    for key in reversed(ids):
        if key in bound:
            p, data = bound.pop(key)
            p.data = data
            if advance:
                torch.autograd.graph.increment_version(p)


def _replay_all(links: list[Link], shared: dict[fx.Node, Any], holders: Counter[int], bound: Bound,
                rebuilt: list[tuple[torch.Tensor, torch.Tensor]], lost: list[str]) -> None:
    for link in sorted(links, key=_made):
        if any(is_deferred_tensor(p) or (p.grad_fn is not None and node.op != "get_attr")  # (a real tensor lifted)
               for node, p in link.leaves.items()):
            lost.append(f"{link.eager}, materialized before the parameters it was computed from")
            continue
        if is_deferred_tensor(link.tensor):  # its swap failed (weak references): the module holds another object
            lost.append(f"{link.eager}, which could not be swapped in place")
            continue
        written = roots_written_by(link.nodes)
        if link.overwritten:  # (written after, not by autograd: its values copied in)
            written.add(storage_root(link.result if link.result is not None else link.nodes[-1]))
        computed: dict[fx.Node, Any] = {}
        value = _replayed(link, shared, written, holders, computed, bound) if link.nodes else None
        if value is None:  # the tensor keeps its right value, as a leaf
            lost.append(link.eager)
            continue
        if not value._is_view():  # (a view of a parameter is one already)
            value.data = link.tensor.data  # the same bits: its memory, which others may share (an alias)
        shared.update((n, v) for n, v in computed.items() if storage_root(n) not in written)
        rebuilt.append((link.tensor, value))


def _swap_rebuilt(links: list[Link], rebuilt: list[tuple[torch.Tensor, torch.Tensor]], lost: list[str]) -> None:
    cast = {id(link.tensor) for link in links if link.cast_to is not None}
    _warn_hooks_run_on_parts(Counter(_REGISTERED.ids) + Counter(  # (and the hooks ``dressed_as`` carries)
        id(d) for t, _ in rebuilt if id(t) not in cast and (d := backward_hooks(t)) is not None))
    kept = {id(t) for t, _ in rebuilt}
    for link in links:
        if id(link.tensor) not in kept:
            link.tensor.__dict__.pop(RETAINS_GRAD, None)  # (a leaf now: it retains nothing more)
    if lost:
        warnings.warn(f"fxinit: {len(lost)} tensor(s) computed with autograd from parameters keep eager's values but "
                      f"not eager's grad_fn ({'; '.join(lost[:3])}{' ...' if len(lost) > 3 else ''}), so a backward "
                      "through them does not reach the parameters: compute them in forward or after materialize "
                      "(docs/failure-modes.md says which ones fxinit cannot rebuild)", stacklevel=6)
    while rebuilt:
        t, value = rebuilt.pop()
        if id(t) in cast:  # eager's ``.to`` made another tensor: the hooks and ``retain_grad`` stay behind
            clear_hooks(t)
            t.__dict__.pop(RETAINS_GRAD, None)
        new = dressed_as(t, value, keep_autograd=True)
        del value
        try:
            swap(t, new, saved=True)
        except RuntimeError as exc:
            warnings.warn(f"fxinit: a tensor computed with autograd from parameters keeps its value but not its "
                          f"grad_fn ({exc}): compute it after materialize to have eager's", stacklevel=6)
        else:
            if t.__dict__.pop(RETAINS_GRAD, None):  # ``retain_grad()`` in the constructor (its hook: after the swap)
                t.retain_grad()
        del new


def _memory_shared_elsewhere(t: torch.Tensor, view: torch.Tensor, holders: Counter[int]) -> bool:
    """Whether ``view`` (``t`` rebuilt as a view) is not over ``t``'s memory, which another tensor
    of the model holds too (``holders``: how many of the tensors the call materialized are over
    each storage; ``b4 = b0.t()`` kept beside a kept ``b0 = w.clone()``: ``b4`` replayed from a
    clone of its own), or is over memory another tensor the call materialized holds (a view of
    a rebuilt ``b0`` where ``dtype=`` gave each its own memory, as eager's ``.to`` does). A view
    of a parameter is over the parameter's memory; a view of a temporary (``(w * 2).t()``, an
    LSTM's ``batch_first`` output) has that memory to itself."""
    ptr, mine = t.untyped_storage().data_ptr(), view.untyped_storage().data_ptr()
    return mine != ptr and (holders[ptr] > 1 or holders[mine] > 0)


def _memory(t: torch.Tensor) -> int:
    """The address of ``t``'s memory (0 for none: meta, empty, a wrapper subclass's)."""
    try:
        return 0 if t.is_meta else t.untyped_storage().data_ptr()
    except RuntimeError:
        return 0


def _made(link: Link) -> int:
    node = link.result if link.result is not None else link.nodes[-1] if link.nodes else None
    return node.meta["pos"] if node is not None else 0


def _replayed(link: Link | None, shared: dict[fx.Node, Any], written: AbstractSet[fx.Node], holders: Counter[int],
              computed: dict[fx.Node, Any], bound: Bound) -> torch.Tensor | None:
    """``link``'s tensor rebuilt with eager's bits, ``grad_fn`` graph and memory (or its
    fallback's), or None. What the ops of tensors rebuilt before it computed stands for those
    ops (``shared``), so that its graph has their autograd nodes, as eager's does (``computed``:
    what its own ops computed so, where that replay is the one returned), but for ops over the
    storages its own ops write (``written``); where that replay is not eager's (a view over
    memory another tensor holds), it runs again from the parameters alone."""
    first = link
    registered = len(_REGISTERED.ids)
    while link is not None:
        for reading in (shared, {}) if shared else (shared,):
            env: dict[fx.Node, Any] = {}
            del _REGISTERED.ids[registered:]  # (those of a replay not taken)
            try:
                with torch.enable_grad():
                    given = {n: v for n, v in reading.items() if storage_root(n) not in written} \
                        if written and reading else reading
                    value = _run(link, given, env, bound)
                    replayed = graph_signature(value, _rebound(bound)) if link.signature is not None else None
                    if _reaches_leaves_a_cast_left(replayed, link):
                        env.clear()
                        value = _run(link, given, env, bound, regenerate=True)
                        replayed = graph_signature(value, _rebound(bound))
                if link.overwritten and _same_layout(value, link.tensor):  # written after, not by autograd (the
                    value.data.copy_(link.tensor)                          # signature says): its values, its version
                if _same(value, link.tensor) and (link.signature is None or signatures_match(
                        replayed, link.signature)) and not (
                        value._is_view() and _memory_shared_elsewhere(link.tensor, value, holders)):
                    if link is first and reading is shared:
                        computed.update(env)
                    return value
            except Exception:  # noqa: BLE001
                pass
        link = link.fallback
    del _REGISTERED.ids[registered:]
    return None


def _rebound(bound: Bound) -> set[int]:
    """The bound parameters whose own data is of another dtype or device than the value they hold."""
    return {key for key, (p, data) in bound.items() if (data.dtype, data.device) != (p.dtype, p.device)}


def _reaches_leaves_a_cast_left(replayed: list | None, link: Link) -> bool:
    """Whether the replayed graph (its ``graph_signature``) is eager's but for ``AccumulateGrad``
    functions that a cast of a parameter since (``.data =`` of another dtype) left behind, where
    eager's reach the ones it started: views eager read after the cast (``_run``'s ``regenerate``)."""
    if replayed is None or link.signature is None or not link.earlier:
        return False
    return not signatures_match(replayed, link.signature) and signatures_match(replayed, link.signature,
                                                                               reached_now=False)


def _run(link: Link, shared: dict[fx.Node, Any], env: dict[fx.Node, Any], bound: Bound,
         regenerate: bool = False) -> torch.Tensor:
    """``link``'s ops on its leaves. A leaf frozen since eager's ops ran (``requires_grad_(False)``
    after construction) requires grad while they run, as it did then; a parameter written or
    rebound since holds its value then (``earlier``) through ``.data =``, and its own data again
    once the ``relink`` ends (``Bound``), so that what the ops saved is the parameter itself, its version unchanged, as
    eager's was after a ``.data`` write or ``Module.to``. With ``regenerate``, it gets its own
    data back, its version advanced, once the views of it are made: the first op reading one
    then regenerates the view's function from the parameter as it is now (``AsStridedBackward0``
    reaching the ``AccumulateGrad`` a cast started), as eager's read after the parameter was
    written and cast (``self.b = self.w.expand(2)``, ``self.w`` filled under no_grad, then
    ``Module.double()``)."""
    assert link.value_of is not None or not (link.earlier or link.values)
    values = {node: link.value_of(node, reader) for node, reader in link.values.items()}  # type: ignore[misc]
    then = {node: link.value_of(node, reader) for node, reader in link.earlier.items()}  # type: ignore[misc]
    frozen = [p for p in link.reached if not p.requires_grad and p.grad_fn is None]
    leaves, mine = {id(p) for p in link.leaves.values()}, {id(link.leaves[node]) for node in then}
    _unbind(bound, [key for key in bound if key in leaves and key not in mine])  # (read as they are now)
    for node, value in then.items():
        p = link.leaves[node]
        bound.setdefault(id(p), (p, p.data))
        p.data = value  # its storage, dtype and shape then (``.double()`` since rebinds as eager's did)
    for p in frozen:
        p.requires_grad_(True)
    try:
        return _run_ops(link, values, shared, env, bound, [id(link.leaves[node]) for node in then] if regenerate else [])
    finally:
        for p in frozen:
            p.requires_grad_(False)


def _run_ops(link: Link, values: dict[fx.Node, torch.Tensor], shared: dict[fx.Node, Any],
             computed: dict[fx.Node, Any], bound: Bound, restored: list[int]) -> torch.Tensor:
    """``link``'s ops, each once: what ``shared`` holds for one (another rebuilt tensor's replay
    computed it) is taken, not run again; ``computed`` gets what each op gave. ``restored``:
    parameters given their data back, their versions advanced, before the first op not a view."""
    env: dict[fx.Node, Any] = {**link.leaves, **values}
    writes = roots_written_by(link.nodes)
    for node in link.leaves:
        if (node.op == "get_attr" and node in link.written) or \
                (storage_root(node) in writes and node not in link.earlier):
            # a constant the ops write: theirs to write; a real tensor (one materialized in this call, a
            # detached alias of this one) holds eager's write already: a copy takes it again
            env[node] = env[node].clone()

    def value(x: Any) -> Any:
        return env[x] if isinstance(x, fx.Node) else x

    final = backward_hooks(link.tensor) if link.cast_to is None else None  # (``dressed_as`` carries those)
    hooks = sorted(((at, i, node, d) for i, node in enumerate(link.nodes) for at, d in node.meta.get(HOOK_DICTS, ())
                    if d is not final and node not in shared and not _regenerated_since(node, at, link.nodes)),
                   key=lambda h: h[:2])
    settings = link.settings or Settings(torch.get_default_dtype(), None)
    with settings_applied(settings):
        for node in link.nodes:
            while hooks and hooks[0][0] <= node.meta["pos"]:  # registered before this op ran
                _register(hooks.pop(0), env)
            if node in shared:
                env[node] = computed[node] = shared[node]
                continue
            if restored and not is_view(node):
                _unbind(bound, restored, advance=True)
                restored = []
            args = fx.node.map_aggregate(node.args, value)
            kwargs = fx.node.map_aggregate(node.kwargs, value)
            mine = settings.of(node)
            behind = args[0] if node.meta.get(UNTRACKED) and args and isinstance(args[0], torch.Tensor) else None
            if behind is not None:  # written through ``.data``: autograd saw nothing, nor does the version change
                args = (behind.data, *args[1:])
            with torch.set_grad_enabled(not node.meta.get("no_grad")), \
                    contextlib.nullcontext() if mine is settings else settings_applied(mine):  # as eager ran it
                out = node.target(*args, **kwargs)
            env[node] = computed[node] = out if behind is None else behind
    for hook in hooks:
        _register(hook, env)
    result = env[link.result if link.result is not None else link.nodes[-1]]
    return result if link.cast_to is None else result.to(link.cast_to)  # (eager's ``Module.to``, autograd on)


def _regenerated_since(node: fx.Node, at: int, replayed: list[fx.Node]) -> bool:
    """Whether eager gave the view ``node`` another ``grad_fn`` after position ``at``, dropping the
    hooks registered on the one before: a write to its storage under no_grad that the replay does
    not run (it regenerates the view's function; one the replay runs does so here too)."""
    if not is_view(node):
        return False
    root = storage_root(node)
    return any(w.meta.get("mutates") and w.meta.get("no_grad") and w.meta["pos"] > at and w not in replayed
               and root in written_roots(w) for w in node.graph.nodes)


def _register(hook: tuple[int, int, fx.Node, dict], env: dict[fx.Node, Any]) -> None:
    """A hook dict the capture noted (``HOOK_DICTS``) on the replayed tensor of its node, as it is now."""
    _, _, node, hooks = hook
    if isinstance(t := env.get(node), torch.Tensor) and t.grad_fn is not None:
        register_hook_dict(t, hooks)
        _REGISTERED.ids.append(id(hooks))


#: ``ids``: the hook dicts the replays ``relink`` took registered (by ``id``), per thread
_REGISTERED = threading.local()


def _warn_hooks_run_on_parts(registered: Counter[int]) -> None:
    """Say so where a hook dict went on more than one rebuilt node: tensors that eager's graphs share
    one node of, rebuilt apart (a storage the ops of more than one write in place), run the hook on
    each part of the gradient, where eager's runs once on their sum (the same for a hook linear in it)."""
    if any(n > 1 for n in registered.values()):
        warnings.warn("fxinit: a gradient hook registered on a tensor that several kept tensors were computed from "
                      "runs on each one's part of the gradient, where eager's runs once on their sum (the same "
                      "gradient for a hook linear in it, such as a mask or a scale): register it after materialize "
                      "for eager's (docs/failure-modes.md)", stacklevel=6)


def _same_layout(value: torch.Tensor, t: torch.Tensor) -> bool:
    return isinstance(value, torch.Tensor) and value.shape == t.shape and value.dtype == t.dtype \
        and value.stride() == t.stride() and value.device == t.device


def _same(value: torch.Tensor, t: torch.Tensor) -> bool:
    """``value`` is what materialize put into ``t`` (bits, shape, strides)."""
    if not _same_layout(value, t):
        return False
    if t.is_meta:  # (``self.t = self.w.to("meta")``: no values, in eager either)
        return value.is_meta
    a, b = value.detach(), t.detach()
    if a.dtype == torch.bool:
        return torch.equal(a, b)
    return torch.equal(_bytes(a), _bytes(b))


def _bytes(x: torch.Tensor) -> torch.Tensor:
    return x.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)
