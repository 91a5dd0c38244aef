"""The grammar's tensor expressions: ``GenExprs`` adds to the generator the expressions that
make a tensor (factories, values derived from existing tensors, ``*_like``, numpy data,
``torch.load``, idioms) and ``store``, which keeps a new value (parameter, buffer, attribute,
local, list, dict...). Part of the capture fuzzer (see ``fuzz_programs``)."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import torch
from hypothesis import strategies as st

from fuzz_draw import _OBJ, COMPLEX, FLOATS, INTS, NP_OK, GenBase, Sym, dt, lit, shape_src


#: stores under a key: kind -> (attribute, what makes it, ``Sym.where``, key prefix, key access)
_KEYED = {"store:dict": ("dct", "{}", "dict", "k", '["{}"]'),
          "store:holder": ("holder", "types.SimpleNamespace()", "holder", "h", ".{}"),
          "store:odict": ("odct", "collections.OrderedDict()", "odict", "k", '["{}"]')}


class GenExprs(GenBase):
    """The generator's tensor expressions and ``store``."""

    # ---------------------------------------------------------------- tensor expressions
    def expr(self, tags: set[str], lines: list[str], want_float: bool = False) -> tuple[str, Sym]:
        """A new tensor value: (source expression, a Sym describing it, with ``expr`` unset)."""
        kinds = [("fac", self.factory), ("fac", self.factory), ("der", self.derived), ("der", self.derived), ("like", self.like),
                 ("np", self.numpy_expr), ("load", self.load_expr), ("idiom", self.idiom)]
        for _ in range(6):
            kind, fn = self.choose(kinds)
            res = fn(tags, lines)
            if res is not None and (not want_float or res[1].dtype in FLOATS + COMPLEX):
                return res
        return self.factory(tags, lines, force="randn")

    def factory(self, tags: set[str], lines: list[str], force: str | None = None) -> tuple[str, Sym] | None:
        t: set[str] = set()
        opts = [("fac:zeros",), ("fac:randn",), ("fac:ones",), ("fac:full",), ("fac:rand",), ("fac:arange",),
                ("fac:empty",), ("fac:linspace",), ("fac:eye",), ("fac:randint",), ("fac:randperm",),
                ("fac:tensor",), ("fac:arange_float",), ("fac:distributions",), ("fac:bernoulli_fn",), ("fac:normal_fn",)]
        which = f"fac:{force}" if force else (self.pick(opts) or ("fac:zeros",))[0]
        t.add(which)
        kind = which.split(":")[1]
        if kind in ("zeros", "ones"):
            shape = self.shape()
            kw, d = self.dtype_kw(FLOATS + INTS + ("bool",) + COMPLEX, t)
            e = f"torch.{kind}({shape_src(shape)}{kw})"
        elif kind == "full":
            shape = self.shape()
            kw, d = self.dtype_kw(FLOATS + INTS + ("bool",), t)
            v = self.value_for(d)
            e = f"torch.full({shape_src(shape)}, {lit(v)}{kw})"
            if not kw:
                d = "bool" if isinstance(v, bool) else "int64" if isinstance(v, int) else self.default
        elif kind in ("rand", "randn"):
            shape = self.shape()
            kw, d = self.dtype_kw(FLOATS + (COMPLEX if kind == "randn" else ()), t)
            e = f"torch.{kind}({shape_src(shape)}{kw}{self.gen_kw(t)})"
        elif kind == "empty":
            shape = self.shape()
            kw, d = self.dtype_kw(FLOATS + INTS, t)
            fill = self.pick([("fill:normal_", "normal_()"), ("fill:uniform_", "uniform_(-0.5, 0.5)"),
                              ("edit:fill_", f"fill_({lit(self.value_for(d))})"), ("edit:zero_", "zero_()"),
                              ("fill:random_", "random_(0, 5)")]) or ("edit:zero_", "zero_()")
            if d not in FLOATS and fill[0] in ("fill:normal_", "fill:uniform_"):
                fill = ("fill:random_", "random_(0, 5)")
            t.add(fill[0])
            e = f"torch.empty({shape_src(shape)}{kw}).{fill[1]}"
        elif kind == "arange":
            n = self.integer(0, 8)
            kw, d = self.dtype_kw(("float32", "float64", "int32", "bfloat16"), t)
            if not kw:
                d = "int64"
            e = f"torch.arange({n}{kw})"
            shape = (n,)
        elif kind == "arange_float":
            a, b, s = self.choose([(0, 4, 0.5), (0.0, 1.0, 0.25), (-1, 1, 0.3), (0, 8, 2)])
            e = f"torch.arange({a}, {b}, {s})"
            shape = tuple(torch.arange(a, b, s).shape)
            d = self.default if any(isinstance(x, float) for x in (a, b, s)) else "int64"
        elif kind == "linspace":
            n = self.integer(0, 7)
            kw, d = self.dtype_kw(("float64",), t)
            e = f"torch.linspace({self.choose(['0', '-1.0', '0.1'])}, 1, {n}{kw})"
            shape = (n,)
        elif kind == "eye":
            n, m = self.integer(1, 4), self.integer(1, 4)
            kw, d = self.dtype_kw(("float64", "int64", "bool"), t)
            e = f"torch.eye({n}, {m}{kw})"
            shape = (n, m)
        elif kind == "randint":
            shape = self.shape()
            kw, d = self.dtype_kw(("float32", "int32", "uint8"), t)
            if not kw:
                d = "int64"
            e = f"torch.randint(0, {self.integer(1, 10)}, {shape_src(shape)}{kw}{self.gen_kw(t)})"
        elif kind == "distributions":
            shape = self.shape()
            dist = self.choose(["torch.distributions.Normal(0.0, 1.0)", "torch.distributions.Uniform(-1.0, 1.0)",
                                              "torch.distributions.Bernoulli(0.3)"])
            e = f"{dist}.sample({shape_src(shape)})"
            d = "float32"
        elif kind == "bernoulli_fn":
            shape = self.shape()
            e = f"torch.bernoulli(torch.full({shape_src(shape)}, 0.5){self.gen_kw(t)})"
            d = self.default
        elif kind == "normal_fn":
            shape = self.shape()
            e = f"torch.normal(torch.zeros({shape_src(shape)}), 0.5{self.gen_kw(t)})"
            d = self.default
        elif kind == "randperm":
            n = self.integer(0, 8)
            e = f"torch.randperm({n}{self.gen_kw(t)})"
            shape, d = (n,), "int64"
        else:  # tensor of python lists
            shape = self.shape(max_ndim=2)
            pk = self.choose(["float", "int", "bool", "complex"])
            vals = np.arange(math.prod(shape)).reshape(shape)
            if pk == "float":
                data = (vals * 0.5 - 1.0).tolist()
                d = self.default
            elif pk == "int":
                data = (vals - 2).tolist()
                d = "int64"
            elif pk == "bool":
                data = (vals % 2 == 0).tolist()
                d = "bool"
            else:
                if self.default not in ("float32", "float64") or not self.ok("dtype:complex"):
                    return None
                data = (vals * (0.5 + 1j)).tolist()
                d = self.complex_default()
                t.add("dtype:complex")
            kw, d2 = self.dtype_kw(("float64", "int32"), t) if pk != "complex" else ("", d)
            if kw:
                d = d2
            e = f"torch.tensor({data!r}{kw})"
            if shape == ():
                e = f"torch.tensor({data!r}{kw})"
        if d in COMPLEX and not self.ok("dtype:complex"):
            return None
        if d in COMPLEX:
            t.add("dtype:complex")
        tags |= t
        return e, Sym("", tuple(shape), d, "", real=self.outside_capture)

    def derived(self, tags: set[str], lines: list[str]) -> tuple[str, Sym] | None:
        s = self.pick_sym(lambda s: s.known)
        if s is None:
            return None
        t = {f"use-on:{s.where}"}
        x = s.expr
        opt = self.pick([
            ("der:clone",), ("der:detach_clone",), ("der:arith",), ("der:cast",), ("der:ref",), ("der:view",),
            ("der:reduce",), ("der:cat",), ("der:math",), ("der:where",), ("der:contiguous_t",), ("der:reshape",),
            ("der:complex",), ("der:masked_fill",), ("der:expand",),
        ])
        if opt is None:
            return None
        kind = opt[0]
        t.add(kind)
        shape, d, contiguous, writable = s.shape, s.dtype, True, True
        rg = s.rg
        if kind == "der:clone":
            e = f"{x}.clone()"
            contiguous = s.contiguous
        elif kind == "der:detach_clone":
            e = f"{x}.detach().clone()"
            rg = False
        elif kind == "der:arith":
            if d == "bool":
                return None
            c = self.choose(["2", "0.5", "-1"]) if d not in FLOATS + COMPLEX else self.choose(["2.0", "0.5", "1e-3"])
            e = f"{x} * {c} + 1"
            if d in INTS and "." in c:
                d = self.default
        elif kind == "der:cast":
            targets = [("cast:float64", ".double()", "float64"), ("cast:float16", ".half()", "float16"),
                       ("cast:bfloat16", ".bfloat16()", "bfloat16"), ("cast:float32", ".float()", "float32"),
                       ("cast:int64", ".long()", "int64"), ("cast:bool", ".bool()", "bool"),
                       ("cast:to", ".to(torch.float64)", "float64"), ("cast:int32", ".to(torch.int32)", "int32"),
                       ("cast:complex", ".to(torch.complex64)", "complex64"), ("cast:to_same", f".to({dt(d)})", d),
                       ("cast:to_device", '.to("cpu")', d), ("cast:cpu", ".cpu()", d),
                       ("cast:to_device_dtype", '.to(device="cpu", dtype=torch.float64)', "float64"),
                       ("cast:type_as", ".type_as(torch.zeros(1, dtype=torch.float64))", "float64"),
                       ("cast:to_other", ".to(torch.zeros(1, dtype=torch.float16))", "float16")]
            c = self.pick(targets)
            if c is None:
                return None
            if c[2] in COMPLEX and (not self.ok("dtype:complex") or d in COMPLEX):
                return None
            if d in COMPLEX and c[2] not in COMPLEX:
                return None
            t.add(c[0])
            e = f"{x}{c[1]}"
            d = c[2]
            if d not in FLOATS + COMPLEX:
                rg = False
        elif kind == "der:ref":
            e = x  # the same tensor object
            contiguous, writable = s.contiguous, s.writable
        elif kind == "der:view":
            if s.ndim == 0:
                return None
            views = [("view:index0", f"{x}[0]", shape[1:], s.shape[0] > 0),
                     ("view:detach", f"{x}.detach()", shape, True),
                     ("view:data", f"{x}.data", shape, True),
                     ("view:t", f"{x}.t()", shape[::-1], s.ndim <= 2),
                     ("view:flat", f"{x}.view(-1)", (s.numel,), s.contiguous),
                     ("view:slice", f"{x}[1:]", (max(0, shape[0] - 1),) + shape[1:], True),
                     ("view:unsqueeze", f"{x}.unsqueeze(0)", (1,) + shape, True),
                     ("view:diagonal", f"{x}.diagonal()", (min(shape[0], shape[1]) if s.ndim >= 2 else 0,) + shape[2:], s.ndim == 2),
                     ("view:real", f"{x}.real", shape, d in COMPLEX)]
            v = self.pick([o for o in views if o[3]])
            if v is None:
                return None
            t.add(v[0])
            e, shape = v[1], tuple(v[2])
            contiguous = v[0] in ("view:detach", "view:data", "view:flat", "view:unsqueeze") and s.contiguous or (v[0] == "view:index0" and s.contiguous)
            if v[0] in ("view:detach", "view:data"):
                rg = False
            if v[0] == "view:real":
                d = "float32" if d == "complex64" else "float64"
                contiguous = False
        elif kind == "der:reduce":
            if d in ("bool",) or s.numel == 0:
                return None
            r = self.choose(["sum", "norm", "mean", "amax"])
            if r in ("norm", "mean") and d not in FLOATS:
                return None
            e = f"{x}.{r}()"
            shape = ()
            if r == "sum" and d in INTS + ("bool",):
                d = "int64"
        elif kind == "der:cat":
            if s.ndim == 0:
                return None
            e = f"torch.cat([{x}, {x}])"
            shape = (shape[0] * 2,) + shape[1:]
        elif kind == "der:math":
            if d not in FLOATS:
                return None
            f = self.choose(["torch.cos({})", "{}.exp()", "torch.log({})", "{} / 0", "torch.sigmoid({})",
                                           "F.normalize({}, dim=-1)" if s.ndim >= 1 else "torch.tanh({})"])
            e = f.format(x)
            if "log" in f or "/ 0" in f:
                t.add("der:nan")
        elif kind == "der:where":
            if d not in FLOATS:
                return None
            e = f"torch.where({x} > 0, {x}, torch.zeros_like({x}))"
        elif kind == "der:contiguous_t":
            if s.ndim != 2:
                return None
            e = f"{x}.t().contiguous()"
            shape = shape[::-1]
        elif kind == "der:reshape":
            e = f"{x}.reshape(-1)"
            shape = (s.numel,)
            # reshape of a contiguous tensor is a view
            contiguous = True
        elif kind == "der:complex":
            if d not in ("float32", "float64") or not self.ok("dtype:complex"):
                return None
            t.add("dtype:complex")
            if self.boolean():
                e = f"torch.complex({x}, {x} * 2)"
            else:
                e = f"torch.polar(torch.ones_like({x}), {x})"
            d = "complex64" if d == "float32" else "complex128"
            rg = False if not rg else rg
        elif kind == "der:masked_fill":
            if d not in FLOATS:
                return None
            e = f"{x}.masked_fill({x} > 0, {lit(self.float_value())})"
        else:  # expand: a non-writable broadcast view
            if s.ndim > 2:
                return None
            e = f"{x}.expand(2, *{x}.shape)"
            shape = (2,) + shape
            contiguous, writable = False, False
        tags |= t
        return e, Sym("", tuple(shape), d, "", rg=rg and d in FLOATS + COMPLEX, contiguous=contiguous, writable=writable,
                      obj=s.obj if kind == "der:ref" else next(_OBJ), ref=kind == "der:ref",
                      real=s.real)

    def like(self, tags: set[str], lines: list[str]) -> tuple[str, Sym] | None:
        s = self.pick_sym(lambda s: s.known)
        if s is None:
            return None
        x = s.expr
        t = {f"use-on:{s.where}"}
        opt = self.pick([("like:zeros_like",), ("like:randn_like",), ("like:full_like",), ("like:empty_like",),
                         ("like:new_zeros",), ("like:new_tensor",), ("like:rand_like",), ("like:new_empty",),
                         ("like:ones_like_dtype",)])
        if opt is None:
            return None
        kind = opt[0]
        t.add(kind)
        shape, d = s.shape, s.dtype
        if kind == "like:zeros_like":
            e = f"torch.zeros_like({x})" if self.boolean() else f'torch.zeros_like({x}, device="cpu")'
        elif kind in ("like:randn_like", "like:rand_like"):
            if d not in FLOATS:
                return None
            e = f"torch.{kind.split(':')[1]}({x})"
        elif kind == "like:full_like":
            e = f"torch.full_like({x}, {lit(self.value_for(d))})"
        elif kind == "like:empty_like":
            if d not in FLOATS:
                return None
            e = f"torch.empty_like({x}).normal_()"
            t.add("fill:normal_")
        elif kind == "like:new_zeros":
            shape = self.shape(max_ndim=2)
            e = f"{x}.new_zeros({shape_src(shape)})"
        elif kind == "like:new_empty":
            shape = self.shape(max_ndim=2)
            e = f"{x}.new_empty({shape_src(shape)}).fill_({lit(self.value_for(d))})"
        elif kind == "like:ones_like_dtype":
            e = f"torch.ones_like({x}, dtype=torch.float64)"
            d = "float64"
        else:
            shape = (3,)
            e = f"{x}.new_tensor([1, 2, 3])"
        tags |= t
        return e, Sym("", tuple(shape), d, "", contiguous=True, real=s.real)

    def numpy_expr(self, tags: set[str], lines: list[str]) -> tuple[str, Sym] | None:
        opt = self.pick([("np:from_numpy",), ("np:rng",), ("np:as_tensor",), ("np:tensor",), ("np:roundtrip_copy",),
                         ("np:roundtrip_alias",)])
        if opt is None:
            return None
        kind = opt[0]
        t = {kind}
        if kind in ("np:roundtrip_copy", "np:roundtrip_alias"):
            s = self.pick_sym(lambda s: s.known and s.dtype in NP_OK, use="read")
            if s is None:
                return None
            t.add(f"read-on:{s.where}")
            fn = "torch.tensor" if kind == "np:roundtrip_copy" else "torch.from_numpy"
            if kind == "np:roundtrip_alias" and self.outside_capture:
                t.add("np:roundtrip_alias_after_trace")  # in init_weights() called on the traced model
            e = f"{fn}({s.expr}.detach().numpy())"
            tags |= t
            return e, Sym("", s.shape, s.dtype, "", contiguous=True, real=kind == "np:roundtrip_alias")
        shape = self.shape(min_ndim=1)
        n = math.prod(shape)
        if kind == "np:from_numpy":
            npd = self.choose(["float32", "float64", "int64", "int32", "bool"])
            if npd == "bool":
                e = f"torch.from_numpy(np.arange({n}).reshape({shape_src(shape)}) % 2 == 0)"
            else:
                e = f"torch.from_numpy(np.arange({n}, dtype=np.{npd}).reshape({shape_src(shape)}))"
            d = npd
        elif kind == "np:rng":
            e = f"torch.from_numpy(np.random.default_rng({self.integer(0, 3)}).standard_normal({shape_src(shape)}).astype(np.float32))"
            d = "float32"
        elif kind == "np:as_tensor":
            e = f"torch.as_tensor(np.linspace(0, 1, {n}).reshape({shape_src(shape)}))"
            d = "float64"
        else:
            e = f"torch.tensor(np.ones({shape_src(shape)}, dtype=np.float32) * 0.5)"
            d = "float32"
        tags |= t
        return e, Sym("", tuple(shape), d, "", real=kind in ("np:from_numpy", "np:rng", "np:as_tensor") or self.outside_capture)

    def load_expr(self, tags: set[str], lines: list[str]) -> tuple[str, Sym] | None:
        if self.phase != "init":
            return None
        opt = self.pick([("load:plain",), ("load:mmap",), ("load:dict",)])
        if opt is None:
            return None
        name = f"f{len(self.files)}.pt"
        shape = self.shape(min_ndim=1)
        content, d = self.choose([
            (f"torch.arange({math.prod(shape)}, dtype=torch.float32).reshape({shape_src(shape)})", "float32"),
            (f"torch.randn({shape_src(shape)}, generator=torch.Generator().manual_seed(7))", "float32"),
            (f"torch.arange({math.prod(shape)}).reshape({shape_src(shape)})", "int64"),
            (f"torch.ones({shape_src(shape)}, dtype=torch.bfloat16)", "bfloat16"),
        ])
        path = f"os.path.join(TMP, {name!r})"
        if opt[0] == "load:dict":
            self.files.append((name, "{'w': " + content + "}"))
            e = f"torch.load({path}, weights_only=True)['w']"
        else:
            self.files.append((name, content))
            mm = ", mmap=True" if opt[0] == "load:mmap" else ""
            e = f"torch.load({path}, weights_only=True{mm})"
        tags.add(opt[0])
        return e, Sym("", tuple(shape), d, "")

    def idiom(self, tags: set[str], lines: list[str]) -> tuple[str, Sym] | None:
        """Computed buffers as models write them."""
        opt = self.pick([("idiom:causal_mask",), ("idiom:rope",), ("idiom:sinusoid",), ("idiom:outer",),
                         ("idiom:neg_inf_mask",), ("idiom:alibi",)])
        if opt is None:
            return None
        n = self.integer(1, 6)
        kind = opt[0]
        if kind == "idiom:causal_mask":
            e = f"torch.tril(torch.ones({n}, {n}, dtype=torch.bool)).view(1, 1, {n}, {n})"
            shape, d = (1, 1, n, n), "bool"
        elif kind == "idiom:rope":
            dim = 2 * n
            e = f"1.0 / (10000 ** (torch.arange(0, {dim}, 2, dtype=torch.int64).float() / {dim}))"
            shape, d = (n,), "float32"
        elif kind == "idiom:sinusoid":
            e = (f"torch.sin(torch.arange({n}).float()[:, None] * torch.exp(torch.arange(0, 4, 2).float() "
                 f"* (-math.log(10000.0) / 4)))")
            shape, d = (n, 2), "float32"
        elif kind == "idiom:outer":
            e = f"torch.outer(torch.arange({n}, dtype=torch.float32), 1.0 / (10000 ** torch.linspace(0, 1, 3)))"
            shape, d = (n, 3), "float32"
        elif kind == "idiom:neg_inf_mask":
            e = f"torch.triu(torch.full(({n}, {n}), float('-inf')), diagonal=1)"
            shape, d = (n, n), self.default
        else:
            e = f"torch.tensor([2 ** (-8 * (i + 1) / {n}) for i in range({n})])"
            shape, d = (n,), self.default
        tags.add(kind)
        return e, Sym("", shape, d, "", real=self.outside_capture)

    # ---------------------------------------------------------------- storing a new value
    def store(self, e: str, s: Sym, tags: set[str], lines: list[str]) -> Sym | None:
        trainable = s.dtype in FLOATS + COMPLEX
        opts = [("store:param",), ("store:buffer",), ("store:attr",), ("store:local",), ("store:list",),
                ("store:dict",), ("store:paramlist",), ("store:buffer_np",), ("store:param_frozen",),
                ("store:holder",), ("store:odict",)]
        if self.phase == "post":
            opts = [o for o in opts if o[0] != "store:local"]
        o = self.pick(opts)
        if o is None:
            return None
        kind = o[0]
        if kind in ("store:param", "store:paramlist") and not trainable:
            kind = "store:param_frozen"
            if not self.ok(kind):
                return None
        tags.add(kind)
        rg = False
        if kind == "store:param":
            name = self.fresh("w")
            lines.append(f"self.{name} = nn.Parameter({e})")
            expr, where, rg = f"self.{name}", "param", True
        elif kind == "store:param_frozen":
            name = self.fresh("w")
            lines.append(f"self.{name} = nn.Parameter({e}, requires_grad=False)")
            expr, where = f"self.{name}", "param"
        elif kind in ("store:buffer", "store:buffer_np"):
            name = self.fresh("b")
            pers = ", persistent=False" if kind == "store:buffer_np" else ""
            lines.append(f'self.register_buffer("{name}", {e}{pers})')
            expr, where, rg = f"self.{name}", "buffer", s.rg
        elif kind == "store:attr":
            name = self.fresh("t")
            lines.append(f"self.{name} = {e}")
            expr, where, rg = f"self.{name}", "attr", s.rg
        elif kind == "store:local":
            name = self.fresh("x")
            lines.append(f"{name} = {e}")
            expr, where, rg = name, "local", s.rg
        elif kind == "store:list":
            if not self.has["lst"]:
                lines.append("self.lst = []")
                self.has["lst"] = True
            lines.append(f"self.lst.append({e})")
            expr, where, rg = f"self.lst[{self.lst_len}]", "list", s.rg
            self.lst_len += 1
        elif kind in _KEYED:  # a dict, a plain object (olmo-core's hide_from_torch), a dict subclass
            attr, made, where, prefix, access = _KEYED[kind]
            if not self.has[attr]:
                lines.append(f"self.{attr} = {made}")
                self.has[attr] = True
            expr = f"self.{attr}" + access.format(self.fresh(prefix))
            lines.append(f"{expr} = {e}")
            rg = s.rg
        else:  # paramlist
            if not self.has["plist"]:
                lines.append("self.plist = nn.ParameterList()")
                self.has["plist"] = True
            lines.append(f"self.plist.append(nn.Parameter({e}))")
            expr, where, rg = f"self.plist[{self.plist_len}]", "paramlist", True
            self.plist_len += 1
        if s.rg and kind not in ("store:param", "store:paramlist", "store:param_frozen"):
            tags.add("store:grad_tracked")  # a tensor computed with autograd from a parameter, kept as is
        same_object = s.ref and kind in ("store:buffer", "store:buffer_np", "store:attr", "store:local", "store:list",
                                         "store:dict", "store:holder", "store:odict")
        sym = dataclasses.replace(s, expr=expr, where=where, rg=rg, ref=False,
                                  obj=s.obj if same_object else next(_OBJ))
        self.syms[expr] = sym
        return sym
