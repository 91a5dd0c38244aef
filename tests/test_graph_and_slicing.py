"""The InitGraph contract: slices run alone, in any order, with exact RNG replay."""

import copy

import torch
import torch.nn as nn

import fxinit
from fxinit.capture.deferred import state_of


class Aliasing(nn.Module):
    """Writes through views of a shared base after the parameters were taken from it."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.empty(4, 6)
        nn.init.normal_(base)
        self.a = nn.Parameter(base[:2])
        self.b = nn.Parameter(base[2:])
        with torch.no_grad():
            base.view(-1)[::5].fill_(7.0)  # lands in both a and b
        self.c = nn.Parameter(torch.empty(3))
        nn.init.uniform_(self.c)
        with torch.no_grad():
            self.c.add_(self.a[0, :3])  # c reads a's storage after the write above


def _eager(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return Aliasing()


def test_slice_of_one_output_runs_only_what_it_needs() -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(Aliasing)
    g = fxinit.init_graph(m)
    c_nodes = g.required_nodes(["c"])
    all_nodes = g.nodes
    assert len(c_nodes) < len(all_nodes)
    a_only = g.required_nodes(["a"])
    # `a` does not need the uniform_ draw of `c`
    assert not any(n.target is torch.ops.aten.uniform_.default for n in a_only)
    # `c` needs the write through the base that happens before it reads `a`
    assert any(n.target is torch.ops.aten.fill_.Scalar for n in c_nodes)


def test_each_output_alone_equals_eager_and_sharing_is_kept() -> None:
    ref = _eager(3)
    for name in ["c", "b", "a"]:
        torch.manual_seed(3)
        m = fxinit.trace_init(Aliasing)
        fxinit.materialize(getattr(m, name))
        assert torch.equal(getattr(m, name), getattr(ref, name)), name
    torch.manual_seed(3)
    m = fxinit.trace_init(Aliasing)
    fxinit.materialize(m)
    for name in ["a", "b", "c"]:
        assert torch.equal(getattr(m, name), getattr(ref, name))
    # a and b were views of one storage in eager construction; materialized together, they still are
    assert m.a.untyped_storage().data_ptr() == m.b.untyped_storage().data_ptr()


def test_init_graph_materialize_without_the_module() -> None:
    ref = _eager(5)
    torch.manual_seed(5)
    g = fxinit.init_graph(fxinit.trace_init(Aliasing))
    before = torch.get_rng_state()
    vals = g.materialize()
    assert torch.equal(before, torch.get_rng_state())
    assert set(vals) == {"a", "b", "c"}
    for k, v in vals.items():
        assert torch.equal(v, getattr(ref, k))
    assert g.stats()["random_ops"] == 2
    assert isinstance(g.graph, torch.fx.Graph)


def test_random_nodes_carry_their_generator_state() -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.Linear, 8, 8)
    node = state_of(m.weight).node
    rec = state_of(m.weight).recorder
    random_nodes = [n for n in rec.graph.nodes if n.meta.get("generators")]
    assert len(random_nodes) == 2
    # the first draw starts from the state manual_seed(0) gives
    torch.manual_seed(0)
    assert torch.equal(rec.snapshots[random_nodes[0].meta["generators"]["gen"]].state, torch.get_rng_state())
    assert node.op == "call_function"


def test_global_rng_is_neither_read_nor_changed_by_materialize() -> None:
    torch.manual_seed(11)
    ref = nn.Linear(5, 5)
    torch.manual_seed(11)
    m = fxinit.trace_init(nn.Linear, 5, 5)
    torch.manual_seed(999)  # materialize must not depend on this
    torch.rand(3)
    state = torch.get_rng_state()
    fxinit.materialize(m)
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(m.weight, ref.weight) and torch.equal(m.bias, ref.bias)


class LeavesSomeAsAllocated(nn.Module):
    """Tensors no op writes hold whatever memory held, in eager too."""

    def __init__(self) -> None:
        super().__init__()
        self.forgotten = nn.Parameter(torch.empty(3))
        self.zeroed = nn.Parameter(torch.empty(3))
        nn.init.zeros_(self.zeroed)
        self.register_buffer("view_of_empty", torch.empty(4, 4).t()[1])
        self.lin = nn.Linear(2, 2)
        self.register_buffer("copied", torch.empty(2).copy_(torch.arange(2.0)))
        # copies of an allocation (found by a Lightning sweep: nn.TransformerEncoder's deep
        # copies of a layer whose biases an empty init skipped)
        self.layers = nn.ModuleList([copy.deepcopy(self.lin) for _ in range(2)])
        self.layers[0].bias = nn.Parameter(self.forgotten.detach().clone())
        self.register_buffer("half_of_empty", self.view_of_empty.half())
        self.register_buffer("clone_written", self.forgotten.detach().clone().add_(1))


def test_uninitialized_names_the_tensors_no_op_writes() -> None:
    graph = fxinit.init_graph(fxinit.trace_init(LeavesSomeAsAllocated))
    assert sorted(graph.uninitialized()) == ["forgotten", "half_of_empty", "layers.0.bias", "view_of_empty"]
