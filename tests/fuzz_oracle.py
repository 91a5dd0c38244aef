"""The differential oracle: ``check(program)`` builds a program eagerly and under fxinit and
compares every reachable tensor, generator, scalar attribute and the global RNG (``compare``);
it returns an ``Outcome`` or raises a ``Hole`` (one subclass per category, ``hole_class``);
``signature`` names a hole for grouping. Part of the capture fuzzer (see ``fuzz_programs``)."""

from __future__ import annotations

import dataclasses
import re
import traceback
import types
from typing import Any, Callable

import torch
import torch.nn as nn

import fxinit

from fuzz_run import Built, build
from fuzz_source import Program


# ============================================================================ the oracle


@dataclasses.dataclass
class Outcome:
    status: str  # "equal" | "refused" | "invalid" | "warned"
    message: str = ""


class Hole(AssertionError):
    """fxinit differs from eager construction (or failed where eager did not)."""

    category = "hole"


_HOLE_CLASSES: dict[str, type[Hole]] = {}


def hole_class(category: str) -> type[Hole]:
    if category not in _HOLE_CLASSES:
        _HOLE_CLASSES[category] = type(f"Hole_{re.sub(r'[^A-Za-z0-9]', '_', category)}", (Hole,),
                                       {"category": category})
    return _HOLE_CLASSES[category]


def _walk(prefix: str, v: Any, depth: int, out: list[tuple[str, Any]]) -> None:
    if isinstance(v, (torch.Tensor, torch.Generator)):
        out.append((prefix, v))
    elif depth > 0 and isinstance(v, (list, tuple)):
        for i, x in enumerate(v):
            _walk(f"{prefix}[{i}]", x, depth - 1, out)
    elif depth > 0 and isinstance(v, dict):
        for k, x in v.items():
            _walk(f"{prefix}[{k!r}]", x, depth - 1, out)
    elif depth > 0 and isinstance(v, types.SimpleNamespace):
        for k, x in vars(v).items():
            _walk(f"{prefix}.{k}", x, depth - 1, out)
    elif isinstance(v, (bool, int, float, str, complex)) or v is None:
        out.append((prefix, v))


def reachable(m: nn.Module, args: list[Any]) -> list[tuple[str, Any]]:
    """(name, object) of everything compared: tensors, generators, Python scalars."""
    out: list[tuple[str, Any]] = []
    out += [(f"param {n}", p) for n, p in m.named_parameters(remove_duplicate=False)]
    out += [(f"buffer {n}", b) for n, b in m.named_buffers(remove_duplicate=False)]
    for mn, mod in m.named_modules(remove_duplicate=False):
        for k, v in vars(mod).items():
            if k in ("_parameters", "_buffers", "_modules") or k.startswith("_fuzz") or callable(v) and not isinstance(v, torch.Tensor):
                continue
            if k.startswith("_") and k not in ("_flat_weights",):
                continue  # torch's private bookkeeping (hooks, flags)
            _walk(f"attr {mn + '.' if mn else ''}{k}", v, 2, out)
    for i, a in enumerate(args):
        if isinstance(a, nn.Module):
            out += [(f"arg{i} param {n}", p) for n, p in a.named_parameters(remove_duplicate=False)]
            out += [(f"arg{i} buffer {n}", b) for n, b in a.named_buffers(remove_duplicate=False)]
        else:
            _walk(f"arg{i}", a, 2, out)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = torch.empty(t.numel(), dtype=t.dtype).copy_(t.detach().cpu().reshape(-1))
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return flat.view(torch.uint8).view(-1, max(1, t.element_size()))


def _same_values(a: torch.Tensor, b: torch.Tensor) -> tuple[bool, str]:
    ba, bb = _bytes(a), _bytes(b)
    ne = (ba != bb).any(1)
    if not bool(ne.any()):
        return True, ""
    if a.is_floating_point() or a.is_complex():
        fa = torch.view_as_real(a.detach().cpu()).reshape(a.numel(), -1) if a.is_complex() else a.detach().cpu().reshape(-1, 1)
        fb = torch.view_as_real(b.detach().cpu()).reshape(b.numel(), -1) if b.is_complex() else b.detach().cpu().reshape(-1, 1)
        both_nan = (fa.isnan() & fb.isnan()).all(1)
        ne = ne & ~both_nan
        if not bool(ne.any()):
            return True, ""
    idx = int(ne.nonzero()[0])
    fa, fb = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    return False, (f"{int(ne.sum())}/{a.numel()} elements differ, first at flat index {idx}: "
                   f"fxinit {fa[idx].item()!r} vs eager {fb[idx].item()!r}")


def _storage_key(t: torch.Tensor):
    try:
        st_ = t.untyped_storage()
        if st_.nbytes() == 0 or t.numel() == 0:  # an empty view reads and writes nothing of its storage
            return None
        return (t.device.type, st_.data_ptr())
    except Exception:  # noqa: BLE001
        return None


def _partition(items: list[tuple[str, Any]], key: Callable[[Any], Any]) -> list[list[str]]:
    groups: dict[Any, list[str]] = {}
    for name, v in items:
        k = key(v)
        if k is not None:
            groups.setdefault(k, []).append(name)
    return sorted(sorted(g) for g in groups.values() if len(g) > 1)


def compare(traced: Built, eager: Built) -> list[tuple[str, str]]:
    """(category, message) of every difference between the fxinit build and the eager one."""
    errs: list[tuple[str, str]] = []
    got = reachable(traced.module, traced.args)
    want = reachable(eager.module, eager.args)
    if fxinit.is_deferred(traced.module):
        errs.append(("deferred", "fxinit.is_deferred(module) is True after materialize"))
    if [n for n, _ in got] != [n for n, _ in want]:
        gn, wn = [n for n, _ in got], [n for n, _ in want]
        errs.append(("structure", f"reachable names differ: fxinit has {sorted(set(gn) - set(wn))} "
                                  f"not in eager, eager has {sorted(set(wn) - set(gn))} not in fxinit"
                     if set(gn) != set(wn) else f"reachable names in another order: {gn} vs eager {wn}"))
        names = set(gn) & set(wn)
        got = [(n, v) for n, v in got if n in names]
        want_d = dict(want)
        want = [(n, want_d[n]) for n, _ in got]
    lost: set[int] = set()
    for (name, t), (_, r) in zip(got, want):
        if isinstance(r, torch.Generator) or isinstance(t, torch.Generator):
            if not (isinstance(t, torch.Generator) and isinstance(r, torch.Generator)):
                errs.append(("type", f"{name}: {type(t).__name__} vs eager {type(r).__name__}"))
            elif not torch.equal(t.get_state(), r.get_state()):
                errs.append(("generator", f"{name}: torch.Generator state differs from eager's"))
            continue
        if not isinstance(r, torch.Tensor) or not isinstance(t, torch.Tensor):
            if type(t) is not type(r) or repr(t) != repr(r):
                errs.append(("python-value", f"{name}: {t!r} vs eager {r!r}"))
            continue
        if fxinit.is_deferred(t):
            errs.append(("deferred", f"{name}: still deferred after materialize ({type(t).__name__})"))
            continue
        if type(t) is not type(r):
            errs.append(("type", f"{name}: type {type(t).__name__} vs eager {type(r).__name__}"))
        if t.dtype != r.dtype or t.shape != r.shape:
            errs.append(("dtype/shape", f"{name}: {t.dtype}{tuple(t.shape)} vs eager {r.dtype}{tuple(r.shape)}"))
            continue
        if t.device != r.device:
            errs.append(("device", f"{name}: device {t.device} vs eager {r.device}"))
            continue
        if t.requires_grad != r.requires_grad:
            errs.append(("requires_grad", f"{name}: requires_grad {t.requires_grad} vs eager {r.requires_grad}"))
        if (t.grad_fn is None) != (r.grad_fn is None) and id(t) not in lost:  # (once per tensor: it may have
            lost.add(id(t))                                                   # several names, one warning's count)
            errs.append(("autograd", f"{name}: grad_fn {type(t.grad_fn).__name__ if t.grad_fn else None} vs eager "
                                     f"{type(r.grad_fn).__name__ if r.grad_fn else None}"))
        ok, why = _same_values(t, r)
        if not ok:
            errs.append(("value", f"{name}: {why}"))
        elif r.numel() > 1 and (t.stride() != r.stride() or t.storage_offset() != r.storage_offset()):
            errs.append(("layout", f"{name}: stride {t.stride()} offset {t.storage_offset()} vs eager "
                                   f"{r.stride()} {r.storage_offset()}"))
    if not any(c in ("deferred", "structure") for c, _ in errs):
        tens_g = [(n, v) for n, v in got if isinstance(v, torch.Tensor)]
        tens_w = [(n, v) for n, v in want if isinstance(v, torch.Tensor)]
        ig, iw = _partition(tens_g, id), _partition(tens_w, id)
        if ig != iw:
            errs.append(("identity", f"same-object groups {ig} vs eager {iw}"))
        sg, sw = _partition(tens_g, _storage_key), _partition(tens_w, _storage_key)
        if sg != sw:
            errs.append(("storage-sharing", f"shared-storage groups {sg} vs eager {sw}"))
        else:
            vg, vw = _view_bases(tens_g), _view_bases(tens_w)  # (a base of another name: '?', none reachable)
            errs += [("view", f"{name}{_VIEW_OF}{vg.get(name)} vs eager's of {vw.get(name)}")
                     for name in sorted(set(vg) | set(vw)) if vg.get(name) != vw.get(name)]
    if not errs:
        errs += _gradients(got, want)
    if traced.after is not None and eager.after is not None and not torch.equal(traced.after, eager.after):
        errs.append(("rng", f"torch.rand(3) after construction: {traced.after.tolist()} vs eager {eager.after.tolist()}"))
    return errs


_VIEW_OF = ": a view of "


def _view_bases(items: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    by_id = {id(t): name for name, t in items}
    return {name: by_id.get(id(t._base), "?") for name, t in items if _a_view(t)}


def _a_view(t: torch.Tensor) -> bool:
    """A view of memory its base has (``.data =`` leaves a view's base behind, on other memory)."""
    return t._is_view() and t._base.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()


def _gradients(got: list[tuple[str, Any]], want: list[tuple[str, Any]]) -> list[tuple[str, str]]:
    """One backward through every kept tensor that has a ``grad_fn`` (each weighted by its
    place), in both builds: the gradients of the leaves must be eager's, bit for bit (the
    order autograd adds them in included). Where eager's backward raises (a tensor it saved
    was written in place since) fxinit's may run: documented, not compared."""
    def loss_and_leaves(items: list[tuple[str, Any]]) -> tuple[Any, list[tuple[str, torch.Tensor]]]:
        tensors = [(n, t) for n, t in items if isinstance(t, torch.Tensor)]
        derived = [t for _, t in tensors if t.grad_fn is not None and t.is_floating_point()]
        leaves = list({id(t): (n, t) for n, t in tensors if t.requires_grad and t.grad_fn is None}.values())
        loss = sum((t.double() * (i + 1)).sum() for i, t in enumerate(derived)) if derived else None
        return loss, leaves

    want_loss, want_leaves = loss_and_leaves(want)
    if want_loss is None or not want_leaves:
        return []
    if any(isinstance(t, torch.Tensor) and t.requires_grad and not t.numel() for _, t in want):
        return []  # torch 2.13's backward of a norm over no elements dies of SIGFPE (weight_norm of an empty v)
    try:
        want_grads = torch.autograd.grad(want_loss, [t for _, t in want_leaves], retain_graph=True, allow_unused=True)
    except (RuntimeError, IndexError, ValueError):  # eager's own backward fails (IndexError: a 0-dim norm's)
        return []
    got_loss, got_leaves = loss_and_leaves(got)
    if got_loss is None or [n for n, _ in got_leaves] != [n for n, _ in want_leaves]:
        return [("autograd", "the kept tensors with a grad_fn, or the leaves they reach, differ from eager's")]
    try:
        got_grads = torch.autograd.grad(got_loss, [t for _, t in got_leaves], retain_graph=True, allow_unused=True)
    except RuntimeError as exc:
        return [("autograd", f"backward raised where eager's runs: {_first_line(exc)}")]
    errs = []
    for (name, _), g, w in zip(got_leaves, got_grads, want_grads):
        if (g is None) != (w is None) or (g is not None and not _same_values(g, w)[0]):
            errs.append(("gradient", f"{name}: gradient {None if g is None else 'differs'} vs eager's "
                                     f"{None if w is None else 'gradient'}"))
    return errs


# the precedence of categories: the first present names the hole
CATEGORY_ORDER = ("exception", "deferred", "structure", "value", "dtype/shape", "type", "device", "rng", "generator",
                  "python-value", "storage-sharing", "identity", "requires_grad", "autograd", "gradient", "view", "layout")


def _first_line(exc: BaseException) -> str:
    s = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {s[0] if s else ''}"


def _eager(program: Program) -> tuple[Built | None, str]:
    b = Built()
    try:
        build(program, False, b)
        return b, ""
    except Exception as exc:  # noqa: BLE001
        b.cleanup()
        return None, _first_line(exc)


def check(program: Program, verify_eager: bool = True) -> Outcome:
    """Eager against fxinit; returns equal/refused/invalid or raises a ``Hole`` subclass."""
    eager, why = _eager(program)
    if eager is None:
        return Outcome("invalid", "eager raised " + why)
    traced = Built()
    try:
        try:
            build(program, True, traced)
        except fxinit.DeferredInitError as exc:
            return Outcome("refused", f"[{traced.phase}] {_first_line(exc)}")
        except Exception as exc:  # noqa: BLE001
            tb = traceback.format_exception(type(exc), exc, exc.__traceback__)
            where = [ln for ln in tb if "fxinit" in ln and "File" in ln]
            raise_hole(program, [("exception", f"fxinit raised in {traced.phase}: {_first_line(exc)}"
                                               + (f"\n  innermost fxinit frame: {where[-1].strip()}" if where else ""))])
        errs = compare(traced, eager)
        if errs and verify_eager:
            # is eager itself deterministic? (a program whose eager values vary proves nothing)
            again, _ = _eager(program)
            if again is None or compare(again, eager):
                if again is not None:
                    again.cleanup()
                return Outcome("invalid", "eager construction is not deterministic")
            again.cleanup()
        if errs and _all_said(errs, traced.lost_grad_fns):
            return Outcome("warned", f"{traced.lost_grad_fns} grad_fn(s) lost, as fxinit warned")
        if errs:
            raise_hole(program, errs)
        return Outcome("equal")
    finally:
        traced.cleanup()
        eager.cleanup()


def _all_said(errs: list[tuple[str, str]], lost_grad_fns: int) -> bool:
    """Whether every difference is a kept tensor that is a leaf where eager's has a ``grad_fn`` (and
    so no view), no more of them than fxinit's warning counted (a documented limit said aloud, not a hole)."""
    lost = [m for c, m in errs if c == "autograd" and ": grad_fn None vs eager " in m]
    names = {m.split(": grad_fn None vs eager ")[0] for m in lost}  # (a view whose link is lost is a leaf too)
    return 0 < len(lost) <= lost_grad_fns and all(
        (c == "autograd" and (": grad_fn None vs eager " in m or m.startswith("the kept tensors with a grad_fn")))
        or (c == "view" and m.split(_VIEW_OF)[0] in names) for c, m in errs)


def raise_hole(program: Program, errs: list[tuple[str, str]]) -> None:
    cats = sorted({c for c, _ in errs}, key=lambda c: CATEGORY_ORDER.index(c) if c in CATEGORY_ORDER else 99)
    lines = [f"fxinit differs from eager construction [{', '.join(cats)}]:"]
    lines += [f"  - {c}: {m}" for c, m in errs[:20]]
    if len(errs) > 20:
        lines.append(f"  ... and {len(errs) - 20} more")
    lines += ["tags: " + " ".join(sorted(program.tags)), "program:", program.to_source()]
    exc = hole_class(cats[0])("\n".join(lines))
    exc.errs = errs
    exc.program = program
    raise exc


def signature(hole: Hole) -> str:
    """A coarse name of a hole: its category and, for an exception, its message (numbers and
    quoted names blanked)."""
    first = next((m for c, m in hole.errs if c == hole.category), "")
    if hole.category == "exception":
        text = first.split("\n")[0]
    else:
        text = ""  # which tensor differs says little about why: the grammar tags tell holes apart
    text = re.sub(r"'[^']*'|\"[^\"]*\"", "Q", text)
    text = re.sub(r"\d+", "N", text)
    return f"{hole.category}: {text}".strip()
