"""Tracing for a CUDA target on a machine without CUDA (issue 32): the recorded graph's ops,
devices and generators, checked on the CPU against what torch's CUDA sources say eager
construction does (the table in ``fxinit/rng/philox.py``; ``tools/gpu_check.py`` checks the
values on a GPU)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxinit
from tests.conftest import TORCH_RELEASE
from fxinit.rng.philox import (DEFAULT_SEED, PendingPhilox, Reservation, decode_pending, encode_pending, increment,
                               reservation)

if torch.cuda.is_available():
    pytest.skip("these check recording for a CUDA that is absent", allow_module_level=True)

H100 = dict(sms=132, threads_per_sm=2048)
A100 = dict(sms=108, threads_per_sm=2048)
aten = torch.ops.aten


def test_offset_increments_follow_torchs_execution_policy() -> None:
    # measured on an H100 (docs: ../shared/DESIGN.md): +4 up to 1M elements, +64 at 16M, +500 at 134M
    assert [increment(Reservation(n, 4), **H100) for n in (1, 2**20, 2**24, 2**27)] == [4, 4, 64, 500]
    assert increment(Reservation(0, 4), **H100) == 0  # an empty kernel returns before reserving
    # blocks = min(ceil(N / 256), SMs * 8): the grid saturates at 1056 blocks (H100), 864 (A100)
    assert increment(Reservation(256 * 1056 * 4, 4), **H100) == 4
    assert increment(Reservation(256 * 1056 * 4 + 1, 4), **H100) == 8
    assert increment(Reservation(256 * 864 * 2 + 1, 2), **A100) == 8
    assert increment(Reservation(256 * 1056 * 4 + 1, 4), **A100) == 8


@pytest.mark.parametrize("func, args, dtype, unroll", [
    (aten.uniform_.default, (), torch.float32, 4),
    (aten.uniform_.default, (), torch.bfloat16, 4),
    (aten.uniform_.default, (), torch.float64, 2),
    (aten.normal_.default, (), torch.float16, 4),
    (aten.normal_.default, (), torch.float64, 2),
    (aten.bernoulli_.float, (), torch.float32, 4),
    (aten.exponential_.default, (), torch.float32, 4),
    (aten.native_dropout.default, (), torch.float32, 4),
    (aten.randint.low, (0, 10), torch.int64, 4),
    (aten.randint.low, (0, 2**40), torch.int64, 2),   # a range of 2**32 or more: 64-bit draws
    (aten.randint.low, (0, 2**33), torch.float16, 4),  # ... but not for float16
    (getattr(aten.random_, "from"), (0, 2**33), torch.float32, 2),
    (aten.random_.to, (2**32,), torch.bfloat16, 2),
    (aten.randperm.default, (), torch.int64, None),    # not followed: refused by name
    (aten.bernoulli_.Tensor, (), torch.float32, None),
])
def test_reservation_table(func, args, dtype, unroll) -> None:
    out = torch.empty(1000, dtype=dtype, device="meta")
    call_args = args if func in (aten.randint.low,) else (out, *args)
    got = reservation(func, call_args, {}, out)
    assert (got.unroll if got is not None else None) == unroll
    if got is not None:
        assert got.numel == 1000


class Built(nn.Module):
    """Random ops on the CUDA generator, one on the CPU's, and a reseed inside __init__."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(64, 32)                                     # uniform_ 2048, uniform_ 32
        self.register_buffer("cpu_noise", torch.normal(0.0, 1.0, size=(5,)))  # no device: the CPU's
        self.emb = nn.Embedding(10, 8, padding_idx=0)                    # normal_ 80
        self.register_buffer("drop", F.dropout(torch.ones(300), 0.25))   # native_dropout on CUDA
        torch.manual_seed(11)                                            # CUDA's offset restarts at 0
        self.w = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))    # randn float64
        self.ids = nn.Buffer(torch.randint(0, 2**40, (7,)))              # 64-bit draws


def _random_nodes(graph: fxinit.InitGraph) -> list[tuple]:
    out = []
    for n in graph.graph.nodes:
        keys = n.meta.get("generators")
        if keys:
            (key,) = keys.values()
            snap = graph.snapshots[key]
            where = snap.device
            offset = snap.offset(**H100) if isinstance(snap, PendingPhilox) else None
            out.append((str(n.target), where, getattr(snap, "seed", None), offset))
    return out


def test_recorded_graph_of_a_cuda_construction() -> None:
    torch.manual_seed(7)
    with torch.device("cuda"):
        m = fxinit.trace_init(Built)
    assert {k: str(t.device) for k, t in m.state_dict().items()} == {
        "cpu_noise": "cpu", "drop": "cuda:0", "ids": "cuda:0", "w": "cuda:0", "lin.weight": "cuda:0",
        "lin.bias": "cuda:0", "emb.weight": "cuda:0"}
    first = increment(Reservation(2048, 4), **H100)
    second = first + increment(Reservation(32, 4), **H100)
    third = second + increment(Reservation(80, 4), **H100)
    assert _random_nodes(fxinit.init_graph(m)) == [
        ("aten.uniform_.default", "cuda:0", 7, 0),
        ("aten.uniform_.default", "cuda:0", 7, first),
        ("aten.normal.float_float", "cpu", None, None),
        ("aten.normal_.default", "cuda:0", 7, second),
        ("aten.native_dropout.default", "cuda:0", 7, third),
        ("aten.randn.default", "cuda:0", 11, 0),
        ("aten.randint.low", "cuda:0", 11, increment(Reservation(16, 2), **H100)),
    ]


def test_unseeded_cuda_generator_has_torchs_default_seed(monkeypatch) -> None:
    tracker = torch.cuda._lazy_seed_tracker
    monkeypatch.setattr(tracker, "call_order", [])
    with torch.device("cuda"):
        m = fxinit.trace_init(nn.Linear, 3, 3)
    seeds = {s.seed for s in fxinit.init_graph(m).snapshots.values()}
    assert seeds == {DEFAULT_SEED}


def test_unknowable_cuda_state_is_refused(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "_queued_calls", list(torch.cuda._queued_calls))
    torch.cuda.seed_all()  # a random seed, chosen only when CUDA initializes
    with torch.device("cuda"), pytest.raises(fxinit.DeferredInitError, match="seed_all"):
        fxinit.trace_init(nn.Linear, 3, 3)


def test_materializing_here_is_refused_clearly() -> None:
    with torch.device("cuda"):
        m = fxinit.trace_init(nn.Linear, 3, 3)
    for kwargs in ({}, {"device": "cpu"}):
        with pytest.raises(fxinit.DeferredInitError, match="cuda"):
            fxinit.materialize(m, **kwargs)
    assert fxinit.is_deferred(m)


def test_artifact_keeps_the_chain(tmp_path) -> None:
    torch.manual_seed(7)
    with torch.device("cuda"):
        m = fxinit.trace_init(Built)
    graph = fxinit.init_graph(m)
    path = tmp_path / "cuda.pt"
    graph.save(path)
    loaded = fxinit.load_graph(path)
    assert _random_nodes(loaded) == _random_nodes(graph)
    # a table whose kept snapshots skip links of their chain keeps those links
    snaps = graph.snapshots
    last = [k for k, s in snaps.items() if isinstance(s, PendingPhilox) and s.seed == 7][-1]
    table = encode_pending({last: snaps[last]})
    assert len(table) == 4 and table[last]["after"] is not None
    decoded: dict = {}
    assert decode_pending(table, decoded) == []
    assert decoded[last].offset(**H100) == snaps[last].offset(**H100)


def test_artifact_chain_errors_are_named() -> None:
    ok = {"device": "cuda:0", "seed": 1, "after": None, "reserved": None}
    cycle = {"a": {"device": "cuda:0", "seed": 1, "after": "b", "reserved": [4, 4]},
             "b": {"device": "cuda:0", "seed": 1, "after": "a", "reserved": [4, 4]}}
    assert decode_pending(cycle, {}) == ["a", "b"]
    assert decode_pending({"x": ok, "y": {**ok, "after": "x", "reserved": [4, 3]}}, {}) == ["y"]
    assert decode_pending({"x": {**ok, "seed": True}}, {}) == ["x"]
    assert decode_pending({"x": ok, "y": {**ok, "seed": 2, "after": "x", "reserved": [4, 4]}}, {}) == ["y"]


def test_rnns_built_for_cuda_trace(monkeypatch) -> None:
    """On a GPU, RNNBase.flatten_parameters reads data_ptr() of every weight (cuDNN
    acceptable there); it must do nothing to deferred weights, and materialize flattens."""
    calls = []
    real = torch.backends.cudnn.is_acceptable
    monkeypatch.setattr(torch.backends.cudnn, "is_acceptable", lambda t: calls.append(t) or True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        m = fxinit.trace_init(lambda: nn.Sequential(nn.LSTM(3, 4, 2), nn.GRU(4, 4)))
    monkeypatch.setattr(torch.backends.cudnn, "is_acceptable", real)
    assert calls, "flatten_parameters did not reach its data_ptr() check"
    ops = [t for t, *_ in _random_nodes(fxinit.init_graph(m))]
    assert ops == ["aten.uniform_.default"] * (8 + 4)  # reset_parameters: LSTM 2 layers x 4, GRU 4


def test_a_second_trace_continues_the_generator() -> None:
    """Eager construction of two models after one seed continues CUDA's offset: so does fxinit."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        a = fxinit.trace_init(nn.Linear, 1000, 1000)
        b = fxinit.trace_init(nn.Linear, 1000, 1000)
    weight = increment(Reservation(10**6, 4), **H100)
    bias = increment(Reservation(1000, 4), **H100)
    assert [o for *_, o in _random_nodes(fxinit.init_graph(a))] == [0, weight]
    assert [o for *_, o in _random_nodes(fxinit.init_graph(b))] == [weight + bias, 2 * weight + bias]
    torch.manual_seed(0)  # a new seeding restarts it
    with torch.device("cuda"):
        c = fxinit.trace_init(nn.Linear, 1000, 1000)
    assert [o for *_, o in _random_nodes(fxinit.init_graph(c))] == [0, weight]


def test_native_dropout_reserves_unroll_4_in_every_dtype() -> None:
    out = torch.empty(1000, dtype=torch.float64, device="meta")
    assert reservation(aten.native_dropout.default, (out, 0.5, True), {}, out) == Reservation(1000, 4)


class Dirac(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(nn.init.dirac_(torch.empty(4, 4, 3)))
        self.register_buffer("b", torch.zeros(3))


def test_opaque_init_functions_replay_under_the_default_device_of_eager(tmp_path) -> None:
    """An init function recorded whole ran under eager's default device, and what it builds
    without ``device=`` is built there again when it is replayed: ``sparse_``'s ``randperm``
    draws from the device's generator under ``with torch.device("cuda")``, as eager's did (on
    an H100, replaying it on the CPU's generator gave other values). The device is node data:
    saved, and mapped to the CPU with the rest where it is materialized there."""
    with torch.device("cuda"):
        m = fxinit.trace_init(Dirac)
    graph = fxinit.init_graph(m)
    path = tmp_path / "dirac.pt"
    graph.save(path)
    for g in (graph, fxinit.load_graph(path)):
        opaque = [n for n in g.graph.nodes if n.meta.get("opaque")]
        if TORCH_RELEASE < (2, 12) and not torch.cuda.is_available():
            assert opaque == []  # torch 2.11 records it op by op for a device this process lacks
            continue
        (node,) = opaque
        assert node.kwargs["default_device"] == torch.device("cuda", 0)
    fxinit.materialize(m, device="cpu")
    assert torch.equal(m.w, nn.init.dirac_(torch.empty(4, 4, 3)))
    plain = fxinit.init_graph(fxinit.trace_init(Dirac))  # no device context: nothing recorded
    assert all("default_device" not in n.kwargs for n in plain.graph.nodes)


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(8, 4))
        nn.init.sparse_(self.w, 0.5)


def test_opaque_init_functions_replay_under_the_cpu_default_they_were_recorded_with() -> None:
    """Traced with no device context, ``sparse_``'s ``randperm`` drew from the CPU's generator;
    replayed inside another default device (``meta`` here), it still does."""
    torch.manual_seed(0)
    eager = Sparse().w.detach().clone()
    torch.manual_seed(0)
    m = fxinit.trace_init(Sparse)
    with torch.device("meta"):
        fxinit.materialize(m)
    assert torch.equal(m.w.detach(), eager)


def test_eigenvectors_built_for_cuda_are_row_major() -> None:
    """On CUDA ``linalg_eig`` computes on the CPU and copies into an output it resizes
    contiguous (``linalg_eig_out``, BatchLinearAlgebra.cpp), so its eigenvectors are row-major
    there, unlike the CPU kernel's column-major ones (``capture.layouts``): the recording keeps
    the meta kernel's layout, and ``.contiguous()`` copies nothing, as on the GPU."""
    from test_grad_branches import Eig
    layouts = {}
    for device in ("cpu", "cuda"):
        with torch.device(device):
            graph = fxinit.init_graph(fxinit.trace_init(Eig))
        (vectors,) = [n for n in graph.graph.nodes if n.op == "call_function" and n.args
                      and getattr(n.args[0], "target", None) is aten.linalg_eig.default and n.args[1] == 1]
        layouts[device] = (vectors.meta["spec"].stride, sum(n.target is aten.clone.default for n in graph.graph.nodes))
    assert layouts["cuda"] == ((25, 5, 1), 0)
    assert layouts["cpu"] == ((25, 1, 5), 1)  # .contiguous() copies the column-major vectors


def test_singular_vectors_built_for_cuda_are_row_major() -> None:
    """cuSOLVER computes ``V``, so ``_linalg_svd``'s ``Vh`` is row-major on CUDA, as the meta
    kernel gives it, and column-major on the CPU (``capture.layouts``)."""
    from test_grad_branches import SvdSplit
    strides = {}
    for device in ("cpu", "cuda"):
        with torch.device(device):
            graph = fxinit.init_graph(fxinit.trace_init(SvdSplit, True))
        vh = [n for n in graph.graph.nodes if n.op == "call_function" and n.args
              and getattr(n.args[0], "target", None) is aten._linalg_svd.default and n.args[1] == 2]
        strides[device] = vh[0].meta["spec"].stride
    assert strides == {"cuda": (32, 1), "cpu": (1, 32)}
