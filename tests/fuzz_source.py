"""Programs as data, and their source: ``Step`` (lines of source and the grammar tags they
use) and ``Program`` (init and post-construction steps, constructor arguments, files, options),
whose ``to_source()`` prints a standalone script (eager construction, fxinit, and the
comparison) for bug reports. Part of the capture fuzzer (see ``fuzz_programs``)."""

from __future__ import annotations

import dataclasses
from typing import Any


# ============================================================================ programs


@dataclasses.dataclass(frozen=True)
class Step:
    """Some lines of source (relative indentation included) and the grammar tags they use."""

    lines: tuple[str, ...]
    tags: frozenset[str]


@dataclasses.dataclass(frozen=True, repr=False)
class Program:
    init: tuple[Step, ...]
    post: tuple[Step, ...] = ()
    # expressions evaluated before construction (after torch.manual_seed(1234)): the constructor's arguments
    args: tuple[str, ...] = ()
    # (file name, expression): saved with torch.save into TMP before construction
    files: tuple[tuple[str, str], ...] = ()
    post_mode: str = "plain"  # "plain": m.init_weights(); "recording": inside fxinit.recording(m) (fxinit side)
    order: str = "whole"  # how fxinit materializes: "whole" | "reverse" (module by module) | "tensors" (one by one)
    default_dtype: str = "float32"
    seed: int = 0

    def __repr__(self) -> str:  # a failing example prints as the program's source
        return "<program, as a standalone script:>\n" + self.to_source(compare=False) + "# tags: " + " ".join(sorted(self.tags))

    def _repr_pretty_(self, printer: Any, cycle: bool) -> None:  # what Hypothesis' pretty-printer calls
        printer.text(repr(self))

    @property
    def tags(self) -> frozenset[str]:
        out: set[str] = set()
        for s in self.init + self.post:
            out |= s.tags
        for a in self.args:
            out |= {"arg", "arg:generator" if "Generator" in a else "arg:parameter" if "Parameter" in a else "arg:tensor"}
        if self.post:
            out.add(f"post:{self.post_mode}")
        if self.default_dtype != "float32":
            out.add(f"dtype:default:{self.default_dtype}")
        out.add(f"order:{self.order}")
        return frozenset(out)

    def body(self, phase: str) -> str:
        steps = self.init if phase == "init" else self.post
        return "\n".join(line for s in steps for line in s.lines) or "pass"

    def to_source(self, compare: bool = True) -> str:
        """A standalone script: the model, eager construction, fxinit, and the comparison."""
        ind = lambda text, n: "\n".join(" " * n + ln for ln in text.splitlines())  # noqa: E731
        argnames = [f"arg{i}" for i in range(len(self.args))]
        out = [
            "import collections, contextlib, copy, math, os, tempfile, types",
            "import numpy as np",
            "import torch",
            "import torch.nn as nn",
            "import torch.nn.functional as F",
            "import fxinit",
            "",
            "",
            "class Model(nn.Module):",
            f"    def __init__(self{''.join(', ' + a for a in argnames)}):",
            "        super().__init__()",
            ind(self.body("init"), 8),
        ]
        if self.post:
            out += ["", "    def init_weights(self):", ind(self.body("post"), 8)]
        out += ["", "", "def build(trace):", "    global TMP", "    TMP = tempfile.mkdtemp()"]
        if self.default_dtype != "float32":
            out.append(f"    torch.set_default_dtype(torch.{self.default_dtype})")
        for name, expr in self.files:
            out.append(f"    torch.save({expr}, os.path.join(TMP, {name!r}))")
        if self.args:
            out.append("    torch.manual_seed(1234)")
            out.append(f"    args = [{', '.join(self.args)}]")
        else:
            out.append("    args = []")
        out.append(f"    torch.manual_seed({self.seed})")
        out.append("    m = fxinit.trace_init(Model, *args) if trace else Model(*args)")
        if self.post:
            if self.post_mode == "recording":
                out.append("    with fxinit.recording(m) if trace else contextlib.nullcontext():")
                out.append("        m.init_weights()")
            else:
                out.append("    m.init_weights()")
        out.append("    if trace:")
        if self.order == "whole":
            out.append("        fxinit.materialize(m)")
        elif self.order == "reverse":
            out.append("        for sub in reversed(list(m.modules())):")
            out.append("            fxinit.materialize(sub)")
        else:
            out.append("        for name, t in reversed(list(m.state_dict(keep_vars=True).items())):")
            out.append("            fxinit.materialize(t)")
            out.append("        fxinit.materialize(m)")
        out.append("    return m, args, torch.rand(3)")
        if compare:
            out += [
                "",
                "",
                "def tensors(m, args):",
                "    out = [(f'param {n}', p) for n, p in m.named_parameters(remove_duplicate=False)]",
                "    out += [(f'buffer {n}', b) for n, b in m.named_buffers(remove_duplicate=False)]",
                "    for mn, mod in m.named_modules(remove_duplicate=False):",
                "        for k, v in vars(mod).items():",
                "            vs = v.items() if isinstance(v, dict) else enumerate(v) if isinstance(v, (list, tuple)) else [(None, v)]",
                "            out += [(f'attr {mn}.{k}' + ('' if i is None else f'[{i!r}]'), x) for i, x in vs"
                " if isinstance(x, torch.Tensor) and not k.startswith('_parameters') and not k.startswith('_buffers')]",
                "    return out + [(f'arg{i}', a) for i, a in enumerate(args) if isinstance(a, torch.Tensor)]",
                "",
                "",
                "eager, eager_args, eager_next = build(trace=False)",
                "traced, traced_args, traced_next = build(trace=True)",
                "print('is_deferred after materialize:', fxinit.is_deferred(traced))",
                "print('global RNG after construction equal:', torch.equal(eager_next, traced_next))",
                "for (name, e), (_, t) in zip(tensors(eager, eager_args), tensors(traced, traced_args)):",
                "    same = (type(e) is type(t) and e.dtype == t.dtype and e.shape == t.shape and not t.is_meta",
                "            and torch.equal(e.detach().reshape(-1).view(torch.uint8) if e.dtype != torch.bool else e, "
                "t.detach().reshape(-1).view(torch.uint8) if t.dtype != torch.bool else t))",
                "    print('ok  ' if same else 'DIFF', name, '' if same else f'\\n  eager:  {e!r}\\n  fxinit: {t!r}')",
                "    if (e.grad_fn is None) != (t.grad_fn is None):",
                "        print('DIFF', name, f'grad_fn: eager {e.grad_fn}, fxinit {t.grad_fn}')",
                "",
                "",
                "def sharing(pairs):",
                "    groups = {}",
                "    for name, x in pairs:",
                "        if not x.is_meta and x.untyped_storage().nbytes():",
                "            groups.setdefault(x.untyped_storage().data_ptr(), []).append(name)",
                "    return sorted(g for g in groups.values() if len(g) > 1)",
                "",
                "",
                "se, st = sharing(tensors(eager, eager_args)), sharing(tensors(traced, traced_args))",
                "print('storage sharing', 'ok' if se == st else f'DIFF: eager {se}, fxinit {st}')",
            ]
        return "\n".join(out) + "\n"
