"""The grammar: ``Gen`` (the generator, with the RNG, control-flow, reset / apply and
post-construction steps, the step table and the constructor's arguments), the Hypothesis
strategy ``programs(disabled=...)`` and ``example`` (a hand-written program). Part of the
capture fuzzer (see ``fuzz_programs``)."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

from hypothesis import strategies as st

from fuzz_draw import _OBJ, FLOATS, INTS, Sym, shape_src
from fuzz_source import Program, Step
from fuzz_steps import GenSteps


class Gen(GenSteps):
    """Draws one program step by step, tracking the tensors it made."""

    def s_rng(self) -> Step | None:
        tags: set[str] = {"step:rng"}
        opt = self.pick([("rng:manual_seed",), ("rng:generator",), ("rng:generator_attr",), ("rng:set_state",),
                         ("rng:fork_rng",), ("rng:state_buffer",), ("rng:gen_from_global",), ("rng:gen_set_state",),
                         ("dtype:set_default_inside",)])
        if opt is None:
            return None
        kind = opt[0]
        tags.add(kind)
        if kind == "rng:manual_seed":
            return Step((f"torch.manual_seed({self.integer(0, 3)})",), frozenset(tags))
        if kind in ("rng:generator", "rng:generator_attr"):
            if kind == "rng:generator" and self.phase == "init":
                name = self.fresh("g")
                self.gens.append(name)
            else:
                name = f"self.{self.fresh('gen')}"
                self.attr_gens.append(name)
                self.gens.append(name)
            return Step((f"{name} = torch.Generator().manual_seed({self.integer(0, 3)})",), frozenset(tags))
        if kind == "rng:gen_set_state":
            if not self.gens:
                return None
            g = self.choose(self.gens)
            return Step((f"{g}.set_state(torch.get_rng_state())",), frozenset(tags))
        if kind == "rng:gen_from_global":
            name = self.fresh("g")
            if self.phase == "init":
                self.gens.append(name)
            lines = [f"{name} = torch.Generator()", f"{name}.manual_seed(int(torch.randint(0, 1000, ())))"]
            return Step(tuple(lines), frozenset(tags))
        if kind == "rng:state_buffer":
            name = self.fresh("b")
            self.syms[f"self.{name}"] = Sym(f"self.{name}", (5056,), "uint8", "buffer", obj=next(_OBJ), real=True)
            return Step((f'self.register_buffer("{name}", torch.get_rng_state())',), frozenset(tags))
        # a random value made with the global generator saved and put back, or forked
        lines: list[str] = []
        inner: list[str] = []
        e, s = self.factory(tags, inner, force=self.choose(["randn", "rand", "randperm"]))
        tmp_lines: list[str] = []
        if self.store(e, s, tags, tmp_lines) is None:
            return None
        if kind == "rng:set_state":
            lines = ["_state = torch.get_rng_state()"] + tmp_lines + ["torch.set_rng_state(_state)"]
        elif kind == "dtype:set_default_inside":
            if self.default != "float32" or s.dtype != "float32":
                return None
            last = list(self.syms)[-1]  # the value just stored, made under float64 as the default
            self.syms[last] = dataclasses.replace(self.syms[last], dtype="float64")
            lines = ["torch.set_default_dtype(torch.float64)"] + tmp_lines + ["torch.set_default_dtype(torch.float32)"]
        else:
            lines = ["with torch.random.fork_rng():"] + ["    " + ln for ln in tmp_lines]
        return Step(tuple(lines), frozenset(tags))

    def s_ctl(self) -> Step | None:
        tags: set[str] = {"step:ctl"}
        s = self.pick_sym(lambda s: s.known and s.numel > 0 and s.dtype in FLOATS + INTS, use="read")
        if s is None:
            return None
        tags.add(f"read-on:{s.where}")
        opt = self.pick([("ctl:if",), ("ctl:item",), ("ctl:count_shape",), ("ctl:count_random",), ("ctl:argmax",),
                         ("ctl:tolist",), ("ctl:all",), ("ctl:mask_index",), ("ctl:item_attr",), ("ctl:norm_item",),
                         ("ctl:nonzero",), ("ctl:unique",)])
        if opt is None:
            return None
        kind = opt[0]
        tags.add(kind)
        x = s.expr
        lines: list[str] = []
        if kind in ("ctl:if", "ctl:all"):
            t = self._target(lambda t: t.dtype in FLOATS, tags)
            if t is None:
                return None
            cond = f"{x}.sum() > 0" if kind == "ctl:if" else f"torch.isfinite({x}).all()"
            lines = [f"if {cond}:", "    with torch.no_grad():", f"        {t.expr}.fill_(1.0)", "else:",
                     "    with torch.no_grad():", f"        {t.expr}.normal_()"]
            return Step(tuple(lines), frozenset(tags))
        if kind in ("ctl:item", "ctl:norm_item"):
            t = self._target(lambda t: t.dtype in FLOATS, tags)
            if t is None:
                return None
            if kind == "ctl:item":
                lines = [f"_v = {x}.max().item()", "with torch.no_grad():", f"    {t.expr}.fill_(_v)"]
            else:
                if s.dtype not in FLOATS:
                    return None
                lines = [f"{t.expr}.data /= ({x}.norm().item() + 1.0)"]
            return Step(tuple(lines), frozenset(tags))
        if kind == "ctl:item_attr":
            name = self.fresh("v")
            return Step((f"self.{name} = {x}.sum().item()",), frozenset(tags))
        if kind == "ctl:argmax":
            t = self._target(lambda t: t.known and t.numel > 0 and t.contiguous, tags)
            if t is None:
                return None
            lines = [f"_i = int({x}.argmax())", "with torch.no_grad():", f"    {t.expr}.view(-1)[_i % {t.numel}] = 0"]
            return Step(tuple(lines), frozenset(tags))
        if kind == "ctl:tolist":
            name = self.fresh("t")
            if self.boolean():
                return Step((f"self.{name} = {x}.tolist()",), frozenset(tags))
            lines = [f"_l = {x}.tolist()"]
            e = "torch.tensor(_l)"
            d = self.default if s.dtype in FLOATS else "int64"
            v = Sym("", s.shape, d, "")
            if self.store(e, v, tags, lines) is None:
                return None
            return Step(tuple(lines), frozenset(tags))
        if kind in ("ctl:count_shape", "ctl:count_random"):
            lines = [f"_k = int(({x} > 0).sum())"]
            e = "torch.zeros(_k)" if kind == "ctl:count_shape" else "torch.randn(_k)"
            if self.store(e, Sym("", None, self.default, ""), tags, lines) is None:
                return None
            return Step(tuple(lines), frozenset(tags))
        if kind == "ctl:mask_index":
            e = f"{x}[{x} > 0]"
        elif kind == "ctl:nonzero":
            e = f"{x}.nonzero()"
        else:
            e = f"torch.unique({x})"
        d = "int64" if kind == "ctl:nonzero" else s.dtype
        if self.store(e, Sym("", None, d, "", rg=s.rg and kind in ("ctl:mask_index", "ctl:unique")), tags, lines) is None:
            return None
        return Step(tuple(lines), frozenset(tags))

    def s_unknown_edit(self) -> Step | None:
        """Shape-agnostic edits of data-dependent tensors."""
        tags: set[str] = {"step:edit"}
        s = self._target(lambda s: not s.known and s.dtype in FLOATS, tags)
        if s is None:
            return None
        op = self.pick([("edit:fill_", "{}.fill_(2.0)"), ("fill:method_normal_", "{}.normal_()"), ("edit:mul_", "{}.mul_(3)")])
        if op is None:
            return None
        tags.add(op[0])
        return Step(tuple(self._access(s, tags, lambda x: op[1].format(x))), frozenset(tags))

    def s_reset(self) -> Step | None:
        mods = list(self.modules)
        if not mods or not self.ok("post:reset_parameters"):
            return None
        m = self.choose(mods)
        return Step((f"{m}.reset_parameters()",), frozenset({"step:reset", "post:reset_parameters", f"reset:{self.modules[m]}"}))

    def s_apply(self) -> Step | None:
        if not any(k in ("Linear", "Embedding", "Conv1d", "Conv2d") for k in self.modules.values()):
            return None
        tags = {"step:apply", "post:apply"}
        fill = self.choose(["nn.init.xavier_uniform_(m.weight)", "nn.init.normal_(m.weight, std=0.02)",
                                          "nn.init.trunc_normal_(m.weight, std=0.02)", "nn.init.orthogonal_(m.weight)"])
        lines = ["def _init(m):", "    if isinstance(m, (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d)):",
                 f"        {fill}", "        if getattr(m, 'bias', None) is not None:", "            nn.init.zeros_(m.bias)",
                 "self.apply(_init)"]
        return Step(tuple(lines), frozenset(tags))

    def s_call(self) -> Step | None:
        """A training-mode forward of a submodule (braindecode and fastai size their layers by
        one): under ``no_grad``, ``inference_mode`` or with grad on; batch norm updates its
        running statistics, and the input draws from the global generator."""
        if self.outside_capture:  # a deferred model's modules refuse calls outside a capture
            return None
        widths = {}
        for name, kind in self.modules.items():
            w = self.syms.get(f"{name}.weight") if kind == "Linear" else self.syms.get(f"{name}.running_mean")
            if kind in ("Linear", "BatchNorm1d") and w is not None and w.known and w.dtype in ("float32", "float64"):
                widths[name] = (w.shape[-1] if kind == "Linear" else w.shape[0], w.dtype)
        opt = self.pick([("call:no_grad",), ("call:inference_mode",), ("call:grad",)]) if widths else None
        if opt is None:
            return None
        name = self.choose(sorted(widths))
        n, d = widths[name]
        call = f"_ = {name}(torch.randn({self.integer(2, 4)}, {n}, dtype=torch.{d}))"
        lines = {"call:no_grad": ["with torch.no_grad():", "    " + call],
                 "call:inference_mode": ["with torch.inference_mode():", "    " + call], "call:grad": [call]}[opt[0]]
        return Step(tuple(lines), frozenset({"step:call", opt[0]}))

    def s_post_special(self) -> Step | None:
        if self.phase != "post":
            return None
        opt = self.pick([("post:device_ctx",), ("post:device_kw",), ("post:module_to",), ("post:load_state_dict",),
                         ("post:requires_grad",), ("post:vector_to_parameters",), (("post:parameters_to_vector", "store:grad_tracked"),),
                         ("post:named_loop",), ("post:state_dict_roundtrip",)])
        if opt is None:
            return None
        kind = opt[0] if isinstance(opt[0], str) else opt[0][0]
        tags = {"step:post"} | ({opt[0]} if isinstance(opt[0], str) else set(opt[0]))
        params = [s for s in self.syms.values() if s.where in ("param", "modparam", "paramlist")]
        if kind == "post:vector_to_parameters":
            if not params or any(s.dtype != self.default or not s.known for s in params):
                return None
            n = sum(max(s.numel, 0) for s in params)
            return Step((f"nn.utils.vector_to_parameters(torch.linspace(-1, 1, {n}), self.parameters())",), frozenset(tags))
        if kind == "post:parameters_to_vector":
            if not params or any(s.dtype != self.default for s in params):
                return None
            name = self.fresh("b")
            self.syms[f"self.{name}"] = Sym(f"self.{name}", None, self.default, "buffer", rg=True)
            return Step((f'self.register_buffer("{name}", nn.utils.parameters_to_vector(self.parameters()))',), frozenset(tags))
        if kind == "post:named_loop":
            if not params:
                return None
            return Step(("for _n, _p in self.named_parameters():", "    if _p.dim() < 2:", "        nn.init.zeros_(_p)",
                         "    else:", "        nn.init.xavier_uniform_(_p)"), frozenset(tags))
        if kind == "post:state_dict_roundtrip":
            if not params:
                return None
            return Step(("self.load_state_dict({k: v.clone() * 2 for k, v in self.state_dict().items()})",), frozenset(tags))
        if kind == "post:device_ctx":
            s = self.pick_sym(lambda s: s.where == "buffer", use="reassign")
            if s is None:
                return None
            n = self.integer(1, 6)
            self.syms[s.expr] = Sym(s.expr, (n,), "float32", "buffer")  # a new object
            return Step((f"with torch.device({s.expr}.device):", f"    {s.expr} = torch.arange({n}).float()"), frozenset(tags))
        if kind == "post:device_kw":
            s = self.pick_sym(lambda s: s.is_float and s.known and s.where in ("param", "modparam", "buffer"), use="edit")
            if s is None:
                return None
            tags.add(f"edit-on:{s.where}")
            return Step(("with torch.no_grad():",
                         f"    {s.expr}.add_(torch.randn({s.expr}.shape, device={s.expr}.device, dtype={s.expr}.dtype) * 0.01)"),
                        frozenset(tags))
        if kind == "post:module_to":
            how, d = self.choose([("self.double()", "float64"), ("self.to(torch.float64)", "float64"),
                                                ("self.half()", "float16"), ("self.bfloat16()", "bfloat16"),
                                                ("self.float()", "float32")])
            for e, s in list(self.syms.items()):
                if s.where in ("param", "buffer", "modparam", "modbuffer", "paramlist"):
                    if s.is_float:
                        self.syms[e] = dataclasses.replace(s, dtype=d)
                else:
                    del self.syms[e]
            return Step((how,), frozenset(tags))
        if kind == "post:load_state_dict":
            s = self.pick_sym(lambda s: s.known and s.where in ("param", "buffer", "modparam", "modbuffer") and s.dtype in FLOATS,
                              use="edit")
            if s is None:
                return None
            key = re.sub(r"\[(\d+)\]", r".\1", s.expr[len("self."):])
            n = max(s.numel, 0)
            if "BatchNorm1d" in self.modules.values():
                tags.add("post:load_state_dict_bn")  # BatchNorm's num_batches_tracked is missing from the state dict
            return Step((f"self.load_state_dict({{{key!r}: torch.arange({n}, dtype=torch.{s.dtype}).reshape({shape_src(s.shape)})}}, strict=False)",),
                        frozenset(tags))
        return Step(("self.requires_grad_(False)",), frozenset(tags))

    def step(self) -> Step:
        table = [("step:new", self.s_new, 6), ("step:fill", self.s_fill, 4), ("step:edit", self.s_edit, 4),
                 ("step:view_edit", self.s_view_edit, 3), ("step:module", self.s_module, 3), ("step:tie", self.s_tie, 3),
                 ("step:rng", self.s_rng, 2), ("step:ctl", self.s_ctl, 2), ("step:reassign", self.s_reassign, 1),
                 ("step:edit_unknown", self.s_unknown_edit, 1), ("step:reset", self.s_reset, 1),
                 ("step:apply", self.s_apply, 1), ("step:call", self.s_call, 2),
                 ("step:post", self.s_post_special, 2 if self.phase == "init" else 6)]
        weighted = [(t, f) for t, f, w in table for _ in range(w) if self.ok(t)]
        for _ in range(8):
            tag, fn = self.choose(weighted)
            saved = self._snapshot()
            s = fn()
            if s is not None and not (s.tags & self.disabled):
                return s
            self._restore(saved)  # a sub-choice used a disabled option (or nothing applied): undo, draw again
        tags: set[str] = {"step:new", "fac:zeros", "store:buffer"}
        name = self.fresh("b")
        self.syms[f"self.{name}"] = Sym(f"self.{name}", (2,), self.default, "buffer")
        return Step((f'self.register_buffer("{name}", torch.zeros(2))',), frozenset(tags))

    def _snapshot(self) -> tuple:
        return (dict(self.syms), list(self.files), list(self.gens), list(self.attr_gens), dict(self.modules),
                dict(self.has), self.lst_len, getattr(self, "plist_len", 0))

    def _restore(self, saved: tuple) -> None:
        (self.syms, self.files, self.gens, self.attr_gens, self.modules, self.has, self.lst_len,
         self.plist_len) = saved

    def make_args(self) -> None:
        n = self.choose([0, 0, 1, 0, 2]) if self.ok("arg") else 0
        for i in range(n):
            opt = self.pick([("arg:tensor", "torch.arange(6.0).reshape(2, 3)", (2, 3), "float32"),
                             ("arg:tensor", "torch.randn(4)", (4,), "float32"),
                             ("arg:tensor", "torch.ones(3, dtype=torch.float64)", (3,), "float64"),
                             ("arg:tensor", "torch.arange(5)", (5,), "int64"),
                             ("arg:generator", "torch.Generator().manual_seed(5)", None, None),
                             ("arg:parameter", "nn.Parameter(torch.randn(2, 2))", (2, 2), "float32")])
            if opt is None:
                return
            self.args.append(opt[1])
            if opt[0] == "arg:generator":
                self.gens.append(f"arg{i}")
            else:
                self.syms[f"arg{i}"] = Sym(f"arg{i}", opt[2], opt[3], "arg", rg=opt[0] == "arg:parameter",
                                           obj=next(_OBJ), real=True)


@st.composite
def programs(draw: Callable, disabled: frozenset[str] = frozenset(), max_init: int = 8, max_post: int = 4) -> Program:
    g = Gen(draw, frozenset(disabled))
    dd = g.choose([d for d in ("float32",) * 6 + ("float64", "bfloat16") if g.ok(f"dtype:default:{d}") or d == "float32"])
    g.default = dd
    mode = g.choose([m for m in ("plain", "recording") if g.ok(f"post:{m}")] or ["recording"])
    order = g.choose([o for o in ("whole", "reverse", "tensors") if g.ok(f"order:{o}")] or ["whole"])
    g.post_mode = mode
    g.make_args()
    init = [g.step() for _ in range(draw(st.integers(1, max_init)))]
    g.phase = "post"
    g.gens = list(g.attr_gens)
    for k in [k for k, s in g.syms.items() if not s.expr.startswith("self.")]:
        del g.syms[k]
    post = [g.step() for _ in range(draw(st.integers(0, max_post)))] if g.ok("post") else []
    return Program(init=tuple(init), post=tuple(post), args=tuple(g.args), files=tuple(g.files),
                   post_mode=mode, order=order, default_dtype=dd)


def example(init: list[str], post: list[str] = (), **kw: Any) -> Program:
    """A hand-written program (regression tests): one step per line or block (``\\n`` separated)."""
    mk = lambda src: Step(tuple(src.split("\n")), frozenset())  # noqa: E731
    return Program(init=tuple(mk(s) for s in init), post=tuple(mk(s) for s in post), **kw)
