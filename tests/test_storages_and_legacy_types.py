"""Ways into the capture that no ``__torch_function__`` announces: storage methods (whose C++
and Python build tensors over real memory), the legacy typed classes (``torch.FloatTensor(t)``,
checked in C++), and sparse constructors that infer their size from index values; and
``check`` / ``init_graph`` on models holding sparse tensors."""

from __future__ import annotations

import copy
import io
import pickle
import threading
import typing
import warnings
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn

import fxinit
from tests.conftest import ORDERS, assert_same_as_eager, compare_modules, materialize_in_order, rng_state

pytestmark = pytest.mark.filterwarnings("ignore:TypedStorage is deprecated", "ignore:Sparse invariant checks")


def assert_equal_to_eager(factory: Callable[..., nn.Module], *args: Any) -> None:
    """``assert_same_as_eager`` for models that hold real tensors as eager's do (a caller's
    tensor, copies of it): every order of materialize gives eager's tensors and RNG state."""
    torch.manual_seed(0)
    ref = factory(*args)
    eager_rng = rng_state()
    for order in ORDERS:
        torch.manual_seed(0)
        m = fxinit.trace_init(factory, *args)
        assert torch.equal(rng_state(), eager_rng), order
        materialize_in_order(m, order)
        assert not fxinit.is_deferred(m), order
        errors = compare_modules(m, ref, f"[{order}] ")
        assert not errors, "\n".join(errors)


class _Holder(nn.Module):
    def __init__(self, t: torch.Tensor, view: bool) -> None:
        super().__init__()
        self.register_buffer("b", t.view(1, -1) if view else t)


class DeepCopiesAHandedInTensor(nn.Module):
    """chemprop's ``MPNN``: a metric holding a buffer made from the caller's array is cloned
    (torchmetrics' ``clone`` is a deep copy) in the constructor."""

    def __init__(self, t: torch.Tensor, view: bool) -> None:
        super().__init__()
        self.a = _Holder(t, view)
        self.c = copy.deepcopy(self.a)
        self.register_buffer("d", copy.deepcopy(t[1:]))


@pytest.mark.parametrize("view", [False, True])
def test_a_deep_copy_of_a_real_tensor_in_the_constructor_is_eagers(view: bool) -> None:
    assert_equal_to_eager(DeepCopiesAHandedInTensor, torch.tensor([1.0, 2.0, 3.0]), view)


class StorageMethods(nn.Module):
    """Storage methods on real memory while recording: each builds tensors over it in torch."""

    def __init__(self, t: torch.Tensor, target: torch.Tensor, filled: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        st, ts = t.untyped_storage(), t._typed_storage()
        self.register_buffer("cloned", torch.tensor([], dtype=t.dtype).set_(st.clone()))
        target.untyped_storage().copy_(st)  # the caller's tensors (a deferred one has no storage to give)
        self.register_buffer("copied", target)
        filled.untyped_storage().fill_(7)
        self.register_buffer("filled", filled)
        self.register_buffer("listed", torch.tensor(ts.tolist() + [ts[1]]))
        self.register_buffer("cast", torch.tensor(ts.double().tolist(), dtype=torch.float64))
        self.register_buffer("legacy", torch.FloatTensor(torch.FloatStorage([4.0, 5.0])))
        buffer = io.BytesIO()
        torch.save(t, buffer)
        buffer.seek(0)
        self.register_buffer("loaded", torch.load(buffer, weights_only=True))
        self.register_buffer("unpickled", pickle.loads(pickle.dumps(t)))


def test_storage_methods_run_on_real_memory_while_recording() -> None:
    target, filled = torch.zeros(3), torch.zeros(3)
    assert_equal_to_eager(StorageMethods, torch.tensor([1.0, 2.0, 3.0]), target, filled)
    assert target.tolist() == [1.0, 2.0, 3.0] and filled.view(torch.uint8).unique().tolist() == [7]


class LegacyTypes(nn.Module):
    """schnetpack's ``GaussianRBF``: ``torch.FloatTensor(width * torch.ones_like(offset))``; the
    legacy classes given deferred tensors of their dtype alias them, as eager's do."""

    def __init__(self) -> None:
        super().__init__()
        offset = torch.linspace(0.0, 4.0, 8)
        self.register_buffer("widths", torch.FloatTensor(torch.abs(offset[1] - offset[0]) * torch.ones_like(offset)))
        x = torch.randn(3)
        torch.FloatTensor(x).add_(1)  # an alias: x changes with it
        self.register_buffer("x", x)
        self.register_buffer("index", torch.LongTensor(torch.arange(4)))
        self.w = nn.Parameter(torch.randn(3))
        self.aliased = torch.FloatTensor(self.w)  # AliasBackward0, as eager's
        self.seen = (isinstance(x, torch.FloatTensor), isinstance(x, torch.LongTensor),
                     torch.FloatTensor == torch.FloatTensor, torch.FloatTensor.dtype, repr(torch.cuda.LongTensor),
                     pickle.loads(pickle.dumps(torch.FloatTensor)) is torch.FloatTensor)


def test_legacy_typed_classes_of_deferred_tensors_are_eagers() -> None:
    assert_same_as_eager(LegacyTypes, seeds=(0,))
    torch.manual_seed(0)
    eager = LegacyTypes()
    torch.manual_seed(0)
    m = fxinit.materialize(fxinit.trace_init(LegacyTypes))
    assert m.seen == eager.seen == (True, False, True, torch.float32, "<class 'torch.cuda.LongTensor'>", True)
    assert type(m.aliased.grad_fn).__name__ == "AliasBackward0" and m.aliased._base is m.w
    m.aliased.sum().backward()
    assert torch.equal(m.w.grad, torch.ones(3))
    assert type(torch.FloatTensor).__name__ == "tensortype"  # torch's own class again after the trace


def test_a_legacy_class_of_another_dtype_raises_torchs_type_error() -> None:
    def build() -> nn.Module:
        m = nn.Module()
        m.register_buffer("b", torch.DoubleTensor(torch.randn(2)))
        return m

    with pytest.raises(TypeError, match="expected TensorOptions"):
        build()
    with pytest.raises(TypeError, match="expected TensorOptions"):
        fxinit.trace_init(build)
    assert type(torch.DoubleTensor).__name__ == "tensortype"


class SparseWithoutSize(nn.Module):
    """pykeen's Weisfeiler-Lehman initializer (``torch.sparse_coo_tensor(indices, values)``):
    the size comes from the values of indices built in the constructor."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3))
        indices = torch.tensor([[0, 2, 1], [1, 0, 3]])
        self.register_buffer("dense", torch.sparse_coo_tensor(indices, torch.randn(3)).to_dense())
        crow, col = torch.tensor([0, 1, 3]), torch.tensor([2, 0, 4])
        self.register_buffer("csr", torch.sparse_csr_tensor(crow, col, torch.ones(3)).to_dense())
        self.from_parameter = torch.sparse_coo_tensor(indices, self.w)  # with its autograd edge, as eager's


def test_sparse_constructors_infer_their_size_from_deferred_indices() -> None:
    assert_equal_to_eager(SparseWithoutSize)  # (sparse results are real, as the capture contract says)
    torch.manual_seed(0)
    m = fxinit.trace_init(SparseWithoutSize)
    assert type(m.from_parameter.grad_fn).__name__ == "SparseCooTensorWithDimsAndTensorsBackward0"


class SparseHolder(nn.Module):
    """whisper's ``alignment_heads`` (a sparse buffer), and a sparse parameter from deferred values."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2, 2))
        self.register_buffer("heads", torch.zeros(2, 3, dtype=torch.bool).to_sparse(), persistent=False)
        v = torch.randn(4, 4)
        self.s = nn.Parameter((v * (v.abs() > 0.5)).to_sparse())


def test_check_compares_sparse_tensors_and_init_graph_refuses_them_by_name() -> None:
    report = fxinit.check(SparseHolder)
    assert report.ok, report
    with pytest.raises(fxinit.DeferredInitError, match="(s|heads) is a torch.sparse_coo tensor"):
        fxinit.init_graph(fxinit.trace_init(SparseHolder))


def test_a_real_tensor_in_an_init_graph_is_explained() -> None:
    def build() -> nn.Module:
        m = nn.Linear(2, 2)
        m.register_buffer("table", torch.tensor([1.0, 2.0]).clone())
        return m

    m = fxinit.trace_init(build)
    m.table = torch.tensor([3.0, 4.0])  # real, set after the trace: a constant of the graph
    graph = fxinit.init_graph(m)
    assert "a real tensor the model holds: table" in graph.explain("table")
    torch.manual_seed(0)
    ref = build()
    ref.table = torch.tensor([3.0, 4.0])
    torch.manual_seed(0)
    m2 = fxinit.trace_init(build)
    m2.table = torch.tensor([3.0, 4.0])
    assert not compare_modules(fxinit.materialize(m2), ref)


def test_from_numpy_of_a_deferred_views_array() -> None:
    """asteroid's ``TorchSTFTFB``: ``torch.from_numpy(window.numpy())`` of ``torch.hann_window(16)``
    (a view of 16 of 17 elements): eager's values and layout, and no warning eager does not give;
    of a view inside its storage, a refusal that says so."""
    def build(offset: bool) -> nn.Module:
        m = nn.Module()
        window = torch.arange(17.0)[1:] if offset else torch.hann_window(16)
        m.register_buffer("window", torch.from_numpy(window.numpy()).float())
        return m

    eager = build(False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = fxinit.materialize(fxinit.trace_init(build, False))
    assert torch.equal(m.window, eager.window) and m.window.stride() == eager.window.stride()
    with pytest.raises(fxinit.DeferredInitError, match="a deferred view that starts inside its storage"):
        fxinit.trace_init(build, True)


class _KeepsTheClass(nn.Module):
    """Old-style code: the class kept to cast inputs in ``forward``, and set as the default."""

    def __init__(self) -> None:
        super().__init__()
        torch.set_default_tensor_type(torch.FloatTensor)
        self.lin = nn.Linear(2, 2)
        self.Tensor = torch.FloatTensor
        self.copied = copy.deepcopy({"t": torch.FloatTensor})["t"]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x.type(self.Tensor))


def test_legacy_classes_kept_beyond_the_capture_or_used_by_torchs_cxx_work_as_eagers() -> None:
    """Found by the review: the first stand-ins (classes) broke what C++ takes a class for, also
    in another thread during a capture and where a model kept one (``x.type(self.Tensor)``)."""
    m = fxinit.materialize(fxinit.trace_init(_KeepsTheClass))
    assert m(torch.ones(1, 2, dtype=torch.float64)).dtype == torch.float32
    assert m.copied == torch.FloatTensor and pickle.loads(pickle.dumps(m.Tensor)) is torch.FloatTensor
    assert m.Tensor.__name__ == "FloatTensor" and m.Tensor.__module__ == "torch" and isinstance(m.Tensor, type)


def test_annotations_with_legacy_classes_evaluated_while_recording() -> None:
    """Found by the review: stand-ins that were strings broke ``torch.FloatTensor | None`` in a
    function defined during the capture (transformers' modeling files, imported lazily by
    ``AutoModel.from_config`` inside ``trace_init``, annotate so)."""
    class Annotated(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.hints = (torch.FloatTensor | None, None | torch.LongTensor, typing.Optional[torch.FloatTensor])

    m = fxinit.trace_init(Annotated)
    assert [a.dtype for hint in m.hints for a in typing.get_args(hint) if a is not type(None)] == [
        torch.float32, torch.int64, torch.float32]


def test_a_legacy_class_taken_before_the_trace_is_refused_by_name() -> None:
    held = torch.FloatTensor

    def build() -> nn.Module:
        m = nn.Module()
        m.register_buffer("b", held(torch.ones(3) * 2))
        return m

    with pytest.raises(fxinit.DeferredInitError, match="taken before the trace was given a deferred tensor"):
        fxinit.trace_init(build)


def test_another_thread_uses_the_legacy_classes_while_a_capture_is_on() -> None:
    started, done, seen = threading.Event(), threading.Event(), {}

    class Slow(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            started.set()
            done.wait(10)
            self.lin = nn.Linear(2, 2)

    def other() -> None:
        started.wait(10)
        try:
            seen["type"] = torch.ones(2, dtype=torch.float64).type(torch.FloatTensor).dtype
            seen["call"] = torch.FloatTensor([1.0, 2.0]).tolist()
            seen["isinstance"] = isinstance(torch.ones(2), torch.FloatTensor)
        finally:
            done.set()

    thread = threading.Thread(target=other)
    thread.start()
    fxinit.trace_init(Slow)
    thread.join()
    assert seen == {"type": torch.float32, "call": [1.0, 2.0], "isinstance": True}


def test_a_storage_write_into_memory_a_deferred_tensor_shares_is_refused() -> None:
    """Found by the review: ``w.data = t`` makes ``w`` eager's ``t``'s memory; a later write
    through ``t``'s storage changed only ``t`` (the tensor-op write was refused already)."""
    class Shares(nn.Module):
        def __init__(self, t: torch.Tensor) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(3))
            v = t[:1]  # (a view of t: fxinit gives t a copy of w's value)
            t.data = self.w
            t.untyped_storage().fill_(0)

    with pytest.raises(fxinit.DeferredInitError, match="storage's fill_ here: this memory is shared"):
        fxinit.trace_init(Shares, torch.tensor([1.0, 2.0, 3.0]))
