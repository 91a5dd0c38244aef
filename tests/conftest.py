"""Shared helpers: every check compares fxinit against *eager* construction, never against itself.

``assert_same_as_eager(factory, *args, ...)`` is the one oracle most tests use:

* eager:  ``torch.manual_seed(s); ref = factory(*args); post(ref)``
* fxinit: ``torch.manual_seed(s); m = fxinit.trace_init(factory, *args); post(m); materialize(m, order)``

and then it compares, for every parameter and buffer (``remove_duplicate=False``): the names,
dtype, shape, stride, storage offset, ``requires_grad``, device, Python type (``Parameter`` or
not), the raw bytes (bit for bit), the tie structure (which names are the same object) and
the storage sharing (which names share memory); the Python objects must be the same before
and after materialize; the global RNG state after ``trace_init`` (+ ``post``) must equal
eager's after construction (+ ``post``); and ``materialize`` must leave the global RNG
state alone (it is reseeded to an unrelated value first, so a materialize that secretly
draws from the global generator also gets the wrong values).

All failures of one call are collected and reported together (seed, order, name, what).
"""

from __future__ import annotations

import contextlib
import random
import warnings
from collections import defaultdict
from typing import Any, Callable, Iterable, Sequence

import pytest
import torch
from torch.nn.parameter import is_lazy

import fxinit

ORDERS = ("whole", "reverse", "random")


# ---------------------------------------------------------------------------- small tools
#: The first torch release whose CPU samplers fxinit's C kernels reproduce in every kind, dtype
#: and dispatch path. torch 2.11 and 2.12 draw bfloat16 and float16 normals (and float32 ones on
#: the path without vector instructions) otherwise; the kernels' self-check finds that and
#: leaves those fills to torch.
KERNELS_REPRODUCE = (2, 13)
TORCH_RELEASE = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])


def kernel_takes(kind: str, dtype: torch.dtype) -> bool:
    """Whether fxinit's C kernel must take ``kind`` fills in ``dtype`` here: always from
    ``KERNELS_REPRODUCE`` on; before, where its self-check trusts it."""
    from fxinit.rng import fills

    if TORCH_RELEASE >= KERNELS_REPRODUCE:
        return True
    return fills._trusted(kind, dtype, fills.torch_path(), (0.0, 1.0) if kind == "normal" else (-0.37, 0.91))


def native_fill_done(done: bool, kind: str, dtype: torch.dtype) -> bool:
    """``done`` (what a native fill returned), asserting that it took the fill where it must."""
    assert done or not kernel_takes(kind, dtype), (kind, dtype)
    return done


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements in logical order (a uint8 CPU tensor); of a sparse COO
    tensor, its coalesced flag, indices and values as they are."""
    t = t.detach()
    if t.layout == torch.sparse_coo:
        return torch.cat([torch.tensor([t.is_coalesced()], dtype=torch.uint8), raw_bytes(t._indices()),
                          raw_bytes(t._values())])
    if t.device.type != "cpu":
        t = t.cpu()
    if t.is_conj() or t.is_neg():  # (a lazy conjugate or negative view: its flags, then its values)
        flags = torch.tensor([t.is_conj(), t.is_neg()], dtype=torch.uint8)
        return torch.cat([flags, raw_bytes(t.resolve_conj().resolve_neg())])
    flat = t.contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).clone()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(raw_bytes(a), raw_bytes(b))


def first_diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape or a.dtype != b.dtype:
        return f"{tuple(a.shape)}/{a.dtype} vs {tuple(b.shape)}/{b.dtype}"
    if a.layout != torch.strided or b.layout != torch.strided:
        return f"{a.layout} tensors whose indices, values or coalescing differ"
    fa = a.detach().cpu().reshape(-1)
    fb = b.detach().cpu().reshape(-1)
    ne = (raw_bytes(a).view(-1, a.element_size()) != raw_bytes(b).view(-1, b.element_size())).any(1)
    idx = ne.nonzero()
    if idx.numel() == 0:
        return "equal"
    i = int(idx[0])
    return f"{int(ne.sum())}/{fa.numel()} elements differ, first at flat index {i}: {fa[i].item()!r} vs eager {fb[i].item()!r}"


def named_tensors(m: torch.nn.Module) -> list[tuple[str, str, torch.Tensor]]:
    """(kind, fully qualified name, tensor) of every parameter and buffer, duplicates kept."""
    out = [("param", n, t) for n, t in m.named_parameters(remove_duplicate=False)]
    out += [("buffer", n, t) for n, t in m.named_buffers(remove_duplicate=False)]
    return out


def tie_partition(named: Iterable[tuple[str, str, torch.Tensor]]) -> list[list[str]]:
    groups: dict[int, list[str]] = defaultdict(list)
    for _, name, t in named:
        groups[id(t)].append(name)
    return sorted(sorted(g) for g in groups.values())


def storage_partition(named: Iterable[tuple[str, str, torch.Tensor]]) -> list[list[str]]:
    """Names grouped by the storage they live in (tensors with no bytes are left out)."""
    groups: dict[tuple, list[str]] = defaultdict(list)
    for _, name, t in named:
        if t.layout != torch.strided or is_lazy(t) or t._is_zerotensor():  # (no storage of its own to share)
            continue
        st = t.untyped_storage()
        if st.nbytes() == 0:
            continue
        groups[(t.device.type, st.data_ptr())].append(name)
    return sorted(sorted(g) for g in groups.values())


def unique_tensors(m: torch.nn.Module) -> list[torch.Tensor]:
    seen: dict[int, torch.Tensor] = {}
    for _, _, t in named_tensors(m):
        seen.setdefault(id(t), t)
    return list(seen.values())


def materialize_in_order(m: torch.nn.Module, order: str, seed: int = 0) -> None:
    """Materialize ``m`` whole, module by module from the last one, or tensor by tensor at random."""
    if order == "whole":
        fxinit.materialize(m)
    elif order == "reverse":
        for mod in reversed(list(m.modules())):
            fxinit.materialize(mod)
        fxinit.materialize(m)
    elif order == "random":
        ts = [t for t in unique_tensors(m) if fxinit.is_deferred(t)]
        random.Random(1000 + seed).shuffle(ts)
        for t in ts:
            fxinit.materialize(t)
    else:
        raise ValueError(order)


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def rng_state() -> torch.Tensor:
    return torch.get_rng_state()


# ---------------------------------------------------------------------------- the oracle
def attribute_names(t: torch.Tensor) -> list[str]:
    """The names in a tensor's ``__dict__``: what code set on it (``p._no_weight_decay``)."""
    return sorted(map(str, t.__dict__))


def compare_modules(m: torch.nn.Module, ref: torch.nn.Module, where: str = "") -> list[str]:
    """Everything that differs between materialized ``m`` and eager ``ref``, as messages."""
    errs: list[str] = []
    got, want = named_tensors(m), named_tensors(ref)
    gnames = [(k, n) for k, n, _ in got]
    wnames = [(k, n) for k, n, _ in want]
    if gnames != wnames:
        errs.append(f"{where}names differ: {gnames} vs eager {wnames}")
        return errs
    for (kind, name, t), (_, _, r) in zip(got, want):
        p = f"{where}{kind} {name}: "
        if fxinit.is_deferred(t):
            errs.append(p + "still deferred after materialize")
            continue
        if type(t) is not type(r):
            errs.append(p + f"type {type(t).__name__} vs eager {type(r).__name__}")
        if is_lazy(t) or is_lazy(r):  # an UninitializedParameter: no shape, no values on either side
            continue
        if t.dtype != r.dtype:
            errs.append(p + f"dtype {t.dtype} vs eager {r.dtype}")
        if t.shape != r.shape:
            errs.append(p + f"shape {tuple(t.shape)} vs eager {tuple(r.shape)}")
            continue
        if t.device != r.device:
            errs.append(p + f"device {t.device} vs eager {r.device}")
        if t.requires_grad != r.requires_grad:
            errs.append(p + f"requires_grad {t.requires_grad} vs eager {r.requires_grad}")
        if attribute_names(t) != attribute_names(r):
            errs.append(p + f"attributes {attribute_names(t)} vs eager {attribute_names(r)}")
        if t.stride() != r.stride() or t.storage_offset() != r.storage_offset():
            errs.append(p + f"layout stride={t.stride()} offset={t.storage_offset()} vs eager "
                            f"stride={r.stride()} offset={r.storage_offset()}")
        if t.dtype == r.dtype and not same_bits(t, r):
            errs.append(p + "values differ: " + first_diff(t, r))
    if tie_partition(got) != tie_partition(want):
        errs.append(f"{where}tie structure (object identity) {tie_partition(got)} vs eager {tie_partition(want)}")
    if not errs and view_bases(got) != view_bases(want):
        errs.append(f"{where}views (the name of each view's base, '?' a tensor not among them) {view_bases(got)} "
                    f"vs eager {view_bases(want)}")
    if not errs:
        sp, wsp = storage_partition(got), storage_partition(want)
        if sp != wsp:
            errs.append(f"{where}storage sharing {sp} vs eager {wsp}")
    return errs


def view_bases(named: list[tuple[str, str, torch.Tensor]]) -> dict[str, str]:
    """Each view among ``named`` (``named_tensors``), with the name of its ``_base`` there, or
    ``?`` where the base is none of them (a temporary the constructor dropped)."""
    by_id = {id(t): name for _, name, t in named}
    return {name: by_id.get(id(t._base), "?") for _, name, t in named
            if isinstance(t, torch.Tensor) and not fxinit.is_deferred(t) and t._is_view()
            and t._base.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()}


def _shares_outside_memory(t: torch.Tensor) -> bool:
    """A real CPU tensor whose storage torch did not allocate (numpy's, a file's)."""
    if t.device.type != "cpu" or fxinit.is_deferred(t):
        return False
    storage = t.untyped_storage()
    return storage.nbytes() > 0 and not storage.resizable()


def check_deferred_metadata(m: torch.nn.Module, ref: torch.nn.Module, where: str = "") -> list[str]:
    """Before materialize: same names, shapes, dtypes, requires_grad, types and ties as eager,
    and an init graph that declares each output's shape and strides as the tensor has them."""
    errs: list[str] = []
    got, want = named_tensors(m), named_tensors(ref)
    if [(k, n) for k, n, _ in got] != [(k, n) for k, n, _ in want]:
        return [f"{where}deferred names {[n for _, n, _ in got]} vs eager {[n for _, n, _ in want]}"]
    graph = fxinit.init_graph(m) if any(fxinit.is_deferred(t) for _, _, t in got) else None
    for (kind, name, t), (_, _, r) in zip(got, want):
        p = f"{where}deferred {kind} {name}: "
        # A tensor that shares memory with data that existed before (from_numpy, torch.load) is
        # real in eager construction and stays real under capture (fxinit.capture.real).
        if r.numel() > 0 and not fxinit.is_deferred(t) and not _shares_outside_memory(t):
            errs.append(p + "is not deferred after trace_init")
        if t.shape != r.shape or t.dtype != r.dtype or t.requires_grad != r.requires_grad:
            errs.append(p + f"{tuple(t.shape)}/{t.dtype}/rg={t.requires_grad} vs eager "
                            f"{tuple(r.shape)}/{r.dtype}/rg={r.requires_grad}")
        if isinstance(t, torch.nn.Parameter) != isinstance(r, torch.nn.Parameter):
            errs.append(p + f"isinstance Parameter {isinstance(t, torch.nn.Parameter)} vs eager {isinstance(r, torch.nn.Parameter)}")
        spec = graph.spec(name) if graph is not None and name in graph.outputs else None
        if spec is not None and (spec.shape, spec.stride) != (tuple(t.shape), t.stride()):
            errs.append(p + f"the init graph declares {spec.shape}/{spec.stride}, the tensor is "
                            f"{tuple(t.shape)}/{t.stride()}")
    if tie_partition(got) != tie_partition(want):
        errs.append(f"{where}deferred tie structure {tie_partition(got)} vs eager {tie_partition(want)}")
    return errs


def _outputs_equal(a: Any, b: Any) -> bool:
    fa = [x for x in torch.utils._pytree.tree_leaves(a) if isinstance(x, torch.Tensor)]
    fb = [x for x in torch.utils._pytree.tree_leaves(b) if isinstance(x, torch.Tensor)]
    return len(fa) == len(fb) and all(same_bits(x, y) for x, y in zip(fa, fb))


def built_both(factory: Callable[[], torch.nn.Module], step: Callable[[torch.nn.Module], Any] | None = None,
               seed: int = 0, **options: Any) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(eager, traced)``: ``factory()`` built eagerly and with ``fxinit.trace_init`` from one
    seed, ``step`` run on each after construction, the traced one materialized (``options``)."""
    torch.manual_seed(seed)
    eager = factory()
    if step is not None:
        step(eager)
    torch.manual_seed(seed)
    traced = fxinit.trace_init(factory)
    if step is not None:
        step(traced)
    fxinit.materialize(traced, **options)
    return eager, traced


def assert_same_as_eager(
    factory: Callable[..., torch.nn.Module],
    *args: Any,
    seeds: Sequence[int] = (0, 1),
    orders: Sequence[str] = ORDERS,
    post: Callable[[torch.nn.Module], Any] | None = None,
    forward: Callable[[torch.nn.Module], Any] | None = None,
    **kwargs: Any,
) -> None:
    """fxinit.trace_init + materialize == eager construction, bit for bit (see module doc).

    ``post(model)`` runs after construction on both sides (re-init after trace).
    ``forward(model)`` is run on both models afterwards (same seed) and must agree bitwise:
    a behavioural check that modules see their materialized tensors (RNN flat weights...).
    """
    errors: list[str] = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in seeds:
            torch.manual_seed(seed)
            ref = factory(*args, **kwargs)
            if post is not None:
                post(ref)
            eager_rng = rng_state()
            out_ref = None
            if forward is not None:  # on a second eager model: a training-mode forward updates running stats
                torch.manual_seed(seed)
                ref_fwd = factory(*args, **kwargs)
                if post is not None:
                    post(ref_fwd)
                torch.manual_seed(4242)
                out_ref = forward(ref_fwd)
            for order in orders:
                where = f"[seed={seed} order={order}] "
                torch.manual_seed(seed)
                try:
                    m = fxinit.trace_init(factory, *args, **kwargs)
                    if post is not None:
                        post(m)
                except Exception as exc:  # noqa: BLE001
                    errors.append(where + f"trace_init/post raised {type(exc).__name__}: {exc}")
                    break
                if not torch.equal(rng_state(), eager_rng):
                    errors.append(where + "global RNG state after trace_init differs from eager's after construction")
                errors += check_deferred_metadata(m, ref, where)
                before = {(k, n): t for k, n, t in named_tensors(m)}
                torch.manual_seed(seed + 7919)  # unrelated state: materialize must neither use nor change it
                unrelated = rng_state()
                try:
                    materialize_in_order(m, order, seed)
                except Exception as exc:  # noqa: BLE001
                    errors.append(where + f"materialize raised {type(exc).__name__}: {str(exc).splitlines()[0]}")
                    continue
                if not torch.equal(rng_state(), unrelated):
                    errors.append(where + "materialize changed the global RNG state")
                if fxinit.is_deferred(m):
                    errors.append(where + "module still deferred after materialize")
                after = {(k, n): t for k, n, t in named_tensors(m)}
                for key, t in before.items():
                    if key in after and after[key] is not t:
                        errors.append(where + f"{key[0]} {key[1]}: a different Python object after materialize")
                errors += compare_modules(m, ref, where)
                if forward is not None and not any(e.startswith(where) for e in errors):
                    torch.manual_seed(4242)
                    try:
                        out = forward(m)
                    except Exception as exc:  # noqa: BLE001
                        errors.append(where + f"forward on the materialized model raised {type(exc).__name__}: {exc}")
                    else:
                        if not _outputs_equal(out, out_ref):
                            errors.append(where + "forward output differs from eager's")
    if errors:
        shown = errors[:25]
        more = f"\n... and {len(errors) - 25} more" if len(errors) > 25 else ""
        pytest.fail("fxinit differs from eager construction:\n" + "\n".join(shown) + more, pytrace=False)


def eager_and_traced(factory: Callable[..., torch.nn.Module], *args: Any, seed: int = 0, **kwargs: Any):
    """(eager model, deferred model, eager RNG state after construction, RNG state after trace)."""
    torch.manual_seed(seed)
    ref = factory(*args, **kwargs)
    eager_rng = rng_state()
    torch.manual_seed(seed)
    m = fxinit.trace_init(factory, *args, **kwargs)
    return ref, m, eager_rng, rng_state()


def assert_modules_equal(m: torch.nn.Module, ref: torch.nn.Module) -> None:
    errs = compare_modules(m, ref)
    if errs:
        pytest.fail("\n".join(errs[:25]), pytrace=False)


def assert_bits(t: torch.Tensor, r: torch.Tensor, what: str = "") -> None:
    assert not fxinit.is_deferred(t), f"{what} still deferred"
    assert t.dtype == r.dtype and t.shape == r.shape, f"{what}: {t.dtype}{tuple(t.shape)} vs eager {r.dtype}{tuple(r.shape)}"
    assert same_bits(t, r), f"{what}: {first_diff(t, r)}"


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Tests must not leak default dtype / device / RNG changes into each other."""
    dtype = torch.get_default_dtype()
    state = torch.get_rng_state()
    yield
    torch.set_default_dtype(dtype)
    torch.set_rng_state(state)
    fxinit.clear_meta_init_cache()
