"""Lazy skips of the default CPU generator during capture (fxinit.capture.skips): capture
notes where each random op starts without computing the state, yet every way a
constructor can look at or set the generator sees what eager construction would."""

from __future__ import annotations

import torch
import torch.nn as nn

import fxinit
from fxinit.capture.deferred import state_of
from fxinit.rng import PendingSnapshot


class ReadsAndSetsTheGenerator(nn.Module):
    """Reads and sets the default generator between fills large enough to be skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(64, 64)
        self.seen = torch.get_rng_state()  # the true state, not a placeholder
        self.seed = torch.initial_seed()
        self.b = nn.Linear(64, 64)
        saved = torch.default_generator.get_state()  # read directly: a placeholder under capture
        self.c = nn.Linear(64, 64)
        torch.default_generator.set_state(saved)  # put back: d draws what c drew
        self.d = nn.Linear(64, 64)
        with torch.random.fork_rng():
            torch.manual_seed(7)
            self.e = nn.Linear(64, 64)
        self.f = nn.Linear(64, 64)
        torch.manual_seed(3)
        self.g = nn.Linear(64, 64)
        nn.init.trunc_normal_(self.g.weight, std=0.02)  # an opaque function: runs for real on the true state
        self.h = nn.Linear(64, 64)


def test_reads_and_sets_of_the_generator_inside_capture_see_eager_states() -> None:
    torch.manual_seed(0)
    eager = ReadsAndSetsTheGenerator()
    after_eager = torch.get_rng_state()
    assert torch.equal(eager.c.weight, eager.d.weight)
    torch.manual_seed(0)
    m = fxinit.trace_init(ReadsAndSetsTheGenerator)
    assert torch.equal(torch.get_rng_state(), after_eager)
    assert torch.equal(m.seen, eager.seen) and m.seed == eager.seed
    fxinit.materialize(m)
    for name, t in eager.state_dict().items():
        assert torch.equal(t, m.state_dict()[name]), name


class Wide(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(256, 256) for _ in range(4))
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=0.02)


def test_capture_computes_no_state_and_portable_mode_never_does() -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(Wide)
    rec = state_of(m.layers[0].weight).recorder
    pending = [s for s in rec.snapshots.values() if isinstance(s, PendingSnapshot)]
    assert len(pending) == len(rec.snapshots) - 1  # all but the very first start, which is the real state
    assert all(s._state is None for s in pending)
    fxinit.materialize(m, rng="portable")
    assert all(s._state is None for s in pending)


def test_states_computed_in_any_order_agree() -> None:
    """A state read first from far along the chain equals the one reached step by step."""
    torch.manual_seed(0)
    eager = Wide()
    torch.manual_seed(0)
    a = fxinit.init_graph(fxinit.trace_init(Wide))
    torch.manual_seed(0)
    b = fxinit.init_graph(fxinit.trace_init(Wide))
    keys = list(a.snapshots)
    for k in keys:  # program order
        a.snapshots[k].state
    for k in reversed(keys):  # last first: one long jump, then the rest
        b.snapshots[k].state
    for k in keys:
        assert torch.equal(a.snapshots[k].state, b.snapshots[k].state), k
    values = b.materialize()
    assert all(torch.equal(values[name], t) for name, t in eager.state_dict().items())
