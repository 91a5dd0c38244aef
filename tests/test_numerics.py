"""torch's numeric settings (``fxinit.numerics``): a graph replays under the settings its
constructor ran under, whatever is in force at ``materialize``, after a save and load, on the
materializer's threads, and for a setting changed inside ``__init__``. Each case is checked
against eager construction under the same settings."""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import pytest
import torch

import fxinit
from fxinit.numerics import applied, current

TINY = 1e-39  # a float32 subnormal: a thread that flushes denormals computes 0 from it


@contextlib.contextmanager
def threads(n: int) -> Iterator[None]:
    saved = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(saved)


@contextlib.contextmanager
def flushing() -> Iterator[None]:
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(False)


@contextlib.contextmanager
def deterministic() -> Iterator[None]:
    torch.use_deterministic_algorithms(True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(False)


class Reduced(torch.nn.Module):
    """Values that depend on the settings: a large sum (split by the thread count), an
    uninitialized buffer (NaN under deterministic algorithms), a product of subnormals."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4_000_000))
        self.register_buffer("total", self.w.detach().sum().reshape(1))
        self.register_buffer("unset", torch.empty(5))
        self.register_buffer("tiny", torch.full((6,), TINY) * 0.5)


def _eager_and_traced(cls: Callable[[], torch.nn.Module]) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    eager = cls()
    torch.manual_seed(0)
    return eager, fxinit.trace_init(cls)


def _assert_same(eager: torch.nn.Module, ours: torch.nn.Module) -> None:
    mine = ours.state_dict()
    for name, want in eager.state_dict().items():
        assert torch.equal(want, mine[name]) or (want.isnan().all() and mine[name].isnan().all()), name


def test_settings_round_trip() -> None:
    """Settings changed are set again by ``applied`` and restored after."""
    torch.set_float32_matmul_precision("highest")  # (torch's legacy setter sets the backends' own)
    before = current()
    with threads(1), flushing(), deterministic():
        torch.utils.deterministic.fill_uninitialized_memory = False
        torch.set_float32_matmul_precision("medium")
        changed = current()
        torch.set_float32_matmul_precision("highest")
        torch.utils.deterministic.fill_uninitialized_memory = True
    differ = {name for (name, a), (_, b) in zip(changed, before) if a != b}
    assert {"num_threads", "flush_denormal", "deterministic_algorithms", "deterministic_fill_uninitialized_memory",
            "float32_matmul_precision", "fp32_precision.mkldnn.matmul"} <= differ
    with applied(changed):
        assert current() == changed
        assert torch.get_float32_matmul_precision() == "medium"  # torch's legacy getter agrees
    assert current() == before


def test_the_constructors_settings_hold_at_materialize() -> None:
    with threads(1), flushing(), deterministic():
        eager, traced = _eager_and_traced(Reduced)
    assert eager.unset.isnan().all() and not eager.tiny.any()
    fxinit.materialize(traced)
    _assert_same(eager, traced)
    with threads(3):
        again = Reduced()
    assert not torch.equal(again.total, eager.total)  # the thread count does change the sum


def test_settings_survive_save_and_load(tmp_path) -> None:
    with threads(1), deterministic():
        eager, traced = _eager_and_traced(Reduced)
    path = tmp_path / "g.pt"
    fxinit.init_graph(traced).save(path)
    graph = fxinit.load_graph(path)
    assert dict(graph.numerics)["deterministic_algorithms"] == "on"
    values = graph.materialize()
    for name, want in eager.state_dict().items():
        assert torch.equal(want, values[name]) or (want.isnan().all() and values[name].isnan().all()), name


class Toggles(torch.nn.Module):
    """The same computations under settings changed inside the constructor: recorded per op,
    and never merged as common subexpressions."""

    def __init__(self) -> None:
        super().__init__()
        x = torch.full((6,), TINY)
        torch.set_flush_denormal(True)
        self.register_buffer("flushed", x * 0.5)
        torch.use_deterministic_algorithms(True)
        self.register_buffer("nan", torch.empty(3))
        torch.use_deterministic_algorithms(False)
        torch.set_flush_denormal(False)
        self.register_buffer("kept", x * 0.5)


def test_settings_changed_inside_the_constructor() -> None:
    eager, traced = _eager_and_traced(Toggles)
    assert not eager.flushed.any() and eager.kept.all() and eager.nan.isnan().all()
    shown = str(fxinit.init_graph(traced).plan())
    assert shown.count("under its own numeric settings") == 2, shown  # the product flushed, and the NaN fill
    fxinit.materialize(traced)
    _assert_same(eager, traced)
    assert not torch.are_deterministic_algorithms_enabled()


class Wide(torch.nn.Module):
    """Enough bytes for the materializer's threads (``backends.parallel``), each group reading
    a setting: flush-denormal is a property of each thread."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(6):
            self.register_buffer(f"b{i}", torch.full((1 << 20,), TINY) * (i + 1))


def test_worker_threads_replay_under_the_settings() -> None:
    with flushing():
        eager, traced = _eager_and_traced(Wide)
    assert not eager.b0.any()
    with threads(2):
        fxinit.materialize(traced)
    _assert_same(eager, traced)
    torch.manual_seed(0)
    unflushed = fxinit.trace_init(Wide)
    fxinit.materialize(unflushed)
    assert unflushed.b0.all()


class KeptProduct(torch.nn.Module):
    """A kept tensor computed from a parameter (its ``grad_fn`` is rebuilt at materialize),
    under a thread count the constructor set."""

    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(4_000_000))
        self.total = self.w.sum()


@pytest.mark.filterwarnings("error")
def test_a_rebuilt_grad_fn_runs_under_the_settings() -> None:
    with threads(1):
        eager, traced = _eager_and_traced(KeptProduct)
    fxinit.materialize(traced)
    assert torch.equal(eager.total, traced.total)
    assert type(traced.total.grad_fn).__name__ == type(eager.total.grad_fn).__name__
