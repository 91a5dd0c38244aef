"""A differential fuzzer of fxinit's capture: model constructors generated from a grammar of
what real ``__init__``s and post-construction init steps do, built eagerly and under fxinit,
compared bit for bit.

A *program* (``Program``) is data: lines of Python source grouped in ``Step``s, each with the
*tags* of the grammar options it uses (``"fac:randn"``, ``"store:list"``, ``"edit-on:arg"``...).
``FuzzModule`` is a generic ``nn.Module`` whose ``__init__`` executes a program's init steps and
whose ``init_weights()`` executes its post-construction steps. ``Program.to_source()`` prints the
same lines as a standalone script (eager construction, fxinit, and the comparison) for bug
reports.

``programs(disabled=...)`` is the Hypothesis strategy; it tracks the shape, dtype and storage
of every tensor the program made so far, so that (almost) every generated step is valid eager
code. Grammar options whose tags are in ``disabled`` are never generated.

``check(program)`` is the differential oracle:

* eager:  ``torch.manual_seed(0); m = FuzzModule(program, *args); m.init_weights()``
* fxinit: ``torch.manual_seed(0); m = fxinit.trace_init(FuzzModule, program, *args);
  m.init_weights()`` (inside ``fxinit.recording(m)`` when the program says so); then
  ``fxinit.materialize`` (whole, module by module in reverse, or tensor by tensor)

then ``torch.rand(3)`` on both sides. It returns an ``Outcome``: ``"equal"``, ``"refused"`` (fxinit
raised ``DeferredInitError``, a clear refusal), or ``"invalid"`` (eager itself raised or is not
deterministic: the program is discarded). Anything else raises a ``Hole`` (an
``AssertionError``; one subclass per category, so that Hypothesis shrinks each category on its
own) whose message lists the differences and the program's source.

What is compared: every tensor reachable from the module — parameters and buffers (duplicates
kept), tensor attributes of every submodule, tensors in list / tuple / dict attributes — and the
constructor's tensor arguments, by position: Python type (``Parameter`` or not), shape, dtype,
device, ``requires_grad``, whether it has a ``grad_fn``, strides, and the values bit for bit
(NaNs compare equal by position whatever their payload); which of them are the same object and
which share storage; Python scalar attributes; ``torch.Generator`` states kept on the module or
passed as arguments; ``fxinit.is_deferred(module)`` and every reachable tensor being real; the
global RNG (``torch.rand(3)`` drawn afterwards).

This module is a facade that re-exports the fuzzer's public names from its parts (each imports
only the ones above it):

* ``fuzz_source``: ``Step`` and ``Program`` (programs as data; ``Program.to_source()``);
* ``fuzz_run``: ``FuzzModule`` and ``build`` (running a program eagerly or under fxinit), and
  ``small_thresholds`` (the size thresholds of the element analyses at their minimum);
* ``fuzz_oracle``: ``compare``, ``check``, ``Outcome``, ``Hole``, ``signature`` (the oracle);
* ``fuzz_draw``: ``Sym``, dtype groups, source helpers and ``GenBase`` (the generator's state
  and drawing helpers);
* ``fuzz_exprs``: ``GenExprs`` (tensor expressions and ``store``);
* ``fuzz_steps``: ``GenSteps`` (value, submodule and edit steps);
* ``fuzz_grammar``: ``Gen`` (the remaining steps and the step table), ``programs``, ``example``;
* ``fuzz_minimize``: ``same_hole`` and ``minimize``.
"""

from __future__ import annotations

from fuzz_draw import COMPLEX, FLOATS, INTS, NP_OK, GenBase, Sym, dt, lit, shape_src
from fuzz_exprs import GenExprs
from fuzz_grammar import Gen, example, programs
from fuzz_minimize import minimize, same_hole
from fuzz_oracle import CATEGORY_ORDER, Hole, Outcome, check, compare, hole_class, raise_hole, reachable, signature
from fuzz_run import Built, FuzzModule, build, small_thresholds
from fuzz_source import Program, Step
from fuzz_steps import GenSteps

__all__ = [
    "CATEGORY_ORDER", "COMPLEX", "FLOATS", "INTS", "NP_OK", "Built", "FuzzModule", "Gen", "GenBase", "GenExprs",
    "GenSteps", "Hole", "Outcome", "Program", "Step", "Sym", "build", "check", "compare", "dt", "example",
    "hole_class", "lit", "minimize", "programs", "raise_hole", "reachable", "same_hole", "shape_src", "signature",
    "small_thresholds",
]
