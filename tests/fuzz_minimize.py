"""Minimizing a hole: ``same_hole`` (a predicate: does a program still show this hole?) and
``minimize`` (greedy delta debugging on the program as data). Part of the capture fuzzer (see
``fuzz_programs``)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from fuzz_oracle import Hole, check, signature
from fuzz_source import Program, Step


def same_hole(category: str, sig: str) -> Callable[[Program], bool]:
    """A predicate: does ``program`` still show a hole of this category and signature?"""

    def pred(p: Program) -> bool:
        try:
            check(p)
        except Hole as h:
            return h.category == category and signature(h) == sig
        except Exception:  # noqa: BLE001
            return False
        return False

    return pred


def minimize(program: Program, pred: Callable[[Program], bool], max_calls: int = 400) -> Program:
    """Greedy delta debugging on the program as data: drop steps, lines of steps, arguments and
    files, and simplify the options, while ``pred`` still holds. (Hypothesis' shrinker works on
    the choices that made the program; dropping a step there renames what later steps use, so
    its results keep steps that the hole does not need.)"""
    calls = 0

    def ok(p: Program) -> bool:
        nonlocal calls
        calls += 1
        return calls <= max_calls and pred(p)

    p = program
    changed = True
    while changed and calls < max_calls:
        changed = False
        for simpler in (dict(post=()), dict(order="whole"), dict(post_mode="plain"), dict(default_dtype="float32"),
                        dict(args=p.args[:-1]) if p.args else None, dict(files=p.files[:-1]) if p.files else None):
            if simpler is None:
                continue
            q = dataclasses.replace(p, **simpler)
            if q != p and ok(q):
                p, changed = q, True
        for phase in ("post", "init"):
            steps = list(getattr(p, phase))
            i = len(steps) - 1
            while i >= 0:
                if phase == "init" and len(steps) == 1:
                    break
                q = dataclasses.replace(p, **{phase: tuple(steps[:i] + steps[i + 1:])})
                if ok(q):
                    p, steps, changed = q, steps[:i] + steps[i + 1:], True
                i -= 1
            # single lines of multi-line steps
            for i in range(len(steps)):
                lines = list(steps[i].lines)
                j = len(lines) - 1
                while j >= 0 and len(lines) > 1:
                    cand = lines[:j] + lines[j + 1:]
                    new = steps[:i] + [Step(tuple(cand), steps[i].tags)] + steps[i + 1:]
                    q = dataclasses.replace(p, **{phase: tuple(new)})
                    if ok(q):
                        p, steps, lines, changed = q, new, cand, True
                    j -= 1
    return p
