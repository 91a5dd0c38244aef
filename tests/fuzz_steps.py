"""The grammar's steps, first part: ``GenSteps`` adds to the generator the steps that make
values, submodules and edits (``s_new``, ``s_reassign``, ``s_module``, ``s_fill``, ``s_edit``,
``s_view_edit``, ``s_tie``). Part of the capture fuzzer (see ``fuzz_programs``)."""

from __future__ import annotations

import dataclasses
from typing import Callable

from hypothesis import strategies as st

from fuzz_draw import _OBJ, COMPLEX, FLOATS, INTS, Sym, dt, lit, shape_src
from fuzz_exprs import GenExprs
from fuzz_source import Step


class GenSteps(GenExprs):
    """The generator's value, submodule and edit steps."""

    # ---------------------------------------------------------------- steps
    def s_new(self) -> Step | None:
        tags: set[str] = {"step:new"}
        lines: list[str] = []
        e, s = self.expr(tags, lines)
        if self.store(e, s, tags, lines) is None:
            return None
        return Step(tuple(lines), frozenset(tags))

    def s_reassign(self) -> Step | None:
        """``self.b = <new value>`` on an existing buffer / attribute (``self.inv_freq = ...`` recomputed)."""
        s = self.pick_sym(lambda s: s.where in ("buffer", "attr"), use="reassign")
        if s is None:
            return None
        tags: set[str] = {"step:reassign", f"reassign-on:{s.where}"}
        lines: list[str] = []
        e, v = self.expr(tags, lines)
        lines.append(f"{s.expr} = {e}")
        if v.rg:
            tags.add("store:grad_tracked")
        self.syms[s.expr] = dataclasses.replace(v, expr=s.expr, where=s.where, ref=False)
        return Step(tuple(lines), frozenset(tags))

    def s_module(self) -> Step | None:
        if self.phase != "init" and not self.ok("post:new_module"):
            return None
        step = self._module()
        if step is not None and self.phase != "init":
            step = Step(step.lines, step.tags | {"post:new_module"})
        return step

    def _module(self) -> Step | None:
        real = self.outside_capture
        opt = self.pick([("mod:Linear",), ("mod:Embedding",), ("mod:LayerNorm",), ("mod:Conv1d",), ("mod:Conv2d",),
                         ("mod:GRU",), ("mod:LSTM",), ("mod:BatchNorm1d",), ("mod:ModuleList",), ("mod:MultiheadAttention",),
                         ("mod:deepcopy",), ("mod:spectral_norm",), ("mod:weight_norm",), ("mod:orthogonal",),
                         (("mod:weight_norm_old", "store:grad_tracked"),), ("mod:Embedding_from_pretrained",)])
        if opt is None:
            return None
        first = opt[0] if isinstance(opt[0], str) else opt[0][0]
        tags = {"step:module"} | ({opt[0]} if isinstance(opt[0], str) else set(opt[0]))
        kind = first.split(":")[1]
        if kind == "deepcopy":
            mods = [m for m in self.modules if "[" not in m]
            if not mods:
                return None
            src_m = self.choose(mods)
            name = f"self.{self.fresh('m')}"
            for e, sy in list(self.syms.items()):
                if e.startswith(src_m + ".") or e.startswith(src_m + "["):
                    ne = name + e[len(src_m):]
                    self.syms[ne] = dataclasses.replace(sy, expr=ne, obj=next(_OBJ), real=sy.real)
            self.modules[name] = self.modules[src_m]
            return Step((f"{name} = copy.deepcopy({src_m})",), frozenset(tags))
        if kind == "Embedding_from_pretrained":
            src_s = self.pick_sym(lambda s: s.known and s.ndim == 2 and s.dtype in ("float32", "float64"))
            if src_s is None:
                return None
            name = f"self.{self.fresh('m')}"
            freeze = self.boolean()
            tags.add(f"use-on:{src_s.where}")
            self.syms[f"{name}.weight"] = Sym(f"{name}.weight", src_s.shape, src_s.dtype, "modparam", rg=not freeze,
                                              real=src_s.real)
            return Step((f"{name} = nn.Embedding.from_pretrained({src_s.expr}, freeze={freeze})",), frozenset(tags))
        name = f"self.{self.fresh('m')}"
        kw, d = "", self.default
        if self.ok("mod:dtype") and self.choose([False, False, False, True]):
            kw, d = ", dtype=torch.float64", "float64"
            tags.add("mod:dtype")
        params: list[tuple[str, tuple[int, ...], str]] = []  # (suffix, shape, where)
        if kind in ("Linear", "ModuleList"):
            i, o, b = self.integer(1, 5), self.integer(1, 5), self.boolean()
            if kind == "Linear":
                src = f"{name} = nn.Linear({i}, {o}, bias={b}{kw})"
                params = [("weight", (o, i), "modparam")] + ([("bias", (o,), "modparam")] if b else [])
            else:
                src = f"{name} = nn.ModuleList([nn.Linear({i}, {o}, bias={b}{kw}) for _ in range(2)])"
                for k in range(2):
                    params += [(f"[{k}].weight", (o, i), "modparam")] + ([(f"[{k}].bias", (o,), "modparam")] if b else [])
        elif kind == "Embedding":
            n, dm = self.integer(1, 6), self.integer(1, 4)
            pad = self.draw(st.one_of(st.none(), st.integers(-n, n - 1)))
            src = f"{name} = nn.Embedding({n}, {dm}, padding_idx={pad}{kw})"
            params = [("weight", (n, dm), "modparam")]
            if pad is not None:
                tags.add("mod:padding_idx")
        elif kind == "LayerNorm":
            n, aff = self.integer(1, 5), self.boolean()
            src = f"{name} = nn.LayerNorm({n}, elementwise_affine={aff}{kw})"
            params = [("weight", (n,), "modparam"), ("bias", (n,), "modparam")] if aff else []
        elif kind == "Conv1d":
            g = self.integer(1, 2)
            ci, co, k, b = g * self.integer(1, 3), g * self.integer(1, 3), self.integer(1, 3), self.boolean()
            src = f"{name} = nn.Conv1d({ci}, {co}, {k}, groups={g}, bias={b}{kw})"
            params = [("weight", (co, ci // g, k), "modparam")] + ([("bias", (co,), "modparam")] if b else [])
        elif kind == "Conv2d":
            ci, co, k, b = self.integer(1, 3), self.integer(1, 3), self.integer(1, 3), self.boolean()
            src = f"{name} = nn.Conv2d({ci}, {co}, {k}, bias={b}{kw})"
            params = [("weight", (co, ci, k, k), "modparam")] + ([("bias", (co,), "modparam")] if b else [])
        elif kind in ("GRU", "LSTM"):
            i, h, layers, b, bi = self.integer(1, 3), self.integer(1, 3), self.integer(1, 2), self.boolean(), self.boolean()
            g = 3 if kind == "GRU" else 4
            src = f"{name} = nn.{kind}({i}, {h}, num_layers={layers}, bias={b}, bidirectional={bi}{kw})"
            dirs = 2 if bi else 1
            for layer in range(layers):
                for sfx in ([""] + (["_reverse"] if bi else [])):
                    inp = i if layer == 0 else h * dirs
                    params += [(f"weight_ih_l{layer}{sfx}", (g * h, inp), "modparam"),
                               (f"weight_hh_l{layer}{sfx}", (g * h, h), "modparam")]
                    if b:
                        params += [(f"bias_ih_l{layer}{sfx}", (g * h,), "modparam"),
                                   (f"bias_hh_l{layer}{sfx}", (g * h,), "modparam")]
        elif kind == "MultiheadAttention":
            h = self.integer(1, 2)
            e_ = h * self.integer(1, 2)
            b = self.boolean()
            src = f"{name} = nn.MultiheadAttention({e_}, {h}, bias={b}{kw})"
            params = [("in_proj_weight", (3 * e_, e_), "modparam"), ("out_proj.weight", (e_, e_), "modparam")]
            if b:
                params += [("in_proj_bias", (3 * e_,), "modparam"), ("out_proj.bias", (e_,), "modparam")]
        elif kind in ("spectral_norm", "weight_norm", "orthogonal", "weight_norm_old"):
            i, o = self.integer(1, 4), self.integer(1, 4)
            if kind == "orthogonal":
                i = o
            fn = {"spectral_norm": "nn.utils.parametrizations.spectral_norm", "weight_norm": "nn.utils.parametrizations.weight_norm",
                  "orthogonal": "nn.utils.parametrizations.orthogonal", "weight_norm_old": "nn.utils.weight_norm"}[kind]
            src = f"{name} = {fn}(nn.Linear({i}, {o}{kw}))"
            params = [("bias", (o,), "modparam")]
            if kind in ("spectral_norm", "orthogonal"):
                params.append(("parametrizations.weight.original", (o, i), "modparam"))
            elif kind == "weight_norm":
                params += [("parametrizations.weight.original0", (o, 1), "modparam"),
                           ("parametrizations.weight.original1", (o, i), "modparam")]
            else:
                params += [("weight_g", (o, 1), "modparam"), ("weight_v", (o, i), "modparam")]
            for sfx, shape, where in params:
                self.syms[f"{name}.{sfx}"] = Sym(f"{name}.{sfx}", shape, d, where, rg=True, real=real)
            return Step((src,), frozenset(tags))
        else:  # BatchNorm1d
            n, aff = self.integer(1, 5), self.boolean()
            src = f"{name} = nn.BatchNorm1d({n}, affine={aff}{kw})"
            params = ([("weight", (n,), "modparam"), ("bias", (n,), "modparam")] if aff else [])
            params += [("running_mean", (n,), "modbuffer"), ("running_var", (n,), "modbuffer")]
            self.syms[f"{name}.num_batches_tracked"] = Sym(f"{name}.num_batches_tracked", (), "int64", "modbuffer", real=real)
        for sfx, shape, where in params:
            expr = f"{name}{'' if sfx.startswith('[') else '.'}{sfx}"
            self.syms[expr] = Sym(expr, shape, d, where, rg=where == "modparam", real=real)
        if kind == "ModuleList":
            self.modules[f"{name}[0]"] = "Linear"
            self.modules[f"{name}[1]"] = "Linear"
        else:
            self.modules[name] = kind
        return Step((src,), frozenset(tags))

    def _target(self, pred: Callable[[Sym], bool], tags: set[str]) -> Sym | None:
        s = self.pick_sym(lambda s: s.writable and pred(s), use="edit")
        if s is not None:
            tags.add(f"edit-on:{s.where}")
            if s.real:
                tags.add("edit-on:real")
        return s

    def _access(self, s: Sym, tags: set[str], body: Callable[[str], str]) -> list[str]:
        """The edit ``body(x)`` of ``s`` under ``torch.no_grad()``, through ``.data``, or bare."""
        opts = [("access:no_grad",), ("access:data",)] + ([] if s.rg else [("access:bare",)])
        a = self.pick(opts) or ("access:no_grad",)
        tags.add(a[0])
        if a[0] == "access:no_grad":
            return ["with torch.no_grad():", "    " + body(s.expr)]
        if a[0] == "access:data":
            return [body(f"{s.expr}.data")]
        return [body(s.expr)]

    def s_fill(self) -> Step | None:
        tags: set[str] = {"step:fill"}
        s = self._target(lambda s: s.is_float, tags)
        if s is None:
            return None
        nd = s.ndim
        fills = [("fill:normal_", "nn.init.normal_({}, mean={m}, std={sd}{g})", True),
                 ("fill:uniform_", "nn.init.uniform_({}, {a}, {b}{g})", True),
                 ("fill:constant_", "nn.init.constant_({}, {v})", True),
                 ("fill:zeros_", "nn.init.zeros_({})", True),
                 ("fill:ones_", "nn.init.ones_({})", True),
                 ("fill:trunc_normal_", "nn.init.trunc_normal_({}, std={sd}{tr}{g})", True),
                 ("fill:kaiming_uniform_", "nn.init.kaiming_uniform_({}, a=math.sqrt(5){g})", nd >= 2),
                 ("fill:kaiming_normal_", "nn.init.kaiming_normal_({}, mode='fan_out', nonlinearity='relu'{g})", nd >= 2),
                 ("fill:xavier_uniform_", "nn.init.xavier_uniform_({}{gain}{g})", nd >= 2),
                 ("fill:xavier_normal_", "nn.init.xavier_normal_({}{g})", nd >= 2),
                 ("fill:orthogonal_", "nn.init.orthogonal_({}{gain}{g})", nd >= 2),
                 ("fill:sparse_", "nn.init.sparse_({}, sparsity=0.5{g})", nd == 2),
                 ("fill:eye_", "nn.init.eye_({})", nd == 2),
                 ("fill:dirac_", "nn.init.dirac_({}, groups={groups})", 3 <= nd <= 5),
                 ("fill:method_normal_", "{}.normal_({m}, {sd}{g})", True),
                 ("fill:method_uniform_", "{}.uniform_({a}, {b}{g})", True),
                 ("fill:bernoulli_", "{}.bernoulli_(0.5{g})", True),
                 ("fill:exponential_", "{}.exponential_({g0})", True),
                 ("fill:log_normal_", "{}.log_normal_({g0})", True),
                 ("fill:cauchy_", "{}.cauchy_({g0})", True),
                 ("fill:geometric_", "{}.geometric_(0.3{g})", True),
                 ("fill:random_", "{}.random_(0, 10{g})", True)]
        fills.append(("fill:timm_trunc_normal", None, True))
        f = self.pick([o for o in fills if o[2]])
        if f is None:
            return None
        tags.add(f[0])
        if f[0] == "fill:timm_trunc_normal":  # timm's _trunc_normal_ / _no_grad_trunc_normal_, written out
            x = s.expr if not s.rg else f"{s.expr}.data"
            tags.add("access:data" if s.rg else "access:bare")
            lo, hi = self.choose([(-2.0, 2.0), (-0.04, 0.04)])
            std = self.choose(["0.02", "1.0"])
            lines = [f"_l = (1.0 + math.erf(({lo} / {std}) / math.sqrt(2.0))) / 2.0",
                     f"_u = (1.0 + math.erf(({hi} / {std}) / math.sqrt(2.0))) / 2.0",
                     f"{x}.uniform_(2 * _l - 1, 2 * _u - 1{self.gen_kw(tags)})", f"{x}.erfinv_()",
                     f"{x}.mul_({std} * math.sqrt(2.0))", f"{x}.clamp_(min={lo}, max={hi})"]
            return Step(tuple(lines), frozenset(tags))
        g = self.gen_kw(tags)
        groups = 1
        if f[0] == "fill:dirac_" and s.shape[0] % 2 == 0 and self.boolean():
            groups = 2
        fmt = dict(m=self.choose(["0.0", "1.0"]), sd=self.choose(["0.02", "1.0"]),
                   a=self.choose(["-0.1", "0.0"]), b=self.choose(["0.1", "1.0"]),
                   v=lit(self.float_value()), g=g, g0=g[2:], groups=groups,
                   gain=self.choose(["", ", gain=nn.init.calculate_gain('relu')"]),
                   tr=self.choose(["", ", a=-0.04, b=0.04"]))
        template = f[1]
        if template.startswith("nn.init.") and self.boolean():
            # init functions run under no_grad themselves: called on the tensor or on .data
            arg = s.expr if self.boolean() else f"{s.expr}.data"
            tags.add("access:init_fn" if arg == s.expr else "access:data")
            return Step((template.format(arg, **fmt),), frozenset(tags))
        lines = self._access(s, tags, lambda x: template.format(x, **fmt))
        return Step(tuple(lines), frozenset(tags))

    def s_edit(self) -> Step | None:
        tags: set[str] = {"step:edit"}
        s = self._target(lambda s: True, tags)
        if s is None:
            return None
        d = s.dtype
        num = d != "bool"
        flt = d in FLOATS
        other = None
        if s.known:
            other = self.pick_sym(lambda o: o.known and o.obj != s.obj and (o.shape == s.shape or o.shape == ())
                                  and (o.dtype in FLOATS + INTS if d not in COMPLEX else True) and o.dtype != "bool")
        c = "2" if d in INTS else "0.5"
        ops = [("edit:fill_", f"{{}}.fill_({lit(self.value_for(d))})", True),
               ("edit:zero_", "{}.zero_()", True),
               ("edit:add_", f"{{}}.add_({c if d not in INTS else 1})", num),
               ("edit:mul_", f"{{}}.mul_({c})", num),
               ("edit:div_", "{}.div_(3.0)", flt),
               ("edit:clamp_", "{}.clamp_(-0.5, 0.5)" if flt else "{}.clamp_(0, 3)", num and d not in COMPLEX),
               ("edit:neg_", "{}.neg_()", num and d != "uint8"),
               ("edit:sqrt_", "{}.sqrt_()", flt),
               ("edit:exp_", "{}.exp_()", flt),
               ("edit:copy_", "{}.copy_(%s)" % (other.expr if other else ""), other is not None),
               ("edit:copy_self", "{}.copy_({})", True),
               ("edit:scatter_", "{}.scatter_(0, torch.tensor([0]), %s)" % lit(self.value_for(d)),
                s.known and s.ndim == 1 and s.numel > 0),
               ("edit:add_tensor", "{}.add_(%s, alpha=0.5)" % (other.expr if other else ""),
                other is not None and flt and other.dtype in FLOATS),
               ("edit:mul_tensor", "{}.mul_(%s)" % (other.expr if other else ""), other is not None and flt and other.dtype in FLOATS),
               ("edit:div_norm", "{}.div_({}.norm())", flt and s.known),
               ("edit:masked_fill_", "{}.masked_fill_(torch.arange(%d).reshape(%s) %% 2 == 0, 0)"
                % (max(s.numel, 0), shape_src(s.shape or ())), s.known),
               ("edit:index_fill_", "{}.index_fill_(0, torch.tensor([0]), 1)", s.known and s.ndim >= 1 and (s.shape[0] > 0)),
               ("edit:addcmul_", "{}.addcmul_({}, {}, value=0.5)", flt),
               ("edit:t_", "{}.t_()", s.known and s.ndim == 2 and s.where in ("local", "attr", "list", "dict")),
               ("edit:requires_grad_", "{}.requires_grad_(False)", s.where in ("param", "modparam", "paramlist") and s.rg),
               ("edit:data_assign", None, s.where in ("param", "modparam", "paramlist", "buffer", "attr", "arg"))]
        ops += [ops[-1]] * (3 if s.real else 0)  # real tensors (arguments, numpy data) rebound to deferred data
        op = self.pick([o for o in ops if o[2]])
        if op is None:
            return None
        tags.add(op[0])
        if op[0] == "edit:requires_grad_":
            self.syms[s.expr] = dataclasses.replace(s, rg=False)
            return Step((f"{s.expr}.requires_grad_(False)",), frozenset(tags))
        if op[0] == "edit:data_assign":
            lines: list[str] = []
            e, v = self.expr(tags, lines)
            if (v.dtype in FLOATS + COMPLEX) != (s.dtype in FLOATS + COMPLEX) or (v.dtype in COMPLEX) != (s.dtype in COMPLEX):
                e = f"({e}).to({dt(s.dtype)})"
                v = dataclasses.replace(v, dtype=s.dtype)
            lines.append(f"{s.expr}.data = {e}")
            if s.real or v.real:  # a real tensor and a deferred one (or two real ones)
                tags.add("edit:data_assign_real")
            self.syms[s.expr] = dataclasses.replace(s, shape=v.shape, dtype=v.dtype, contiguous=v.contiguous)
            return Step(tuple(lines), frozenset(tags))
        if op[0] in ("edit:copy_", "edit:add_tensor", "edit:mul_tensor"):
            tags.add(f"read-on:{other.where}")
        if op[0] == "edit:t_":
            self.syms[s.expr] = dataclasses.replace(s, shape=s.shape[::-1], contiguous=False)
        lines = self._access(s, tags, lambda x: op[1].format(x, x, x))
        if ("access:bare" in tags and op[0] in ("edit:copy_", "edit:add_tensor", "edit:mul_tensor") and other.rg
                and not s.rg):
            # outside no_grad, an in-place op with a tensor that requires grad makes the target one
            # computed with autograd (eager: grad_fn CopyBackwards...)
            tags.add("store:grad_tracked")
            for e_, y in list(self.syms.items()):
                if y.obj == s.obj:
                    self.syms[e_] = dataclasses.replace(y, rg=True)
        return Step(tuple(lines), frozenset(tags))

    def s_view_edit(self) -> Step | None:
        tags: set[str] = {"step:view_edit"}
        s = self._target(lambda s: s.known and s.ndim >= 1 and s.numel > 0, tags)
        if s is None:
            return None
        v = lit(self.value_for(s.dtype))
        shape = s.shape
        views = [("view:index_op", f"{{}}[{self.integer(0, shape[0] - 1)}].zero_()", True),
                 ("view:setitem_col", f"{{}}[:, {self.integer(0, shape[1] - 1) if s.ndim >= 2 else 0}] = {v}", s.ndim >= 2),
                 ("view:index_tensor", f"{{}}[torch.tensor([0, {shape[0] - 1}])] = {v}", True),
                 ("view:setitem_row", f"{{}}[{self.integer(0, shape[0] - 1)}] = {v}", True),
                 ("view:t_op", "{}.t()[0].fill_(%s)" % v, s.ndim == 2),
                 ("view:flat_stride", "{}.view(-1)[::2].fill_(%s)" % v, s.contiguous),
                 ("view:diagonal_op", "{}.diagonal().fill_(%s)" % v, s.ndim >= 2),
                 ("view:narrow_op", "{}.narrow(0, 0, 1).mul_(2)", s.dtype != "bool"),
                 ("view:ellipsis", "{}[..., -1] = {}[..., 0]", True),
                 ("view:real_op", "{}.real.fill_(1.0)", s.dtype in COMPLEX),
                 ("view:dtype_view", "{}.view(torch.int32)[0] = 0", s.dtype == "float32" and s.ndim == 1 and s.contiguous),
                 ("view:mask_assign", "{}[{} > 0] = 0", s.dtype in FLOATS),
                 ("view:unbind_op", "{}.unbind(0)[0].add_(1)", s.dtype not in ("bool",)),
                 ("view:chunk_op", "{}.chunk(2)[-1].zero_()", True)]
        vw = self.pick([o for o in views if o[2]])
        if vw is None:
            return None
        tags.add(vw[0])
        lines = self._access(s, tags, lambda x: vw[1].format(x, x))
        return Step(tuple(lines), frozenset(tags))

    def s_tie(self) -> Step | None:
        tags: set[str] = {"step:tie"}
        opt = self.pick([("tie:module_param",), ("tie:param_attr",), ("tie:buffer_alias",), ("tie:module",),
                         ("tie:list_alias",)])
        if opt is None:
            return None
        tags.add(opt[0])
        if opt[0] == "tie:module_param":
            a = self.pick_sym(lambda s: s.where == "modparam" and s.expr.endswith(".weight"))
            if a is None:
                return None
            targets = [s for s in self.syms_where(lambda s: s.where == "modparam" and s.expr.endswith(".weight")
                                                   and s.expr != a.expr)]
            if not targets:
                return None
            b = self.choose(targets)
            self.syms[b.expr] = dataclasses.replace(a, expr=b.expr)
            return Step((f"{b.expr} = {a.expr}",), frozenset(tags))
        if opt[0] == "tie:param_attr":
            a = self.pick_sym(lambda s: s.where in ("param", "modparam"))
            if a is None:
                return None
            name = f"self.{self.fresh('w')}"
            self.syms[name] = dataclasses.replace(a, expr=name, where="param")
            return Step((f"{name} = {a.expr}",), frozenset(tags | {f"use-on:{a.where}"}))
        if opt[0] == "tie:buffer_alias":
            a = self.pick_sym(lambda s: s.where in ("param", "modparam", "paramlist") and s.known and s.ndim >= 1)
            if a is None:
                return None
            name = self.fresh("b")
            how = self.choose([".data", ".detach()", ".data[0]"])
            if how == ".data[0]" and a.shape[0] == 0:
                how = ".data"
            self.syms[f"self.{name}"] = dataclasses.replace(a, expr=f"self.{name}", where="buffer", rg=False, obj=next(_OBJ),
                                                            shape=a.shape[1:] if how == ".data[0]" else a.shape)
            return Step((f'self.register_buffer("{name}", {a.expr}{how})',), frozenset(tags | {f"use-on:{a.where}"}))
        if opt[0] == "tie:module":
            mods = [m for m in self.modules if "[" not in m]
            if not mods or self.phase != "init":
                return None
            m = self.choose(mods)
            name = f"self.{self.fresh('m')}"
            for e, s in list(self.syms.items()):
                if e.startswith(m + "."):
                    ne = name + e[len(m):]
                    self.syms[ne] = dataclasses.replace(s, expr=ne)
            self.modules[name] = self.modules[m]
            return Step((f"{name} = {m}",), frozenset(tags))
        a = self.pick_sym(lambda s: s.where in ("param", "modparam", "buffer"))
        if a is None:
            return None
        lines = []
        if not self.has["lst"]:
            lines.append("self.lst = []")
            self.has["lst"] = True
        lines.append(f"self.lst.append({a.expr})")
        self.syms[f"self.lst[{self.lst_len}]"] = dataclasses.replace(a, expr=f"self.lst[{self.lst_len}]", where="list")
        self.lst_len += 1
        return Step(tuple(lines), frozenset(tags | {"store:list"}))
