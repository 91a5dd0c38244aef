"""Graph passes: dead-init elimination and the partition for parallel runs, each alone and
through materialization (which must stay bitwise equal to eager)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxinit
from fxinit import execute
from fxinit.backends.exact import ExactSampler
from fxinit.backends.interpreter import Interpreter
from fxinit.numerics import Settings
from fxinit.passes import dead_writes, independent_groups
from tests.conftest import TORCH_RELEASE, assert_same_as_eager


def _op_names(graph: fxinit.InitGraph, nodes) -> list[str]:
    return [getattr(getattr(n.target, "overloadpacket", n.target), "__name__", str(n.target)) for n in nodes]


class Reinit(nn.Module):
    """transformers' pattern: reset_parameters draws, _init_weights draws again."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 32)
        nn.init.normal_(self.fc.weight, std=0.02)
        nn.init.zeros_(self.fc.bias)


def test_overwritten_draws_are_dead_and_values_stay_exact() -> None:
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Reinit))
    dead = g.dead_writes()
    assert sorted(_op_names(g, dead)) == ["uniform_", "uniform_"]  # kaiming weight + bias draw
    s = g.stats()
    assert s["random_ops_captured"] == 3 and s["random_ops"] == 1 and s["dead_nodes"] == 2
    assert s["random_elements_captured"] == 16 * 32 * 2 + 32 and s["random_elements"] == 16 * 32
    assert_same_as_eager(Reinit)


class ReadBetween(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))
        self.v = nn.Parameter(torch.empty(8, 8))
        nn.init.uniform_(self.w)
        with torch.no_grad():
            self.v.copy_(self.w * 2)  # reads w's first draw: it is not dead
        nn.init.normal_(self.w)


class PartialOverwrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))
        nn.init.uniform_(self.w)
        nn.init.normal_(self.w[:4])  # only half: the first draw survives in the other half
        self.t = nn.Parameter(torch.empty(8, 8))
        nn.init.uniform_(self.t)
        nn.init.normal_(self.t.T)  # all of it, but through a transposed view: kept (conservative)


class SelfCopy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(4, 4))
        nn.init.uniform_(self.w)
        with torch.no_grad():
            self.w.copy_(self.w.flip(0))  # copy_ reading its own storage


def test_writes_that_are_read_or_partly_overwritten_stay() -> None:
    for cls, expected_dead in ((ReadBetween, 0), (PartialOverwrite, 0), (SelfCopy, 0)):
        torch.manual_seed(0)
        g = fxinit.init_graph(fxinit.trace_init(cls))
        assert len(g.dead_writes()) == expected_dead, cls.__name__
        assert_same_as_eager(cls)


class ViewedBetween(nn.Module):
    """A view made between two full writes reads no data (llm-foundry's gather of FSDP2's
    ``to_empty`` shard, then its init: the gathered garbage was taken as read, and the
    uninitialized-read check refused a value eager has)."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 8))
        nn.init.uniform_(self.w)
        flat = self.w.view(-1)  # a view: no data read
        nn.init.normal_(flat)   # all of it: the first draw is dead
        self.register_buffer("sums", self.w.sum(0))  # reads the second


def test_a_view_between_writes_reads_nothing() -> None:
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(ViewedBetween))
    assert _op_names(g, g.dead_writes()) == ["uniform_"]
    assert_same_as_eager(ViewedBetween)


def test_reinit_after_trace_kills_the_traced_draw() -> None:
    def reinit(m: nn.Module) -> None:
        nn.init.orthogonal_(m.fc.weight)  # opaque init function: still a full overwrite

    torch.manual_seed(0)
    m = fxinit.trace_init(Reinit)
    reinit(m)
    g = fxinit.init_graph(m)
    assert "normal_" in _op_names(g, g.dead_writes())
    assert_same_as_eager(Reinit, post=reinit)


def test_dead_writes_on_a_bare_node_list() -> None:
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Reinit))
    assert dead_writes(g.nodes) == g.dead_writes()


class Independent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(32, 32) for _ in range(6))
        self.shared = torch.empty(4, 8)
        nn.init.normal_(self.shared)
        self.p = nn.Parameter(self.shared[:2])  # views of one storage: must share a group
        self.q = nn.Parameter(self.shared[2:])
        self.register_buffer("pos", torch.arange(16).float() / 16)


def test_partition_groups_share_no_value_and_no_storage() -> None:
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Independent))
    nodes = g.required_nodes(list(g.outputs))
    groups = independent_groups(nodes)
    assert sorted(n.name for grp in groups for n in grp) == sorted(n.name for n in nodes)
    group_of = {n: i for i, grp in enumerate(groups) for n in grp}
    for n in nodes:
        for inp in n.all_input_nodes:
            assert group_of[inp] == group_of[n]
    storages = [set(s for n in grp for s in (*n.meta["reads"], *n.meta["mutates"])) for grp in groups]
    for i in range(len(storages)):
        for j in range(i + 1, len(storages)):
            assert not storages[i] & storages[j]
    assert group_of[g.outputs["p"]] == group_of[g.outputs["q"]]
    assert len(groups) >= 12  # 6 weights + 6 biases at least


def test_parallel_run_equals_serial_run() -> None:
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(Independent))
    plan = g.plan()
    serial = Interpreter(plan, g.constants, ExactSampler(g.snapshots), Settings(g.default_dtype, g.numerics)).run()  # program order
    parallel = execute.run(g, plan, workers=4)
    assert serial.keys() == parallel.keys() == plan.keep
    for node in plan.keep:
        assert torch.equal(serial[node], parallel[node])
    assert_same_as_eager(Independent)


class ReadsAPiece(nn.Module):
    """Keeps only slices of big random tensors, as a rank keeps its shard."""

    def __init__(self) -> None:
        super().__init__()
        for i, (n, lo, hi) in enumerate(PIECES):
            full = torch.empty(n)
            nn.init.normal_(full, std=0.5) if i != 2 else nn.init.uniform_(full, -1, 1)
            self.register_buffer(f"piece{i}", full[lo:hi].clone())
        wide = torch.empty(64, 96, dtype=torch.float64)
        nn.init.normal_(wide)
        self.register_buffer("rows", wide[16:40].clone())
        block = torch.empty(40, 100)  # a row-parallel shard: a block of every row
        nn.init.normal_(block)
        self.register_buffer("columns", block[:, 50:100].clone())
        strided = torch.empty(80, 33).uniform_()  # FSDP over tensor parallel: rows of two blocks
        self.register_buffer("strided", torch.cat([strided[10:20], strided[50:60]]))


PIECES = ((4099, 512, 800), (4103, 1024, 4103), (3000, 7, 1500))


def test_only_the_read_range_of_a_random_fill_is_computed() -> None:
    from fxinit.passes.demand import partial_fills, read_demand
    from fxinit.passes.stream_keys import stream_keys
    from fxinit.rng import portable

    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(ReadsAPiece))
    nodes = g.required_nodes(list(g.outputs))
    found = partial_fills(read_demand(nodes, set(g.outputs.values())))
    by_shape = {n.args[0].meta["spec"].shape: v for n, v in found.items()}
    assert by_shape == {(4099,): [(512, 800)], (4103,): [(1024, 4103)], (3000,): [(7, 1500)],
                        (64, 96): [(16 * 96, 40 * 96)], (40, 100): [(r * 100 + 50, r * 100 + 100) for r in range(40)],
                        (80, 33): [(10 * 33, 20 * 33), (50 * 33, 60 * 33)]}
    assert_same_as_eager(ReadsAPiece)  # exact pieces: the same bits as the whole fill

    keys = stream_keys(g.nodes, g.storage_names())
    got = g.materialize(rng="portable")
    for node, key in keys.items():
        shape = node.args[0].meta["spec"].shape
        if shape == (4103,):  # the portable piece equals the same elements of the whole stream
            whole = portable.fill_(torch.empty(4103), "normal", portable.stream_key(0, key), mean=0.0, std=0.5)
            assert torch.equal(got["piece1"], whole[1024:])


class KeepsAViewOfAFill(nn.Module):
    """A buffer that is a view of a larger random tensor: eager's storage holds all of it."""

    def __init__(self) -> None:
        super().__init__()
        big = torch.empty(300, 400).normal_()
        self.register_buffer("columns", big[:, 100:110])
        copied = torch.empty(300, 400).uniform_().clone()  # a copy, then a view of the copy
        self.register_buffer("rows", copied[20:30])


def test_a_kept_view_keeps_all_of_its_storage() -> None:
    torch.manual_seed(0)
    eager = KeepsAViewOfAFill()
    torch.manual_seed(0)
    model = fxinit.materialize(fxinit.trace_init(KeepsAViewOfAFill))
    for name in ("columns", "rows"):
        want, got = getattr(eager, name), getattr(model, name)
        assert torch.equal(got, want)
        assert bytes(got.untyped_storage()) == bytes(want.untyped_storage()), name


class TruncNormalRows(nn.Module):
    """trunc_normal_ with far bounds (torchtitan's std 0.02 within +-2), with near ones (its
    output layer's cutoff at 3 std: rejections, redrawn), and with a narrow window (torch
    samples it from uniforms)."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        for name, bounds in (("far", {}), ("near", dict(a=-0.03, b=0.03)), ("narrow", dict(a=0.5, b=0.6))):
            full = torch.empty(4096, 64, dtype=dtype)
            nn.init.trunc_normal_(full, std=0.02 if name != "narrow" else 1.0, **bounds)
            self.register_buffer(name, full[1000:1010].clone())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_trunc_normal_fills_only_what_is_read(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(TruncNormalRows, dtype))
    plan = g.plan()
    # the clone of the rows draws them itself (``plan.forwards``); the fill draws nothing
    split = {f.fill.kwargs["a"]: [(lo, hi) for lo, hi, _ in f.runs.tolist()]
             for fs in plan.forwards.values() for f in fs}
    # reduced precisions round normal_'s draws up to blocks, torch 2.11's trunc_normal_ is
    # recorded whole (``capture.init_shims``): not split
    if dtype != torch.bfloat16 and TORCH_RELEASE >= (2, 12):
        assert split == {-2.0: [(64000, 64640)], -0.03: [(64000, 64640)]}  # not the narrow window
        assert {n.kwargs["a"]: r for n, r in plan.pieces.items()} == {-2.0: [], -0.03: []}
    assert_same_as_eager(lambda: TruncNormalRows(dtype))


class FilledThenTouched(nn.Module):
    """Small fills read, written, viewed and cast after them, in other groups' midst."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.register_buffer("twice", self.a.weight.detach() * 2)  # reads a batched fill
        w = torch.empty(16, 16)
        nn.init.normal_(w, std=0.3)
        w[0].fill_(5.0)  # writes into it after
        self.w = nn.Parameter(w)
        v = torch.empty(48)
        nn.init.uniform_(v, -2, 2)
        self.register_buffer("rows", v.view(3, 16)[1:].clone())  # a copy of a view of it
        self.odd = nn.Parameter(torch.empty(24).normal_())  # a normal of 24: runs alone
        self.b = nn.Linear(32, 8)
        early = torch.empty(16)
        seen = early.view(4, 4)  # a view taken before the fill: its readers reach the fill's storage
        early.normal_()
        self.register_buffer("through_early_view", seen * 2)
        qkv = torch.empty(3, 16)  # a fused QKV: unbind's views, filled after
        q, _, _ = qkv.unbind(0)
        qkv.uniform_(-1, 1)
        self.register_buffer("q_scaled", q * 0.125)
        head = torch.empty(32)
        first = head[:16]
        head.normal_()
        first.zero_()  # a write through an early view lands after the fill
        self.head = nn.Parameter(head)
        self.seen_sum = float((seen * 1).sum())  # a value read while recording
        pieced = torch.empty(4, 16)
        pieces = pieced.unbind(0)  # taken before the fill, kept: cast by materialize(dtype=) only after it
        nn.init.normal_(pieced)
        self.piece = nn.Parameter(pieces[1])
        self.pieced = nn.Parameter(pieced)


def test_batched_fills_run_before_what_touches_them() -> None:
    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(FilledThenTouched))
    plan = g.plan()
    batched, flushes = plan.batches.fills, plan.batches.flushes
    filled = {fill.args[b.index] for fill, b in batched.items()}
    assert g.outputs["a.weight"] in filled and g.outputs["b.bias"] in filled and g.outputs["w"] in filled
    assert g.outputs["odd"] not in filled  # torch redraws the last block of a normal of 24
    assert g.outputs["twice"] in flushes
    assert {g.outputs[k] for k in ("through_early_view", "q_scaled")} <= flushes
    assert all(not set(n.all_input_nodes) & set(batched) or n in flushes or n in batched for n in plan.nodes)
    assert "batched" in str(plan) and "runs the batched fills queued before it first" in str(plan)
    assert_same_as_eager(FilledThenTouched)
    torch.manual_seed(0)
    eager = FilledThenTouched().to(torch.bfloat16)
    torch.manual_seed(0)
    m = fxinit.trace_init(FilledThenTouched)
    assert m.seen_sum == eager.seen_sum  # computed while recording, with the fill run first
    fxinit.materialize(m, dtype=torch.bfloat16)  # casts after batched fills
    for (k, want), got in zip(eager.state_dict().items(), m.state_dict().values()):
        assert torch.equal(got, want), k


def test_batched_fills_fall_back_to_torch_where_the_kernel_is_distrusted(monkeypatch) -> None:
    from fxinit.rng import fills

    def off(op, dtype, path, ptr, job, words, consumed, p0, p1):  # noqa: ANN001, ANN202
        return real(op, dtype, path, ptr, job, words, consumed, p0 + 1e-3, p1)

    real = fills._kernel_call
    fills.reset_checks()
    monkeypatch.setattr(fills, "_kernel_call", off)
    try:
        assert_same_as_eager(FilledThenTouched, seeds=(3,))
    finally:
        monkeypatch.setattr(fills, "_kernel_call", real)
        fills.reset_checks()
