"""Checking a model of your own: fxinit's build against eager construction, bit for bit.

``check(fn, *args, seed=0, **kwargs)`` builds the model twice — eagerly
(``torch.manual_seed(seed); fn(*args, **kwargs)``) and with fxinit (``trace_init`` then
``materialize``) — compares every tensor reachable from the two modules and where each
build leaves the global generator, and returns a ``CheckReport``: equal, different (the
first tensor that differs, how, which op made it and at which source line, what to do), or
refused (fxinit raised ``DeferredInitError``: its message). fxinit promises eager's bits or
that error, so a "different" is either a constructor that is not deterministic (a second
eager build tells, and the report says which) or a bug in fxinit to report.

Both models are built whole, so a check needs the memory of two copies: check a small
config of the model. The user's global generators are left as they were.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.fx as fx
from torch.nn.parameter import is_lazy

from fxinit.capture import trace_init
from fxinit.capture.deferred import is_deferred_tensor, state_of
from fxinit.errors import DeferredInitError
from fxinit.extract import init_graph
from fxinit.graph import InitGraph
from fxinit.materialize import materialize
from fxinit.ops import op_name
from fxinit.reachable import module_slots
from fxinit.report import _short_path

EQUAL, DIFFERENT, REFUSED = "equal", "different", "refused"
FAILURE_MODES = "docs/failure-modes.md"
_RNG_PROBE = 3  # torch.rand(3) after each build: where it left the global generator
_PLUMBING = {"detach", "alias"}


@dataclass
class Divergence:
    """How one tensor of fxinit's build differs from eager construction's.

    ``what``: ``"values"``, ``"shape"``, ``"dtype"``, ``"device"``, ``"stride"``,
    ``"type"`` (Parameter or not, exact class), ``"requires_grad"``, ``"grad_fn"`` (computed
    with autograd in one build only, or by another op), ``"attributes"`` (the names in its
    ``__dict__``: what code set on it), ``"deferred"`` (still
    deferred after ``materialize``), ``"meta"`` (a plain meta tensor where eager has data),
    ``"tie"`` (one object with other names in one build only), ``"storage"`` (memory shared
    with other names, or a storage's size, not as eager's), ``"missing"`` (eager has the
    name, fxinit's build does not) or ``"extra"`` (the other way round)."""

    name: str
    what: str
    detail: str  # in words: "3 of 64 elements differ, max abs difference 0.0417"
    differing: int | None = None  # elements whose bits differ (what == "values")
    numel: int | None = None
    max_abs_diff: float | None = None  # over differing elements where neither is NaN


@dataclass
class CheckReport:
    """What ``check`` found. ``status``: ``"equal"``, ``"different"`` or ``"refused"``."""

    status: str
    target: str
    seed: int
    tensors_checked: int = 0  # names compared: state dict, non-persistent buffers, tensor attributes
    divergent: int = 0  # how many of them differ
    first_divergent: Divergence | None = None
    source: str | None = None  # the op that last wrote it: "normal_: by torch.nn.init.normal_, ..., at model.py:12"
    provenance: str | None = None  # InitGraph.explain of it: every op, init function, module, line
    rng_after_equal: bool | None = None  # None: not checked (rng_after=False, or refused)
    eager_deterministic: bool | None = None  # when different: a second eager build equals the first (but for
    # the uninitialized tensors)
    uninitialized: list[str] = field(default_factory=list)  # names whose values differ, no op writes them
    message: str | None = None  # when refused: the DeferredInitError's message
    hint: str | None = None  # what to do

    @property
    def ok(self) -> bool:
        return self.status == EQUAL

    def __str__(self) -> str:
        head = f"fxinit check {self.target} (seed {self.seed}): {self.status.upper()}"
        if self.status == REFUSED:
            said = [m for m in (self.message or "").splitlines() if not m.strip().startswith("hint:")]
            lines = [f"{head}: fxinit raised DeferredInitError", *("  " + m for m in said)]
        else:
            rng = {None: "", True: "; the global RNG is where eager construction leaves it",
                   False: "; the global RNG is NOT where eager construction leaves it"}[self.rng_after_equal]
            if self.status == EQUAL:
                lines = [f"{head}: {self.tensors_checked} tensors bit for bit{rng}"]
            else:
                lines = [f"{head}: {self.divergent} of {self.tensors_checked} tensors differ{rng}"]
        d = self.first_divergent
        if d is not None:
            lines.append(f"first divergent: {d.name}: {d.what}: {d.detail}")
        if self.source:
            lines.append(f"made by: {self.source}")
        if self.provenance:
            lines.append("how fxinit initializes it:")
            lines += ["  " + line for line in self.provenance.splitlines()]
        if self.eager_deterministic is not None:
            but = ", but for the tensors no op writes" if self.uninitialized else ""
            lines.append(f"eager construction is deterministic: a second eager build is bit for bit the first{but}"
                         if self.eager_deterministic else
                         "eager construction is NOT deterministic: a second eager build with the same seed differs")
        if self.hint:
            lines.append(f"hint: {self.hint}")
        return "\n".join(lines)


def check(fn: Callable[..., torch.nn.Module], *args: Any, seed: int = 0, rng_after: bool = True,
          **kwargs: Any) -> CheckReport:
    """Build ``fn(*args, **kwargs)`` eagerly and with fxinit from ``torch.manual_seed(seed)``
    and compare them bit for bit (see the module docstring); ``rng_after``: also compare a
    ``torch.rand(3)`` drawn after each build. Exceptions of ``fn`` itself propagate; the global
    generators (CPU, and CUDA's when available) are restored afterwards. ``seed`` and
    ``rng_after`` are this function's: pass a constructor's own arguments of those names
    through a ``lambda``."""
    target = _target_name(fn)
    saved = _rng_states()
    try:
        eager, eager_rng = _build_eager(fn, args, kwargs, seed, rng_after)
        torch.manual_seed(seed)
        try:
            model = trace_init(fn, *args, **kwargs)
            nodes = _deferred_nodes(model)
            graph = _graph_or_none(model)  # before materializing: afterwards nothing is deferred
            materialize(model)
        except DeferredInitError as exc:
            return CheckReport(REFUSED, target, seed, message=str(exc), hint=_refusal_hint(exc))
        ours_rng = torch.rand(_RNG_PROBE) if rng_after else None
        want, got = reachable_tensors(eager), reachable_tensors(model)
        found = compare_builds(got, want)
        rng_equal = None if eager_rng is None else torch.equal(eager_rng, ours_rng)  # type: ignore[arg-type]
        report = CheckReport(EQUAL, target, seed, tensors_checked=len(want.keys() | got.keys()),
                             divergent=len(found), first_divergent=found[0] if found else None,
                             rng_after_equal=rng_equal)
        if not found and rng_equal is not False:
            return report
        report.status = DIFFERENT
        unset = set(graph.uninitialized()) if graph is not None else set()
        report.uninitialized = [d.name for d in found if d.what == "values" and d.name in unset]
        if report.first_divergent is not None:
            report.source, report.provenance = provenance(report.first_divergent.name, graph, nodes)
        del model, got
        again, again_rng = _build_eager(fn, args, kwargs, seed, rng_after)
        unwritten = set(report.uninitialized)  # whatever memory held: no two builds need agree there
        report.eager_deterministic = not [d for d in compare_builds(reachable_tensors(again), want)
                                          if not (d.what == "values" and d.name in unwritten)] and (
            again_rng is None or torch.equal(again_rng, eager_rng))  # type: ignore[arg-type]
        report.hint = _difference_hint(report)
        return report
    finally:
        _set_rng_states(saved)


def reachable_tensors(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every tensor reachable from ``module``, by name, in a fixed order: the entries of
    ``state_dict(keep_vars=True)``, then non-persistent buffers (``rotary.inv_freq``), tensor
    attributes of modules (``attn.mask``), and tensors held in containers and plain objects
    (``cache[0]``, ``tables['sin']``, ``router._counts.x``: ``reachable.module_slots``), and the
    tensors of modules held in containers (``_hparams_initial['loss'].weight``); shared
    modules under each of their names."""
    return _reachable(module, {id(m) for m in module.modules()})


def _reachable(module: torch.nn.Module, within: set[int]) -> dict[str, torch.Tensor]:
    """``reachable_tensors``; ``within``: the modules (by ``id``) whose tensors are named already."""
    out: dict[str, torch.Tensor] = dict(module.state_dict(keep_vars=True))
    held: list[tuple[str, torch.nn.Module]] = []
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        for name, t in mod._buffers.items():
            if t is not None and name in mod._non_persistent_buffers_set:
                out.setdefault(prefix + name, t)
        for kind, name, value in module_slots(mod):
            if isinstance(value, torch.nn.Module):
                held.append((prefix + name, value))
            elif kind in ("__dict__", "container"):
                out.setdefault(prefix + name, value)
    for name, mod in held:  # modules held in containers (not submodules): their tensors too, once
        if id(mod) not in within:
            within.update(id(m) for m in mod.modules())
            for sub, t in _reachable(mod, within).items():
                out.setdefault(f"{name}.{sub}", t)
    return out


def compare_builds(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> list[Divergence]:
    """What differs between fxinit's tensors ``got`` and eager's ``want`` (both from
    ``reachable_tensors``): one ``Divergence`` per name, in eager's order, then names only
    fxinit's build has."""
    found: list[Divergence] = []
    got_ties, want_ties = _tie_groups(got), _tie_groups(want)
    got_memory, want_memory = _memory_groups(got), _memory_groups(want)
    for name, ref in want.items():
        if name not in got:
            found.append(Divergence(name, "missing", "eager construction has this tensor, fxinit's build does not"))
            continue
        tensors = isinstance(ref, torch.Tensor) and isinstance(got[name], torch.Tensor)
        d = compare_tensors(name, got[name], ref) if tensors else _compare_objects(name, got[name], ref)
        if d is None and got_ties[name] != want_ties[name]:
            d = Divergence(name, "tie", f"the same tensor object as {_names(got_ties[name])} in fxinit's build, "
                                        f"as {_names(want_ties[name])} in eager's")
        memory = got_memory.get(name), want_memory.get(name)
        if d is None and None not in memory and memory[0] != memory[1]:
            (got_with, got_bytes), (want_with, want_bytes) = memory  # type: ignore[misc]
            detail = (f"memory shared with {_names(got_with)} in fxinit's build, with {_names(want_with)} in eager's"
                      if got_with != want_with else
                      f"a storage of {got_bytes} bytes here, {want_bytes} in eager construction")
            d = Divergence(name, "storage", detail)
        if d is not None:
            found.append(d)
    found += [Divergence(name, "extra", "fxinit's build has this tensor, eager construction does not")
              for name in got if name not in want]
    return found


def _compare_objects(name: str, got: Any, want: Any) -> Divergence | None:
    """A ``state_dict`` entry that is not a tensor in one build or both: a module's extra
    state (``get_extra_state``: None in megatron-core's parallel linears), equal where it is
    of one class and compares equal (by ``repr`` where ``==`` has no single answer)."""
    if type(got) is not type(want):
        return Divergence(name, "type", f"{type(got).__name__} here, {type(want).__name__} in eager construction")
    try:
        same = bool(got == want)
    except Exception:  # noqa: BLE001  (tensors inside: an element-wise answer)
        same = repr(got) == repr(want)
    return None if same else Divergence(name, "values", f"{got!r:.80} here, {want!r:.80} in eager construction")


def compare_tensors(name: str, got: torch.Tensor, want: torch.Tensor) -> Divergence | None:
    """None if ``got`` (fxinit's) is ``want`` (eager's) in class, shape, dtype, device,
    ``requires_grad``, the kind of its ``grad_fn``, its attributes' names, strides and bits
    (NaNs equal where they are the same NaN at the same place; ``-0.0`` is not ``0.0``); else
    how it differs."""
    if is_deferred_tensor(got):
        return Divergence(name, "deferred", "still deferred after fxinit.materialize")
    if is_lazy(got) or is_lazy(want):  # (an ``UninitializedParameter``: no shape, no data, on either side)
        for what, a, b in (("type", _class(got), _class(want)), ("dtype", got.dtype, want.dtype),
                           ("device", got.device, want.device), ("requires_grad", got.requires_grad, want.requires_grad)):
            if a != b:
                return Divergence(name, what, f"{a} here, {b} in eager construction")
        return None
    if got.is_meta and not want.is_meta:
        return Divergence(name, "meta", "a meta tensor (no data) where eager construction has values")
    for what, a, b in (("type", _class(got), _class(want)), ("shape", tuple(got.shape), tuple(want.shape)),
                       ("dtype", got.dtype, want.dtype), ("device", got.device, want.device),
                       ("requires_grad", got.requires_grad, want.requires_grad),
                       ("grad_fn", _grad_fn(got), _grad_fn(want)),
                       ("attributes", sorted(map(str, got.__dict__)), sorted(map(str, want.__dict__)))):
        if a != b:
            return Divergence(name, what, f"{a} here, {b} in eager construction")
    if got.layout == torch.strided and (got.stride(), got.storage_offset()) != (want.stride(), want.storage_offset()):
        return Divergence(name, "stride", f"stride {got.stride()} offset {got.storage_offset()} here, "
                                          f"{want.stride()} offset {want.storage_offset()} in eager construction")
    if want.is_meta:
        return None  # no values on either side
    if getattr(type(want), "__tensor_flatten__", None) is not None and not hasattr(want, "_local_tensor"):
        return _compare_inner(name, got, want)
    return _compare_values(name, got.detach(), want.detach())


def _compare_inner(name: str, got: torch.Tensor, want: torch.Tensor) -> Divergence | None:
    """A wrapper tensor subclass (torchao's ``NF4Tensor``), whose own ops may not include
    comparing: the same inner tensors and the same flattening context, each inner tensor
    compared as a tensor (``name.quantized_data``)."""
    (inner_got, ctx_got), (inner_want, ctx_want) = got.__tensor_flatten__(), want.__tensor_flatten__()
    if list(inner_got) != list(inner_want):
        return Divergence(name, "type", f"inner tensors {list(inner_got)} here, {list(inner_want)} in eager construction")
    if repr(ctx_got) != repr(ctx_want):
        return Divergence(name, "type", f"flattening context {ctx_got!r} here, {ctx_want!r} in eager construction")
    for attr in inner_want:
        d = compare_tensors(f"{name}.{attr}", getattr(got, attr), getattr(want, attr))
        if d is not None:
            return d
    return None


def provenance(name: str, graph: InitGraph | None, nodes: dict[str, fx.Node]) -> tuple[str | None, str | None]:
    """(the op that last wrote ``name``, with its init function and source line; the
    ``InitGraph.explain`` of it), from the init graph taken before materializing, or, for a
    tensor that is no output of it (a tensor in a list attribute), from its trace node."""
    if graph is not None and name in graph.outputs:
        ops = [n for n in graph.required_nodes([name]) if op_name(n) not in _PLUMBING]
        return (_describe(ops[-1]) if ops else None), graph.explain(name)
    node = nodes.get(name)
    return (_describe(node) if node is not None else None), None


def _describe(node: fx.Node) -> str:
    """``normal_: by torch.nn.init.normal_, in Embedding.reset_parameters, module embed, at
    model.py:19: ...``: an op and where it came from, as ``explain`` says it."""
    prov = node.meta.get("prov")
    where = [f"by {prov.init_fn}" if prov and prov.init_fn else None,
             f"in {prov.init_method}" if prov and prov.init_method else None,
             f"module {node.meta['module'] or '<root>'}" if "module" in node.meta else None,
             f"at {_short_path(prov.source)}" if prov and prov.source else None]
    shown = ", ".join(w for w in where if w)
    return f"{op_name(node)}: {shown}" if shown else op_name(node)


def _compare_values(name: str, got: torch.Tensor, want: torch.Tensor) -> Divergence | None:
    if torch.strided not in (want.layout, got.layout) or got.layout != want.layout:
        return _compare_sparse(name, got, want)
    try:
        bits_got, bits_want = _bits(got), _bits(want)
    except (RuntimeError, TypeError):  # sparse, quantized, ...: no integer view, compare values
        if torch.equal(got, want):
            return None
        return Divergence(name, "values", "the values differ", numel=got.numel())
    if torch.equal(bits_got, bits_want):
        return None
    ne = bits_got != bits_want
    if want.is_complex():
        ne = ne.any(-1)
    count, numel = int(ne.sum()), want.numel()
    max_diff = None
    if want.dtype != torch.bool:
        wide = torch.complex128 if want.is_complex() else torch.float64
        a, b = got.to(wide)[ne], want.to(wide)[ne]
        both = ~(a.isnan() | b.isnan())
        max_diff = float((a[both] - b[both]).abs().max()) if bool(both.any()) else math.nan
    detail = f"{count} of {numel} elements differ"
    if max_diff is not None:
        detail += f", max abs difference {max_diff:.6g}"
        if max_diff == 0:
            detail += " (signed zeros or NaN payloads: the bits differ)"
    return Divergence(name, "values", detail, differing=count, numel=numel, max_abs_diff=max_diff)


def _compare_sparse(name: str, got: torch.Tensor, want: torch.Tensor) -> Divergence | None:
    """A sparse tensor is its index and value tensors, as they are (an uncoalesced one's
    duplicates and order too): each compared bit for bit."""
    if got.layout != want.layout or (got.is_sparse and got.is_coalesced() != want.is_coalesced()):
        return Divergence(name, "values", f"{got.layout} (coalesced: {got.is_sparse and got.is_coalesced()}) where "
                                          f"eager's is {want.layout} (coalesced: {want.is_sparse and want.is_coalesced()})")
    if want.layout not in _SPARSE_PARTS:  # (mkldnn & co.: their values, densely)
        return _compare_values(name, got.to_dense(), want.to_dense())
    for part, a, b in zip(_SPARSE_PARTS[want.layout], _sparse_parts(got), _sparse_parts(want)):
        if a.shape != b.shape or a.dtype != b.dtype:
            return Divergence(name, "values", f"its {part} are {tuple(a.shape)} {a.dtype} where eager's are "
                                              f"{tuple(b.shape)} {b.dtype}")
        found = _compare_values(f"{name} ({part})", a, b)
        if found is not None:
            return Divergence(name, found.what, f"its {part}: {found.detail}", differing=found.differing,
                              numel=found.numel, max_abs_diff=found.max_abs_diff)
    return None


_SPARSE_PARTS = {torch.sparse_coo: ("indices", "values"),
                 torch.sparse_csr: ("crow_indices", "col_indices", "values"),
                 torch.sparse_bsr: ("crow_indices", "col_indices", "values"),
                 torch.sparse_csc: ("ccol_indices", "row_indices", "values"),
                 torch.sparse_bsc: ("ccol_indices", "row_indices", "values")}


def _sparse_parts(t: torch.Tensor) -> list[torch.Tensor]:
    if t.layout == torch.sparse_coo:
        return [t._indices(), t._values()]
    if t.layout in (torch.sparse_csr, torch.sparse_bsr):
        return [t.crow_indices(), t.col_indices(), t.values()]
    return [t.ccol_indices(), t.row_indices(), t.values()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as integers of its width (complex: its real and imaginary parts), so that
    equality is equality of bits."""
    if t.is_complex():
        t = torch.view_as_real(t)
    if t.is_floating_point():
        return t.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t


def _grad_fn(t: torch.Tensor) -> str:
    """The kind of autograd node that made ``t`` (``MulBackward0``), or "no grad_fn"."""
    return type(t.grad_fn).__name__ if t.grad_fn is not None else "no grad_fn"


def _class(t: torch.Tensor) -> str:
    cls = type(t)
    return cls.__qualname__ if cls.__module__.startswith("torch") else f"{cls.__module__}.{cls.__qualname__}"


def _tie_groups(tensors: dict[str, torch.Tensor]) -> dict[str, frozenset[str]]:
    """name -> the other names that are the same tensor object."""
    by_id: dict[int, set[str]] = defaultdict(set)
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):  # (not a module's extra state: None is one object)
            by_id[id(t)].add(name)
    return {name: frozenset(by_id[id(t)] - {name}) for name, t in tensors.items()}


def _memory_groups(tensors: dict[str, torch.Tensor]) -> dict[str, tuple[frozenset[str], int]]:
    """name -> the other names whose memory is on the same storage, and the storage's size
    (plain tensors with memory: a write to one shows in the others, as in eager or not)."""
    keys: dict[str, tuple[int, int]] = {}
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and type(t) in (torch.Tensor, torch.nn.Parameter) and t.layout == torch.strided \
                and not t.is_meta and not t._is_zerotensor():  # (a zero tensor has no memory to share)
            storage = t.untyped_storage()
            if storage.data_ptr():
                keys[name] = (storage.data_ptr(), storage.nbytes())
    by_storage: dict[tuple[int, int], set[str]] = defaultdict(set)
    for name, key in keys.items():
        by_storage[key].add(name)
    return {name: (frozenset(by_storage[key] - {name}), key[1]) for name, key in keys.items()}


def _names(names: frozenset[str]) -> str:
    return ", ".join(sorted(names)) if names else "no other name"


def _deferred_nodes(model: torch.nn.Module) -> dict[str, fx.Node]:
    """name -> trace node of each deferred tensor reachable from the traced model."""
    return {name: state_of(t).node for name, t in reachable_tensors(model).items() if is_deferred_tensor(t)}


def _graph_or_none(model: torch.nn.Module) -> InitGraph | None:
    try:
        return init_graph(model)
    except ValueError:  # nothing deferred: a module without tensors
        return None
    except DeferredInitError:  # no graph of it (wrapper subclasses): materialize says what it refuses
        return None


def _build_eager(fn: Callable[..., torch.nn.Module], args: tuple, kwargs: dict, seed: int, rng_after: bool
                 ) -> tuple[torch.nn.Module, torch.Tensor | None]:
    torch.manual_seed(seed)
    model = fn(*args, **kwargs)
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_target_name(fn)} returned {type(model).__name__}, not an nn.Module")
    return model, torch.rand(_RNG_PROBE) if rng_after else None


def _rng_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None


def _set_rng_states(states: tuple[torch.Tensor, list[torch.Tensor] | None]) -> None:
    torch.set_rng_state(states[0])
    if states[1] is not None:
        torch.cuda.set_rng_state_all(states[1])


def _target_name(fn: Callable[..., Any]) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}:{name}" if module and module != "__main__" else name


def _refusal_hint(exc: DeferredInitError) -> str:
    first = f"{exc.hint}; " if exc.hint else ""
    return first + f"{FAILURE_MODES} lists what fxinit refuses and how to get out"


def _difference_hint(report: CheckReport) -> str:
    d = report.first_divergent
    if report.uninitialized and len(report.uninitialized) == report.divergent and report.rng_after_equal is not False:
        names = ", ".join(report.uninitialized[:3]) + (" ..." if len(report.uninitialized) > 3 else "")
        return (f"{names}: allocated (torch.empty & co.) and never written, so eager's value is whatever the "
                "memory held, which may differ from build to build, and from fxinit's. Initialize it in the "
                "constructor or in an init step, or leave it out of the comparison: no build can match it.")
    if report.eager_deterministic is False:
        return ("two eager builds with the same seed differ, so no deferred build can match them: the constructor "
                "reads something besides torch's seeded generators (the time, Python's `random`, numpy's global "
                "generator, a counter kept between calls, os.urandom), or runs a kernel whose bits depend on memory "
                "alignment or threads (`torch.linalg.lstsq` with its default CPU driver, gelsy, in pykan's and "
                "neuralforecast's KAN layers). Make it deterministic and check again.")
    if d is None:
        what = ("the tensors are equal, but after fxinit's build the global generator is not where eager construction "
                "leaves it, so random numbers drawn afterwards (dropout, shuffling) differ")
    else:
        what = f"fxinit's {d.name} is not eager's ({d.what})" + (f"; the op that made it: {report.source}"
                                                                   if report.source else "")
    return (f"{what}. Eager construction is deterministic, so this is a bug in fxinit, which promises eager's bits "
            "or a DeferredInitError: please report it with this output. Until it is fixed, build this model eagerly "
            f"(or load its weights with materialize(model, state_dict=...)); see {FAILURE_MODES}.")
