"""Copies that draw their elements themselves (``passes.origins``, ``plan.forwards``) and
factories of one value that write only what is read (``plan.constant_parts``).

A layout copies a random fill's elements through a chain (tensor parallelism's chunk
``clone``, the scatter's ``copy_``, FSDP's ``copy_`` into a padded buffer): the last copy
draws them straight into its output, the fill and the copies before draw and copy
nothing. Every test compares with eager construction bit for bit, and checks that the
plan decided what it should (a test of speed that could pass by copying would prove
nothing)."""

from __future__ import annotations

import contextlib
import random

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxinit
from conftest import TORCH_RELEASE, assert_same_as_eager, native_fill_done
from fxinit.rng.mt19937 import distance
from fuzz_run import small_thresholds
from fxinit.passes import origins


def _chain(w: torch.Tensor, columns: slice, rows: slice, pad: int, touch=None, cast=None):  # noqa: ANN001, ANN202
    """TP chunk of ``columns`` (a contiguous clone), scattered into a local tensor, a row
    block of it copied into a zero-padded buffer: the buffer (FSDP's)."""
    chunk = w[:, columns].contiguous()
    if touch is not None:
        touch(chunk)
    local = torch.empty_like(chunk) if cast is None else torch.empty_like(chunk, dtype=cast)
    local.copy_(chunk)
    block = local[rows]
    out = local.new_zeros(block.shape[0] + pad, block.shape[1])
    out[:block.shape[0]].copy_(block)
    return out


class Layouts(nn.Module):
    """Shards of random fills through the chain, in the ways a layout can go."""

    def __init__(self, dtype: torch.dtype = torch.float32, init: str = "normal") -> None:
        super().__init__()
        fill = {"normal": lambda t: nn.init.normal_(t, 0.0, 0.02),
                "uniform": lambda t: nn.init.uniform_(t, -0.1, 0.1),
                "kaiming": lambda t: nn.init.kaiming_uniform_(t, a=5 ** 0.5),
                "trunc_near": lambda t: nn.init.trunc_normal_(t, std=1.0, a=-1.5, b=1.5),
                "trunc_far": lambda t: nn.init.trunc_normal_(t, std=0.02)}[init]
        for name, (rows, cols), cs, rs, pad in (
                ("row_parallel", (256, 1024), slice(512, 768), slice(64, 128), 0),
                ("col_parallel", (1024, 256), slice(0, 256), slice(256, 512), 3),
                ("tail", (257, 1023), slice(700, 1023), slice(200, 257), 2)):  # the last, redrawn block
            w = torch.empty(rows, cols, dtype=dtype)
            fill(w)
            self.register_buffer(name, _chain(w, cs, rs, pad))


INIT_SHIMS = TORCH_RELEASE < (2, 12)


def _draws_whole_blocks(dtype: torch.dtype) -> bool:
    """Whether torch's ``normal_`` in ``dtype`` draws whole blocks of 16 (2.13's reduced types)."""
    g = torch.Generator().manual_seed(0)
    before = g.get_state()
    torch.empty(17, dtype=dtype).normal_(generator=g)
    return distance(before, g.get_state()) % 16 == 0


@pytest.mark.parametrize("dtype,init", [(torch.float32, "normal"), (torch.float32, "kaiming"),
                                        (torch.float64, "normal"), (torch.bfloat16, "uniform"),
                                        (torch.float16, "normal"), (torch.float32, "trunc_near"),
                                        (torch.float32, "trunc_far")])
def test_the_last_copy_draws_the_shard_straight_into_its_buffer(dtype: torch.dtype, init: str) -> None:
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Layouts, dtype, init))
    plan = g.plan()
    drawn = {f.fill for forwards in plan.forwards.values() for f in forwards}
    if (dtype == torch.float16 and _draws_whole_blocks(dtype)) or (init.startswith("trunc") and INIT_SHIMS):
        # torch 2.13's half normal_ rounds its draws up to whole blocks; torch 2.11's
        # trunc_normal_ is recorded whole (``capture.init_shims``): not split
        assert not drawn, str(plan)
    else:
        assert len(drawn) == 3, str(plan)
        for fill in drawn:  # the fills draw nothing themselves
            assert plan.pieces.get(fill) == [], str(plan)
        assert plan.elements_drawn() == 64 * 256 + 256 * 256 + 57 * 323, str(plan)
    assert_same_as_eager(Layouts, dtype, init)


def test_the_padding_alone_is_zeroed(monkeypatch: pytest.MonkeyPatch) -> None:
    from fxinit.passes import demand

    monkeypatch.setattr(demand, "PARTIAL_CONSTANT_MIN", 0)  # these are small
    torch.manual_seed(0)
    plan = fxinit.init_graph(fxinit.trace_init(Layouts)).plan()
    parts = {tuple(n.meta["spec"].shape): r for n, r in plan.constant_parts.items()}
    assert parts == {(64, 256): [], (259, 256): [(256 * 256, 259 * 256)], (59, 323): [(57 * 323, 59 * 323)]}
    assert "writes nothing (all overwritten before read)" in str(plan)


def _doubled(t: torch.Tensor) -> None:
    t.mul_(2)


class Touched(nn.Module):
    """The chain with a write between the fill and the copy, a cast inside it, a write to
    part of the filled tensor, and (``keep_full``) the full tensor kept too."""

    def __init__(self, keep_full: bool = False) -> None:
        super().__init__()
        w = torch.empty(256, 1024)
        nn.init.normal_(w)
        self.register_buffer("doubled", _chain(w, slice(0, 256), slice(0, 64), 0, touch=_doubled))
        self.register_buffer("cast", _chain(w, slice(256, 512), slice(0, 64), 0, cast=torch.bfloat16))
        self.register_buffer("plain", _chain(w, slice(512, 768), slice(0, 64), 0))
        if keep_full:
            self.register_buffer("full", w)
        v = torch.empty(512, 512)
        nn.init.uniform_(v)
        v[100:200].add_(1.0)  # part of the fill's own storage written after it
        self.register_buffer("after", _chain(v, slice(0, 256), slice(64, 256), 0))


def test_writes_and_casts_between_keep_their_values() -> None:
    torch.manual_seed(0)
    plan = fxinit.init_graph(fxinit.trace_init(Touched)).plan()
    kinds = sorted(str(n.target) for n in plan.forwards)
    # the clones before the write and the cast draw, the last copies of "plain" and "after" draw
    assert kinds == ["aten.clone.default"] * 2 + ["aten.copy_.default"] * 2, str(plan)
    v = next(f for fs in plan.forwards.values() for f in fs if f.fill.args[0].meta["spec"].shape == (512, 512))
    rows = {lo // 512 for lo, _, _ in v.runs.tolist()}
    assert rows == set(range(64, 100)) | set(range(200, 256)), str(plan)  # not the rows the add wrote
    assert_same_as_eager(Touched)


def test_a_fill_written_for_other_readers_is_copied_not_drawn_again() -> None:
    torch.manual_seed(0)
    plan = fxinit.init_graph(fxinit.trace_init(Touched, True)).plan()
    assert all(f.fill.args[0].meta["spec"].shape == (512, 512) for fs in plan.forwards.values() for f in fs), str(plan)
    assert_same_as_eager(Touched, True)


def test_portable_copies_draw_the_streams_elements() -> None:
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Touched, True))
    plan = g.plan(rng="portable", seed=3)
    assert plan.forwards, str(plan)
    got = g.materialize(rng="portable", seed=3)
    assert torch.equal(got["plain"], got["full"][:, 512:768][:64])


def test_runs_compose_through_copies() -> None:
    held = np.array([[0, 100, 0, 0], [100, 200, 1, -100]])  # fill 0 at 0.., fill 1 at 0.. again
    pieces = np.array([[10, 20], [50, 60]])  # destination elements, copying source e + shift
    shifts = np.array([90, 0])
    out = origins.compose(pieces, shifts, held)
    assert out.tolist() == [[10, 20, 1, -10], [50, 60, 0, 0]]
    merged = origins.assign(out, np.array([[15, 55]]), np.array([[15, 55, 2, 0]]))
    assert merged.tolist() == [[10, 15, 1, -10], [15, 55, 2, 0], [55, 60, 0, 0]]
    assert origins.merge(np.array([[0, 5, 0, 1], [5, 9, 0, 1], [9, 10, 1, 1]])).tolist() == [[0, 9, 0, 1],
                                                                                             [9, 10, 1, 1]]


def test_native_runs_equal_torch_for_scattered_runs() -> None:
    from fxinit.rng.fills import native_fill_runs

    rng = np.random.default_rng(0)
    for kind, dtype, total in (("normal", torch.float32, 5003), ("uniform", torch.float64, 4096),
                               ("normal", torch.bfloat16, 1000), ("normal", torch.float64, 70001)):
        g = torch.Generator().manual_seed(total)
        state = g.get_state()
        want = getattr(torch.empty(total, dtype=dtype), kind + "_")(generator=g)
        cuts = np.sort(rng.choice(total, 40, replace=False))
        runs = cuts.reshape(-1, 2)
        order = rng.permutation(len(runs))
        at = np.cumsum([0, *(runs[order, 1] - runs[order, 0])])[:-1]
        table = np.stack([runs[order, 0], runs[order, 1], at], axis=1)
        table = table[np.argsort(table[:, 0])]
        out = torch.full((int(at[-1] + runs[order[-1], 1] - runs[order[-1], 0]),), float("nan"), dtype=dtype)
        if not native_fill_done(native_fill_runs(kind, out, state, (0.0, 1.0), table, total, threads=2), kind, dtype):
            continue
        for lo, hi, a in table.tolist():
            assert torch.equal(out[a:a + hi - lo], want[lo:hi]), (kind, dtype, lo, hi)


class RandomChain(nn.Module):
    """A random fill moved through ``steps`` (views, copies, clones, casts, pads, zero-padded
    buffers, writes): the ways a layout can move a shard, in any order."""

    def __init__(self, shape: tuple[int, int], fill: str, steps: list[tuple], keep_full: bool) -> None:
        super().__init__()
        w = torch.empty(shape)
        {"normal": lambda: nn.init.normal_(w, 0.5, 2.0), "uniform": lambda: nn.init.uniform_(w, -1.0, 1.0),
         "trunc": lambda: nn.init.trunc_normal_(w, std=1.0, a=-1.0, b=1.5)}[fill]()
        t = w
        for step, *a in steps:
            if step == "rows":
                t = t[a[0]:a[1]]
            elif step == "cols":
                t = t[:, a[0]:a[1]]
            elif step == "t":
                t = t.t()
            elif step == "contiguous":
                t = t.contiguous()
            elif step == "clone":
                t = t.clone()
            elif step == "copy":
                dst = torch.empty_like(t)
                dst.copy_(t)
                t = dst
            elif step == "zeros":  # FSDP's padded buffer
                buf = t.new_zeros(t.shape[0] + a[0], t.shape[1])
                buf[:t.shape[0]].copy_(t)
                t = buf
            elif step == "pad":
                t = nn.functional.pad(t, (0, 0, 0, a[0]))
            elif step == "write":
                t[a[0]:a[1]].mul_(3.0)
            elif step == "cast":
                t = t.to(torch.float64)
        self.register_buffer("out", t)
        if keep_full:
            self.register_buffer("full", w)


def _random_steps(rng: random.Random, shape: tuple[int, int]) -> list[tuple]:
    rows, cols = shape
    steps: list[tuple] = []
    for _ in range(rng.randint(1, 6)):
        step = rng.choice(["rows", "cols", "t", "contiguous", "clone", "copy", "zeros", "pad", "write", "cast"])
        if step == "rows" and rows > 1:
            lo = rng.randrange(rows - 1)
            hi = rng.randint(lo + 1, rows)
            steps.append((step, lo, hi))
            rows = hi - lo
        elif step == "cols" and cols > 1:
            lo = rng.randrange(cols - 1)
            hi = rng.randint(lo + 1, cols)
            steps.append((step, lo, hi))
            cols = hi - lo
        elif step == "t":
            steps.append((step,))
            rows, cols = cols, rows
        elif step in ("zeros", "pad"):
            extra = rng.randint(0, 3)
            steps.append((step, extra))
            rows += extra
        elif step == "write" and rows > 1:
            lo = rng.randrange(rows - 1)
            steps.append((step, lo, rng.randint(lo + 1, rows)))
        elif step in ("contiguous", "clone", "copy", "cast"):
            steps.append((step,))
    return steps


def test_random_chains_equal_eager() -> None:
    """Every path at small sizes (the thresholds at their minimum, as ``fuzz_capture
    --small-thresholds``): random chains from a fill to a kept buffer, bit for bit."""
    rng = random.Random(7)
    forwarded = 0
    with small_thresholds():
        for _ in range(40):
            shape = (rng.randint(2, 40), rng.randint(16, 90))
            args = (shape, rng.choice(["normal", "uniform", "trunc"]), _random_steps(rng, shape), rng.random() < 0.2)
            torch.manual_seed(0)
            forwarded += bool(fxinit.init_graph(fxinit.trace_init(RandomChain, *args)).plan().forwards)
            assert_same_as_eager(RandomChain, *args, seeds=(0,))
    assert forwarded >= 10  # the chains do reach the copies that draw


class LastElements(nn.Module):
    """The first rows and the last few elements of fills whose last block torch redraws (a
    size not a multiple of 16): a piece of fewer than 16 elements at the end."""

    def __init__(self) -> None:
        super().__init__()
        for i, (dtype, fill) in enumerate(((torch.float32, lambda t: nn.init.normal_(t)),
                                           (torch.float64, lambda t: nn.init.normal_(t, 1.0, 3.0)),
                                           (torch.float32, lambda t: nn.init.trunc_normal_(t, a=-1.0, b=1.0)))):
            full = torch.empty(10007, dtype=dtype)
            fill(full)
            self.register_buffer(f"head{i}", full[:1000].clone())
            self.register_buffer(f"end{i}", full[10000:].clone())


@pytest.mark.parametrize("forward", [True, False])
def test_a_piece_in_the_redrawn_last_block_equals_eager(forward: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from fxinit.passes import demand

    if not forward:  # the fills' own pieces, as before copies drew
        monkeypatch.setattr(demand, "FORWARD_RUN_MIN", 1 << 40)
    torch.manual_seed(0)
    plan = fxinit.init_graph(fxinit.trace_init(LastElements)).plan()
    # the heads' copies (the ends are short); torch 2.11's trunc_normal_ is recorded whole
    assert len(plan.forwards) == ((2 if INIT_SHIMS else 3) if forward else 0), str(plan)
    for pieces in plan.pieces.values():  # the fills draw the ends: a piece at least 16 long
        assert pieces[-1][1] == 10007 and pieces[-1][1] - pieces[-1][0] >= 16, str(plan)
    assert_same_as_eager(LastElements)


def test_native_runs_of_the_same_elements_twice() -> None:
    from fxinit.rng.fills import native_fill_runs

    g = torch.Generator().manual_seed(1)
    state = g.get_state()
    for kind in ("uniform", "normal"):
        want = getattr(torch.empty(4096), kind + "_")(generator=torch.Generator().set_state(state))
        table = np.array([[100, 300, 0], [100, 300, 200], [250, 260, 400], [1000, 1001, 410]])
        out = torch.full((411,), float("nan"))
        assert native_fill_runs(kind, out, state, (0.0, 1.0), table, 4096, threads=1)
        for lo, hi, at in table.tolist():
            assert torch.equal(out[at:at + hi - lo], want[lo:hi]), (kind, lo, hi)


@pytest.mark.parametrize("dtype,init", [(torch.bfloat16, "uniform"), (torch.float32, "normal"),
                                        (torch.float64, "normal")])
def test_portable_copies_draw_what_the_fills_would(dtype: torch.dtype, init: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from fxinit.passes import demand

    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Layouts, dtype, init))
    assert g.plan(rng="portable", seed=1).forwards
    drawn = g.materialize(rng="portable", seed=1)
    monkeypatch.setattr(demand, "FORWARD_RUN_MIN", 1 << 40)  # the fills draw, the copies copy
    assert not g.plan(rng="portable", seed=1).forwards
    copied = g.materialize(rng="portable", seed=1)
    for name in drawn:
        assert torch.equal(drawn[name], copied[name]), name


class Reinterpreted(nn.Module):
    """Views of a storage as another dtype (``view(dtype)``): their offsets and strides count
    in other units and their elements are other bits (found by review: drawn values, or
    zeros written only where read, where eager has the reinterpreted bits)."""

    def __init__(self, case: str) -> None:
        super().__init__()
        w = torch.empty(64, 1024)
        if case == "int_fill":
            w.view(torch.int32).random_(0, 1 << 20)
        else:
            nn.init.normal_(w, 0.0, 0.02)
        if case == "bf16_write":
            w.view(torch.bfloat16)[10:12].zero_()
        elif case == "complex_write":
            w.view(torch.complex64)[2:3].zero_()
        elif case == "ones":
            w = torch.ones(64, 1024)
            w.view(torch.bfloat16)[0:2].copy_(torch.full((2, 2048), 3.0, dtype=torch.bfloat16))
        out = w.view(torch.int32)[1:4] if case == "int_view" else w[0:16]
        self.register_buffer("out", out.clone())


class IntegerDivision(nn.Module):
    """An element-wise integer division over all of a tensor whose divisors were written
    only where read (``ones``) or drawn only there: unread elements must not be garbage."""

    def __init__(self, divisor: str) -> None:
        super().__init__()
        n = 1 << 17
        d = torch.ones(n, dtype=torch.int64) if divisor == "ones" else torch.empty(n, dtype=torch.int64).random_(1, 9)
        self.register_buffer("out", torch.remainder(torch.arange(n), d)[:100].clone())


class EmptyCopy(nn.Module):
    """A copy of no elements (a pad that crops everything): eager's strides."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.empty(6, 40)
        nn.init.normal_(w)
        y = nn.functional.pad(w, (-40, 0))
        z = torch.empty_like(y)
        z.copy_(y)
        self.register_buffer("out", z[1:].clone())


@pytest.mark.parametrize("small", [False, True])
def test_reinterpreting_views_integer_division_and_empty_copies_equal_eager(small: bool) -> None:
    with small_thresholds() if small else contextlib.nullcontext():
        for case in ("int_fill", "bf16_write", "complex_write", "ones", "int_view"):
            assert_same_as_eager(Reinterpreted, case, seeds=(0,))
        for divisor in ("ones", "random"):
            assert_same_as_eager(IntegerDivision, divisor, seeds=(0,))
        assert_same_as_eager(EmptyCopy, seeds=(0,))


class BatchNormStepInInit(nn.Module):
    """A forward step in ``__init__`` whose batch norm writes its running statistics, which
    its schema does not mark as written: a copy of them afterwards must copy, not draw."""

    def __init__(self) -> None:
        super().__init__()
        w, var = torch.empty(1000), torch.ones(64)
        nn.init.normal_(w)
        nn.functional.batch_norm(torch.randn(8, 64), w[:64], var, training=True)  # its running mean
        self.register_buffer("after", w[:400].clone())


def test_writes_the_schema_does_not_mark_end_the_origins() -> None:
    with small_thresholds():
        assert_same_as_eager(BatchNormStepInInit, seeds=(0,))


@pytest.mark.parametrize("rng", ["exact", "portable"])
def test_storages_nothing_reads_or_writes_are_not_allocated(rng: str) -> None:
    """The full tensors and TP chunks a shard is drawn past are meta stand-ins
    (``plan.unbacked``: a GPU would hold them until their group ends), and ``new_zeros`` of
    such a stand-in still makes its tensor on the device it was meant for."""
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Layouts, torch.float32, "normal"))
    plan = g.plan(rng=rng, seed=1 if rng == "portable" else None)
    full = {n.args[0] for n in plan.nodes if n.meta.get("generators")}  # what the three fills fill
    assert len(full) == 3 and full <= plan.unbacked, str(plan)
    outputs = sum(n.meta["spec"].nbytes for n in plan.nodes if n in plan.keep)
    assert plan.bytes_allocated() == outputs, str(plan)  # the shards, and nothing else
    got = g.materialize(rng=rng, seed=1 if rng == "portable" else None)
    assert all(v.device.type == "cpu" for v in got.values())
    if rng == "exact":
        assert_same_as_eager(Layouts, torch.float32, "normal")
