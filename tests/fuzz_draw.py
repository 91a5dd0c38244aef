"""The grammar's foundations: dtype groups, ``Sym`` (what the generator knows of a tensor the
program made: expression, shape, dtype, where it is kept, which object), source helpers
(``lit``, ``shape_src``, ``dt``) and ``GenBase``, the generator's state and drawing helpers
(``ok``, ``pick``, ``integer``, ``shape``, ``pick_sym``...). Part of the capture fuzzer (see
``fuzz_programs``)."""

from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Any, Callable, Sequence, TypeVar

from hypothesis import strategies as st

T = TypeVar("T")


# ============================================================================ the grammar

FLOATS = ("float32", "float64", "float16", "bfloat16")
INTS = ("int64", "int32", "uint8")
COMPLEX = ("complex64", "complex128")
NP_OK = ("float32", "float64", "float16", "int64", "int32", "uint8", "bool", "complex64", "complex128")


_OBJ = itertools.count()


@dataclasses.dataclass
class Sym:
    expr: str  # how the code refers to it (``self.w3``, ``t2``, ``self.lst[0]``, ``self.m1.weight``, ``arg0``)
    shape: tuple[int, ...] | None  # None: data-dependent, unknown when generating
    dtype: str
    where: str  # param buffer attr local list dict paramlist modparam modbuffer arg
    rg: bool = False  # requires grad (in-place edits need no_grad or .data)
    contiguous: bool = True
    writable: bool = True  # not an expanded / overlapping view
    obj: int = dataclasses.field(default_factory=lambda: next(_OBJ))  # which Python object it is
    real: bool = False  # a real tensor even under capture (an argument, numpy data, torch.get_rng_state())
    ref: bool = False  # the expression is an existing object itself (not a new tensor)

    @property
    def known(self) -> bool:
        return self.shape is not None

    @property
    def ndim(self) -> int:
        return -1 if self.shape is None else len(self.shape)

    @property
    def numel(self) -> int:
        return -1 if self.shape is None else math.prod(self.shape)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOATS


def lit(v: Any) -> str:
    if isinstance(v, float):
        if math.isnan(v):
            return 'float("nan")'
        if math.isinf(v):
            return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(v)


def shape_src(shape: tuple[int, ...]) -> str:
    return repr(tuple(shape))


def dt(dtype: str) -> str:
    return f"torch.{dtype}"


class GenBase:
    """The generator's state (the tensors made so far, files, arguments, generators, modules)
    and its drawing helpers."""

    def __init__(self, draw: Callable, disabled: frozenset[str]) -> None:
        self.draw = draw
        self.disabled = disabled
        self.syms: dict[str, Sym] = {}
        self.counter = itertools.count()
        self.files: list[tuple[str, str]] = []
        self.args: list[str] = []
        self.phase = "init"
        self.gens: list[str] = []  # generator expressions usable in this phase
        self.attr_gens: list[str] = []  # generators kept on self (usable in init_weights too)
        self.modules: dict[str, str] = {}  # "self.m0" -> class name
        self.has = {"lst": False, "dct": False, "plist": False, "holder": False, "odct": False}
        self.lst_len = 0
        self.plist_len = 0
        self.default = "float32"
        self.post_mode = "plain"

    @property
    def outside_capture(self) -> bool:
        """New tensors made now are real (init_weights() called on the traced model outside fxinit.recording)."""
        return self.phase == "post" and self.post_mode == "plain"

    # ---------------------------------------------------------------- drawing helpers
    def ok(self, *tags: str) -> bool:
        return not (set(tags) & self.disabled)

    def choose(self, options: Sequence[T]) -> T:
        """One of ``options``, drawn as its index. Not ``st.sampled_from``: Hypothesis labels that
        strategy by ``hash()`` of its elements (strings vary with ``PYTHONHASHSEED``, bound methods
        with their object's address), and its mutator matches spans by label, so the same seed
        generated other programs in every process (CI found a hole no local run had made)."""
        return options[self.draw(st.integers(0, len(options) - 1))]

    def pick(self, options: list[tuple[Any, ...]]) -> tuple[Any, ...] | None:
        """Options are tuples whose first item is a tag or a tuple of tags; disabled ones are dropped."""
        opts = [o for o in options if self.ok(*((o[0],) if isinstance(o[0], str) else o[0]))]
        if not opts:
            return None
        return self.choose(opts)

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def boolean(self) -> bool:
        return self.draw(st.booleans())

    def fresh(self, prefix: str) -> str:
        return f"{prefix}{next(self.counter)}"

    def shape(self, max_ndim: int = 3, min_ndim: int = 0) -> tuple[int, ...]:
        ndim = self.integer(min_ndim, max_ndim)
        return tuple(self.draw(st.one_of(st.integers(1, 5), st.just(0))) if i == 0 else self.integer(1, 5)
                     for i in range(ndim))

    def float_value(self) -> float:
        return self.choose([0.0, 1.0, 0.5, -1.0, 2.0, 0.02, -0.0, 3.25, 1e-3, float("nan"),
                                          float("inf"), float("-inf"), 1e30])

    def value_for(self, dtype: str) -> Any:
        if dtype == "bool":
            return self.boolean()
        if dtype in INTS:
            return self.integer(0, 7) if dtype == "uint8" else self.integer(-3, 7)
        return self.float_value()

    def syms_where(self, pred: Callable[[Sym], bool], use: str = "use") -> list[Sym]:
        out = []
        for s in self.syms.values():
            if self.phase == "post" and not s.expr.startswith("self."):
                continue
            if not self.ok(f"{use}-on:{s.where}"):
                continue
            if pred(s):
                out.append(s)
        return out

    def pick_sym(self, pred: Callable[[Sym], bool], use: str = "use") -> Sym | None:
        cands = self.syms_where(pred, use)
        if not cands:
            return None
        return self.choose(cands)

    def gen_kw(self, tags: set[str]) -> str:
        """``, generator=g`` sometimes, when a generator exists."""
        if self.gens and self.ok("gen:explicit") and self.boolean():
            tags.add("gen:explicit")
            return f", generator={self.choose(self.gens)}"
        return ""

    def dtype_kw(self, choices: tuple[str, ...], tags: set[str]) -> tuple[str, str]:
        """(``, dtype=torch.X`` or "", the resulting dtype)."""
        opts = [("", self.default)] + [(f", dtype={dt(d)}", d) for d in choices if self.ok(f"dtype:{d}")]
        kw, d = self.choose(opts)
        if kw:
            tags.add(f"dtype:{d}")
        return kw, d

    def complex_default(self) -> str:
        return "complex128" if self.default == "float64" else "complex64"
