"""The capture contract (docs/capture-contract.md), door by door: each way a value enters or
leaves a capture gives eager's tensors, or a DeferredInitError — never a different tensor.

Each test here failed before the contract was written down (wrong values or an internal error).
"""

from __future__ import annotations

import collections
import collections.abc
import copy
import pickle
import threading
from typing import Any, Callable

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fxinit
from conftest import same_bits
from fxinit.check import reachable_tensors

DeferredInitError = fxinit.DeferredInitError


def _both(build: Callable[[], nn.Module], post: Callable[[nn.Module], Any] | None = None
          ) -> tuple[nn.Module, nn.Module]:
    """Eager and fxinit (traced, ``post`` run, materialized), each from seed 0; the RNG after
    both must agree."""
    torch.manual_seed(0)
    eager = build()
    if post is not None:
        post(eager)
    after_eager = torch.rand(3)
    torch.manual_seed(0)
    traced = fxinit.trace_init(build)
    if post is not None:
        post(traced)
    fxinit.materialize(traced)
    assert same_bits(torch.rand(3), after_eager), "the generator is not where eager leaves it"
    assert not fxinit.is_deferred(traced)
    return eager, traced


def _assert_equal(eager: nn.Module, traced: nn.Module) -> None:
    want = {**eager.state_dict(keep_vars=True), **dict(eager.named_buffers())}
    got = {**traced.state_dict(keep_vars=True), **dict(traced.named_buffers())}
    assert want.keys() == got.keys()
    for name, w in want.items():
        g = got[name]
        assert type(g) is type(w) and g.device == w.device, name
        assert same_bits(g.detach(), w.detach()), name


# ---------------------------------------------------------------- deserialization


@pytest.mark.parametrize("how", ["plain", "mmap", "submodule_load_state_dict", "np_load"])
def test_deserialized_tensors_have_their_values(tmp_path: Any, how: str) -> None:
    torch.manual_seed(123)
    torch.save(torch.randn(4, 3), tmp_path / "w.pt")
    torch.save({"weight": torch.randn(5, 4), "bias": torch.randn(5)}, tmp_path / "lin.pt")
    np.save(tmp_path / "a.npy", np.arange(6, dtype=np.float32))

    class Loads(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 5)
            if how == "plain":
                self.w = nn.Parameter(torch.load(tmp_path / "w.pt"))
            elif how == "mmap":
                self.w = nn.Parameter(torch.load(tmp_path / "w.pt", mmap=True, weights_only=True))
            elif how == "submodule_load_state_dict":
                self.lin.load_state_dict(torch.load(tmp_path / "lin.pt"))
            else:
                self.register_buffer("w", torch.from_numpy(np.load(tmp_path / "a.npy")))

    _assert_equal(*_both(Loads))
    torch.manual_seed(0)
    graph = fxinit.init_graph(fxinit.trace_init(Loads))  # the artifact carries the loaded values
    graph.save(tmp_path / "g.pt")
    values = fxinit.load_graph(tmp_path / "g.pt").materialize()
    torch.manual_seed(0)
    for name, want in Loads().state_dict().items():
        assert same_bits(values[name], want), name


# ---------------------------------------------------------------- real tensors edited in place


class EditsWhatItIsGiven(nn.Module):
    def __init__(self, t: torch.Tensor, vectors: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("b", t)
        self.b.div_(2)
        self.emb = nn.Embedding.from_pretrained(vectors, freeze=False)
        with torch.no_grad():
            self.emb.weight[0].zero_()
        self.lin = nn.Linear(3, 3)


def test_real_tensors_handed_in_are_edited_as_eager_edits_them() -> None:
    torch.manual_seed(0)
    given_e = (torch.arange(4.0), torch.ones(3, 2))
    eager = EditsWhatItIsGiven(*given_e)
    torch.manual_seed(0)
    given_t = (torch.arange(4.0), torch.ones(3, 2))
    traced = fxinit.trace_init(EditsWhatItIsGiven, *given_t)
    fxinit.materialize(traced)
    _assert_equal(eager, traced)
    assert traced.b is given_t[0] and same_bits(given_t[0], given_e[0])  # the caller's tensor, edited
    assert same_bits(given_t[1], given_e[1])


def test_from_numpy_shares_the_arrays_memory() -> None:
    class Aliases(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            a = np.ones(3, dtype=np.float32)
            self.register_buffer("b", torch.from_numpy(a))
            a[0] = 5  # eager's buffer sees this write
            self.lin = nn.Linear(2, 2)

    _assert_equal(*_both(Aliases))


def test_writing_a_large_deferred_value_into_a_real_tensor_is_refused() -> None:
    real = torch.zeros(2048, 2049)

    class Writes(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            w = torch.randn(2048, 2049)
            real.copy_(w)

    with pytest.raises(DeferredInitError, match="into a real tensor"):
        fxinit.trace_init(Writes)


# ---------------------------------------------------------------- doors around the dispatcher


def test_numpy_views_of_deferred_tensors_are_read_only() -> None:
    class WritesThroughNumpy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.lin.bias.detach().numpy()[:] = 1.0

    torch.manual_seed(0)
    with pytest.raises(DeferredInitError, match="through numpy") as info:
        fxinit.trace_init(WritesThroughNumpy)
    assert "test_contract.py" in (info.value.source or "")

    class ReadsThroughNumpy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(2, 2)
            self.register_buffer("copy", torch.tensor(self.lin.weight.detach().numpy() * 2))

    _assert_equal(*_both(ReadsThroughNumpy))


@pytest.mark.parametrize("method", ["apply_", "map_", "map2_"])
def test_python_elementwise_methods(method: str) -> None:
    class Elementwise(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("b", torch.arange(6.0))
            self.lin = nn.Linear(3, 3)
            if method == "apply_":
                self.b.apply_(lambda x: x * x + 1)
            elif method == "map_":
                self.b.map_(torch.ones(6), lambda x, y: x - y)
            else:
                self.b.map2_(torch.ones(6), torch.full((6,), 2.0), lambda x, y, z: x * z + y)

    _assert_equal(*_both(Elementwise))


def test_legacy_new_and_distributions() -> None:
    class New(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.register_buffer("b", self.lin.weight.new(3).fill_(2.0))
            self.register_buffer("c", self.lin.weight.new([1.0, 2.0]))
            self.register_buffer("empty", self.lin.weight.new())  # (0,), as eager's (was (): review)
            self.register_buffer("scalar", self.lin.weight.new(torch.Size([])).fill_(3.0))
            self.register_buffer("loc", torch.zeros(3))
            self.register_buffer("x", torch.distributions.Normal(self.loc, torch.ones(3)).sample())

    _assert_equal(*_both(New))


def test_sparse_buffers_and_composites_that_build_helpers() -> None:
    class Helpers(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("s", torch.eye(3).to_sparse())
            self.register_buffer("o", nn.functional.one_hot(torch.arange(3), 4))
            self.register_buffer("c", torch.combinations(torch.arange(4.0), 2))

    torch.manual_seed(0)
    eager = Helpers()
    traced = fxinit.trace_init(Helpers)
    fxinit.materialize(traced)
    assert same_bits(traced.s.to_dense(), eager.s.to_dense())
    assert same_bits(traced.o, eager.o) and same_bits(traced.c, eager.c)


def test_tensor_of_deferred_scalars() -> None:
    class Scalars(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            base = torch.tensor(10000.0)
            self.register_buffer("a", torch.tensor([base * 2, base / 3]))
            self.register_buffer("b", torch.tensor([[self.lin.weight[0, 0], 1.5], [self.lin.bias[1], 2]]))
            self.register_buffer("c", torch.tensor([self.lin.weight[1, 1]], dtype=torch.float64))

    _assert_equal(*_both(Scalars))


class MyParameter(nn.Parameter):
    pass


def test_parameter_subclasses_keep_their_class_and_attributes() -> None:
    class Subclassed(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = MyParameter(torch.randn(3))
            self.w.note = "kept"
            self.w.register_hook(lambda g: g * 2)

    eager, traced = _both(Subclassed)
    _assert_equal(eager, traced)
    assert type(traced.w) is MyParameter and traced.w.note == "kept"
    traced.w.sum().backward()
    assert same_bits(traced.w.grad, torch.full((3,), 2.0))  # the hook registered in __init__ fires


# ---------------------------------------------------------------- generator state


def test_generator_state_read_by_other_doors() -> None:
    class Doors(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(64, 64)
            g = torch.Generator()
            g.set_state(torch.default_generator.get_state())  # a placeholder would leak here
            self.register_buffer("x", torch.randn(100, generator=g))
            out: list[torch.Tensor] = []
            thread = threading.Thread(target=lambda: out.append(torch.rand(5)))
            thread.start()
            thread.join()
            self.register_buffer("r", out[0])
            state = EARLY_GET_RNG_STATE()
            self.b = nn.Linear(64, 64)
            torch.set_rng_state(state)
            self.c = nn.Linear(64, 64)

    _assert_equal(*_both(Doors))


from torch import get_rng_state as EARLY_GET_RNG_STATE  # noqa: E402 (imported "before fxinit" in spirit)


# ---------------------------------------------------------------- init steps after the trace


class Rope(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("cos", torch.empty(8), persistent=False)
        self.anchors = [torch.randn(2), torch.arange(3.0)]
        self.tables = {"sin": torch.ones(2)}

    def init_weights(self) -> None:
        with torch.device(self.cos.device):
            self.cos = torch.arange(8.0).cos()
        helper = torch.empty(4, 4, device=self.lin.weight.device).normal_()
        with torch.no_grad():
            self.lin.weight.copy_(helper)
        nn.init.zeros_(self.lin.bias)


@pytest.mark.parametrize("to_empty", [False, True])
def test_init_steps_after_the_trace_need_no_wrapper(to_empty: bool) -> None:
    def post(m: nn.Module) -> None:
        if to_empty:
            m.to_empty(device="cpu")
        m.init_weights()

    eager, traced = _both(Rope, post)
    _assert_equal(eager, traced)
    if not to_empty:
        assert all(same_bits(a, b) for a, b in zip(traced.anchors, eager.anchors))
        assert type(traced.anchors[0]) is torch.Tensor and same_bits(traced.tables["sin"], eager.tables["sin"])


def test_tensors_in_containers_are_materialized_and_seen_as_deferred() -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(Rope)
    fxinit.materialize(m.lin)
    assert fxinit.is_deferred(m)  # the anchors and tables are not materialized yet
    fxinit.materialize(m, init=True)
    assert not fxinit.is_deferred(m)
    torch.manual_seed(0)
    eager = Rope()
    assert same_bits(m.anchors[0], eager.anchors[0])


class _Hidden:
    """olmo-core's ``hide_from_torch``: a tensor in a plain object, out of ``nn.Module``'s sight."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x


class _Slotted:
    __slots__ = ("table",)

    def __init__(self, table: torch.Tensor) -> None:
        self.table = table


class _Cache(collections.abc.MutableMapping):
    """olmo-core's ``BufferCache``: a mapping over a ``defaultdict``."""

    def __init__(self) -> None:
        self._data: collections.defaultdict = collections.defaultdict(dict)

    def __getitem__(self, k: str) -> Any:
        return self._data[k]

    def __setitem__(self, k: str, v: Any) -> None:
        self._data[k] = v

    def __delitem__(self, k: str) -> None:
        del self._data[k]

    def __iter__(self) -> Any:
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


class Hidden(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        self.counts = _Hidden(torch.zeros(4))
        self.noise = _Hidden(torch.rand(3))
        self.slotted = _Slotted(torch.randn(2))
        self.ordered = collections.OrderedDict(t=torch.randn(3))
        self.by_key: collections.defaultdict = collections.defaultdict(list)
        self.by_key["k"].append(torch.randn(2))
        self.cache = _Cache()
        self.cache["rope"]["sin"] = torch.arange(4.0).sin()
        self.dist = torch.distributions.Normal(torch.zeros(2), torch.ones(2))


def test_tensors_in_mappings_and_plain_objects_are_materialized() -> None:
    """Tensors held by dict subclasses, other mappings and plain objects (found by a sweep of
    olmo-core: its MoE router's hidden counters and its RoPE cache stayed deferred, and
    ``is_deferred`` and ``check`` said nothing)."""
    torch.manual_seed(0)
    eager = Hidden()
    torch.manual_seed(0)
    m = fxinit.trace_init(Hidden)
    assert fxinit.is_deferred(m.counts.x) and fxinit.is_deferred(m.cache["rope"]["sin"])
    fxinit.materialize(m)
    assert not fxinit.is_deferred(m)
    pairs = [(m.counts.x, eager.counts.x), (m.noise.x, eager.noise.x), (m.slotted.table, eager.slotted.table),
             (m.ordered["t"], eager.ordered["t"]), (m.by_key["k"][0], eager.by_key["k"][0]),
             (m.cache["rope"]["sin"], eager.cache["rope"]["sin"]), (m.dist.loc, eager.dist.loc)]
    assert all(not fxinit.is_deferred(got) and same_bits(got, want) for got, want in pairs)
    assert fxinit.check(Hidden).status == "equal"


def test_check_compares_tensors_in_plain_objects_by_their_path() -> None:
    torch.manual_seed(0)
    names = reachable_tensors(Hidden())
    assert {"noise.x", "slotted.table", "ordered['t']", "by_key['k'][0]", "cache['rope']['sin']",
            "dist.loc"} <= names.keys()


def test_plain_meta_tensors_left_behind_are_refused() -> None:
    m = fxinit.trace_init(Rope)
    m.anchors.append(torch.empty(2, device="meta"))  # nothing records this one
    with pytest.raises(DeferredInitError, match="plain meta tensors"):
        fxinit.materialize(m)
    with pytest.raises(DeferredInitError, match="plain meta tensors"):
        fxinit.init_graph(m)


# ---------------------------------------------------------------- global state


def test_meta_default_device_around_the_trace_is_never_a_silent_meta() -> None:
    torch.set_default_device("meta")
    try:
        m = fxinit.trace_init(nn.Linear, 3, 3)
    finally:
        torch.set_default_device(None)
    with pytest.raises(DeferredInitError, match="default device was meta"):
        fxinit.materialize(m)


def test_default_dtype_and_grad_mode_around_the_trace() -> None:
    def build() -> nn.Module:
        with torch.no_grad():
            torch.set_default_dtype(torch.float64)
            try:
                return nn.Sequential(nn.Linear(3, 3), nn.LayerNorm(3))
            finally:
                torch.set_default_dtype(torch.float32)

    eager, traced = _both(build)
    _assert_equal(eager, traced)
    assert traced[0].weight.dtype == torch.float64 and traced[0].weight.requires_grad



def test_autocast_and_torchscript_in_the_constructor_are_refused() -> None:
    class Autocast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            with torch.autocast("cpu", dtype=torch.bfloat16):  # eager: a bfloat16 product
                self.register_buffer("p", self.lin.weight @ self.lin.weight)

    with pytest.raises(DeferredInitError, match="under autocast"):
        fxinit.trace_init(Autocast)

    class Scripted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.jit.script(nn.Linear(4, 4))

    with pytest.raises(DeferredInitError, match="TorchScript"):
        fxinit.trace_init(Scripted)


class _KeepsHyperparameters(nn.Module):
    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss
        self.lin = nn.Linear(4, 4)
        self._hparams_initial = {"loss": copy.deepcopy(loss), "more": [nn.Linear(2, 2)]}


class _HoldsAside(nn.Module):
    def __init__(self, aside: nn.Module) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.aside = [aside]


def test_modules_held_in_containers_are_materialized_and_checked() -> None:
    """Found by a sweep of neuralforecast: Lightning's ``save_hyperparameters`` keeps a deep copy
    of the hyperparameters, a loss module among them, in a dict; materialize left the copy's
    tensors deferred (``pickle.dumps(model)`` refused where eager's pickles), and ``check``, which
    did not look there, said equal."""
    def build() -> nn.Module:
        return _KeepsHyperparameters(nn.Linear(3, 3))

    torch.manual_seed(0)
    eager = build()
    torch.manual_seed(0)
    traced = fxinit.materialize(fxinit.trace_init(build))
    assert not fxinit.is_deferred(traced._hparams_initial["loss"]) and not fxinit.is_deferred(
        traced._hparams_initial["more"][0])
    for got, want in ((traced._hparams_initial["loss"], eager._hparams_initial["loss"]),
                      (traced._hparams_initial["more"][0], eager._hparams_initial["more"][0])):
        assert torch.equal(got.weight, want.weight) and torch.equal(got.bias, want.bias)
    pickle.dumps(traced)  # (a deferred tensor refuses to be pickled)
    assert "_hparams_initial['loss'].weight" in reachable_tensors(traced)
    assert fxinit.check(build).ok
    # .to(dtype) does not reach them (review)
    torch.manual_seed(0)
    cast = fxinit.materialize(fxinit.trace_init(build), dtype=torch.bfloat16)
    assert cast.lin.weight.dtype == torch.bfloat16 and cast._hparams_initial["loss"].weight.dtype == torch.float32
    assert torch.equal(cast._hparams_initial["loss"].weight, eager._hparams_initial["loss"].weight)
    # one on meta stays there, as in eager (review)
    with torch.device("meta"):
        kept_aside = nn.Linear(2, 2)
    held = fxinit.materialize(fxinit.trace_init(_HoldsAside, kept_aside))
    assert held.aside[0].weight.is_meta and not held.lin.weight.is_meta


def test_indexed_assignment_and_parametrized_weights_in_init_steps() -> None:
    """After the trace no mode sees torch wrap a number for ``w[i] = x``; reading a
    parametrized weight runs its parametrization (recorded), never guarded like a forward."""
    import torch.nn.utils.parametrizations as P

    class Steps(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(4, 3)
            self.lin = P.orthogonal(nn.Linear(3, 3))

        def init_weights(self) -> None:
            self.emb.weight.data[0] = 0
            self.emb.weight.data[:, 1] = 2.5
            with torch.no_grad():
                self.register_buffer("scaled", self.lin.weight * 2)

    _assert_equal(*_both(Steps, lambda m: m.init_weights()))


class _SizedUnderInferenceMode(nn.Module):
    """braindecode's ``get_output_shape``: a training-mode forward under ``torch.inference_mode``
    in the constructor updates the running statistics of its norm layers."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(3)
        self.inorm = nn.InstanceNorm1d(3, track_running_stats=True, affine=True)
        self.lin = nn.Linear(3, 3)
        self.emb = nn.Embedding(5, 3, max_norm=0.5)
        with torch.inference_mode():
            y = self.inorm(self.bn(torch.randn(4, 3, 5)))
            z = F.rrelu(F.dropout(self.lin(y.transpose(1, 2)), 0.3), training=True)
            self.emb(torch.tensor([0, 2, 2]))
            up = F.interpolate(y.unsqueeze(1), size=(7, 9), mode="bicubic")  # torch's Python decomposition rounds
        self.register_buffer("out", z.sum().reshape(1).clone())                # otherwise than its C++ kernel
        self.register_buffer("up", up.clone())


def test_composite_ops_under_inference_mode_are_eagers() -> None:
    """Found by a sweep of braindecode (``EEGNet``): under ``inference_mode`` composite ops reach
    the capture whole, and ``aten.batch_norm``'s schema does not say it writes the running
    statistics: they kept their initial values, silently (also for ``InstanceNorm`` with
    running stats). The decomposition run there is the C++ kernel eager's dispatch runs, not
    ``OpOverload.decompose``'s choice, torch's Python one where it registers one (bicubic
    interpolation: other roundings)."""
    from tests.conftest import assert_same_as_eager
    assert_same_as_eager(_SizedUnderInferenceMode, seeds=(0,))



def test_set_under_inference_mode_is_as_outside_it() -> None:
    """Found by the review: the decomposition under ``inference_mode`` turned ``set_`` of a tensor
    into ``set_`` of its storage, which a deferred tensor has not to give."""
    class Sets(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(4, 4)
            with torch.inference_mode():
                x = torch.zeros(4)
                x.set_(self.lin.weight, 4, (4,), (1,))
                x.add_(1)

    torch.manual_seed(0)
    eager = Sets()
    torch.manual_seed(0)
    _assert_equal(eager, fxinit.materialize(fxinit.trace_init(Sets)))
