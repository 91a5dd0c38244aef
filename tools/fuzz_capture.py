"""Long-mode differential fuzzing of fxinit's capture against eager construction.

    python tools/fuzz_capture.py --examples 3000 --seed 0 [--include-known-holes] [--out holes.md]
    python tools/fuzz_capture.py --examples 3000 --seed 1 --small-thresholds  # pieces, copies that draw

Generates model constructors from the grammar of ``tests/fuzz_programs.py`` (factories, random
fills, sub-modules, in-place and view edits, ties, casts, numpy and ``torch.load``, generators,
control flow on values, constructor arguments, ``init_weights()`` after construction), builds
each one eagerly and under ``fxinit.trace_init`` + ``materialize``, and compares them bit for bit
(``fuzz_programs.check``).

Without ``--include-known-holes`` the grammar options of ``KNOWN_HOLE_KINDS``
(``tests/test_fuzz_capture.py``) are not generated, as in the CI test.

Finding several holes in one run: the search runs in rounds. When a round finds a hole that no
hole found before explains, Hypothesis shrinks it to a minimal program, which is recorded; the
next round goes on with a new seed, and a hole explained by a recorded one (same category and
signature, and the program uses every grammar option of the recorded minimal program) counts
for that one and does not stop the search. The budget (``--examples``) counts programs of the
generation phase only, not the shrinker's.

Prints: programs run, equal, refused (the distinct refusal messages' first lines, counted),
warned (kept tensors that lose eager's ``grad_fn``, as fxinit's warning said: documented),
discarded (eager raised), holes (each with its minimal program as a standalone script); exits 1
if there is any hole.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from hypothesis import HealthCheck, Phase, assume, given, seed, settings  # noqa: E402

import fuzz_programs as fp  # noqa: E402
from test_fuzz_capture import KNOWN_HOLE_KINDS, WHOLE_ORDER_ONLY  # noqa: E402

# tags too generic to tell holes apart (any program has some of them)
GENERIC = ("step:", "order:whole", "post:plain", "access:no_grad", "dtype:float32", "fac:zeros", "fac:ones",
           "fac:full", "fac:arange", "fac:linspace", "fac:eye", "fac:tensor", "fac:empty", "edit:fill_",
           "edit:zero_", "fill:normal_", "fill:uniform_")


def core_tags(tags: frozenset[str]) -> frozenset[str]:
    return frozenset(t for t in tags if not any(t == g or (g.endswith(":") and t.startswith(g)) for g in GENERIC))


@dataclasses.dataclass
class Found:
    category: str
    signature: str
    core: frozenset[str]
    key: frozenset[str]
    program: fp.Program
    message: str
    hits: int = 1  # generated programs that showed it (the first included)
    found_after: int = 0


class Search:
    def __init__(self, disabled: frozenset[str], verbose: bool) -> None:
        self.disabled = disabled
        self.verbose = verbose
        self.run = 0
        self.counts: collections.Counter[str] = collections.Counter()
        self.refusals: collections.Counter[str] = collections.Counter()
        self.invalid: collections.Counter[str] = collections.Counter()
        self.refusal_examples: dict[str, str] = {}  # the shortest program body seen per refusal
        self.tag_freq: collections.Counter[str] = collections.Counter()  # in how many generated programs
        self.found: list[Found] = []
        self.target: tuple[str, str] | None = None  # (category, signature) being shrunk
        self.last: fp.Hole | None = None
        self.crashed: fp.Program | None = None  # the program the harness itself failed on
        self.budget = 0
        self.include_known = False  # also programs of WHOLE_ORDER_ONLY's kinds materialized in parts

    def key_tags(self, tags: frozenset[str]) -> frozenset[str]:
        """The rare tags of a minimal program (used by < 12% of the programs so far): what tells
        its hole apart. Common ones (a parameter, a Linear) are in most programs, hole or not."""
        core = core_tags(tags)
        rare = frozenset(t for t in core if self.tag_freq[t] < 0.12 * max(self.run, 1))
        return rare or core

    def explained(self, hole: fp.Hole, sig: str, tags: frozenset[str]) -> Found | None:
        for f in self.found:
            if f.category == hole.category and f.signature == sig and f.key <= tags:
                return f
        return None

    def body(self, program: fp.Program) -> None:
        shrinking = self.target is not None
        if program.order != "whole" and program.tags & WHOLE_ORDER_ONLY and not self.include_known:
            return  # a documented limit of materializing in parts
        if not shrinking:
            if self.run >= self.budget:
                return  # the budget is spent: let the rest of this round pass
            self.run += 1
            self.tag_freq.update(program.tags)
        try:
            outcome = fp.check(program)
        except fp.Hole as hole:
            sig = fp.signature(hole)
            if shrinking:
                if (hole.category, sig) != self.target:
                    return  # another hole: keep shrinking the one we have
                self.last = hole
                raise
            known = self.explained(hole, sig, program.tags)
            if known is not None:
                known.hits += 1
                self.counts["hole (explained by one found before)"] += 1
                return
            self.counts["hole (new)"] += 1
            self.target = (hole.category, sig)
            self.last = hole
            if self.verbose:
                print(f"  [{self.run}] new hole {sig!r}: shrinking...", flush=True)
            raise
        except Exception:  # the harness's own failure (the oracle, an unforeseen program): shown with it
            self.crashed = program
            raise
        if not shrinking:
            self.counts[outcome.status] += 1
            if outcome.status == "refused":
                self.refusals[outcome.message] += 1
                src = program.body("init") + ("\n# init_weights():\n" + program.body("post") if program.post else "")
                if len(src) < len(self.refusal_examples.get(outcome.message, src + " ")):
                    self.refusal_examples[outcome.message] = src
            elif outcome.status == "invalid":
                self.invalid[outcome.message[:160]] += 1
        assume(outcome.status != "invalid")

    def round(self, round_seed: int) -> fp.Hole | None:
        self.target, self.last = None, None

        @settings(max_examples=max(1, self.budget - self.run), deadline=None, database=None, derandomize=False,
                  report_multiple_bugs=False, phases=[Phase.generate, Phase.shrink],
                  suppress_health_check=list(HealthCheck), print_blob=False)
        @seed(round_seed)
        @given(fp.programs(disabled=self.disabled))
        def prop(program: fp.Program) -> None:
            self.body(program)

        try:
            prop()
        except fp.Hole:
            return self.last
        except Exception as exc:  # hypothesis' own complaints (e.g. too many invalid examples), the harness's
            print(f"  round {round_seed}: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}")
            if self.crashed is not None:
                where = traceback.extract_tb(exc.__traceback__)[-1]
                print(f"    raised at {where.filename}:{where.lineno} by the program:\n{self.crashed.to_source()}")
                self.crashed = None
        return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--examples", type=int, default=2000, help="generated programs to run (shrinking not counted)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--include-known-holes", action="store_true",
                    help="also generate the grammar options of KNOWN_HOLE_KINDS")
    ap.add_argument("--max-holes", type=int, default=60, help="stop after this many distinct holes")
    ap.add_argument("--time-limit", type=float, default=0, help="start no new round after this many seconds (0: none)")
    ap.add_argument("--out", type=Path, help="also write the holes (markdown) to this file")
    ap.add_argument("--scripts", type=Path, help="write each hole's standalone script (with the comparison) here")
    ap.add_argument("-q", "--quiet", action="store_true")
    ap.add_argument("--small-thresholds", action="store_true",
                    help="fill pieces, partial copies, copies that draw and partial zeros at any size: the paths a "
                         "big model's layout takes, on the grammar's small tensors")
    args = ap.parse_args(argv)
    if args.small_thresholds:
        fp.small_thresholds().__enter__()  # for the whole run

    disabled = frozenset() if args.include_known_holes else frozenset(KNOWN_HOLE_KINDS)
    search = Search(disabled, verbose=not args.quiet)
    search.include_known = args.include_known_holes
    search.budget = args.examples
    t0 = time.time()
    round_seed = args.seed
    print(f"fuzzing fxinit capture: {args.examples} programs, seed {args.seed}, "
          f"{'all grammar options' if not disabled else 'without ' + ', '.join(sorted(disabled))}", flush=True)
    while search.run < search.budget and len(search.found) < args.max_holes:
        if args.time_limit and time.time() - t0 > args.time_limit:
            print(f"time limit reached after {search.run} programs")
            break
        before = search.run
        hole = search.round(round_seed)
        round_seed += 1
        if hole is not None:
            sig = fp.signature(hole)
            small = fp.minimize(hole.program, fp.same_hole(hole.category, sig))
            try:
                fp.check(small)
                errs = hole.errs
            except fp.Hole as again:
                errs = again.errs
            message = "\n".join(f"- {c}: {m}" for c, m in errs[:12])
            f = Found(hole.category, sig, core_tags(small.tags), search.key_tags(small.tags), small, message,
                      found_after=search.run)
            # the same hole: same category and signature, and a rare grammar option in common; or,
            # in another category (a hole that shows as a value in one program and as lost storage
            # sharing in another), the same rare options
            dup = next((g for g in search.found if ((g.category, g.signature) == (f.category, f.signature) and g.key & f.key)
                        or (g.category != "exception" != f.category and (g.key <= f.key or f.key <= g.key))), None)
            if dup is not None:  # the same hole, reached from another program: keep the smaller
                dup.hits += 1
                if len(small.to_source()) < len(dup.program.to_source()):
                    dup.core, dup.program, dup.message = f.core, f.program, f.message
                dup.key = dup.key & f.key
                if not args.quiet:
                    print(f"  (a duplicate of an earlier hole: {sig})", flush=True)
            else:
                search.found.append(f)
                if not args.quiet:
                    print(f"  hole {len(search.found)} after {search.run} programs ({time.time() - t0:.0f} s): {sig} "
                          f"[key tags: {' '.join(sorted(f.key))}]", flush=True)
        elif search.run == before:
            break  # hypothesis generated nothing new
    elapsed = time.time() - t0

    c = search.counts
    holes_total = c["hole (new)"] + c["hole (explained by one found before)"]
    lines = [
        f"programs run: {search.run} in {elapsed:.0f} s",
        f"  equal:     {c['equal']}",
        f"  refused:   {c['refused']} (DeferredInitError)",
        f"  warned:    {c['warned']} (grad_fns lost as fxinit's warning said: docs/failure-modes.md)",
        f"  holes:     {holes_total} programs, {len(search.found)} distinct",
        f"  discarded: {c['invalid']} (eager raised or was not deterministic)",
        "  programs with each kind of step: " + ", ".join(
            f"{t.removeprefix('step:')} {n}" for t, n in sorted(search.tag_freq.items()) if t.startswith("step:")),
        "",
        "refusals (first lines, counted):",
    ]
    lines += [f"  {n:5d}  {msg}" for msg, n in search.refusals.most_common()] or ["  none"]
    if search.refusals:
        lines += ["", "the shortest program seen for each refusal:"]
        for msg, _ in search.refusals.most_common():
            lines += ["", f"  {msg[:200]}"] + ["      " + ln for ln in search.refusal_examples[msg].splitlines()]
    lines += ["", "discarded programs (why, counted):"]
    lines += [f"  {n:5d}  {msg}" for msg, n in search.invalid.most_common(15)] or ["  none"]
    lines += ["", f"holes ({len(search.found)} distinct):"]
    for i, f in enumerate(search.found, 1):
        lines += ["", f"### hole {i}: {f.signature}  (seen in {f.hits} programs; key tags: {' '.join(sorted(f.key))}; all: {' '.join(sorted(f.core))})",
                  "", f.message, "", "```python", f.program.to_source(compare=False).strip(), "```"]
        if args.scripts:
            args.scripts.mkdir(parents=True, exist_ok=True)
            (args.scripts / f"hole{i:02d}.py").write_text(f"# {f.signature}\n" + f.program.to_source())
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if search.found else 0


if __name__ == "__main__":
    sys.exit(main())
