"""Device contexts and the silent differences of issue 32 that a CPU shows: each test builds
the same constructor eagerly and with fxinit, under the same context and seed, and compares
values, dtypes, devices, storage sharing and behaviour."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn as nn

import fxinit

ALL_INITS = ("trunc_normal_", "orthogonal_", "xavier_normal_", "kaiming_normal_", "sparse_", "eye_")


class OutAndInits(nn.Module):
    """``out=`` factories and every kind of init function: a device context gives ``device=``
    to ``torch.eye(n, out=w)`` inside ``nn.init.eye_``, which crashed on a deferred ``w``."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        w = torch.empty(3, 5)
        nn.init.trunc_normal_(w, std=0.02)
        nn.init.orthogonal_(w)
        nn.init.xavier_normal_(w)
        nn.init.kaiming_normal_(w)
        nn.init.sparse_(w, 0.5)
        self.w = nn.Parameter(w)
        self.i = nn.Parameter(nn.init.eye_(torch.empty(3, 4)))
        self.d = nn.Parameter(nn.init.dirac_(torch.empty(3, 3, 3)))
        o = torch.empty(4)
        torch.randn(4, out=o)
        torch.add(o, 1, out=o)
        self.register_buffer("o", o)
        self.register_buffer("r", torch.arange(4, out=torch.empty(4, dtype=torch.long)))
        self.register_buffer("n", torch.normal(0.0, 0.5, size=(5,)))
        self.register_buffer("nt", torch.normal(torch.zeros(3), 2.0))
        self.rnn = nn.LSTM(3, 3, 2)


def _same(eager: nn.Module, traced: nn.Module) -> None:
    want, got = eager.state_dict(), traced.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert got[k].device == want[k].device and got[k].dtype == want[k].dtype, k
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("how", ["set_default_device", "with"])
def test_cpu_device_context(how: str) -> None:
    def build(fn):
        torch.manual_seed(0)
        if how == "with":
            with torch.device("cpu"):
                return fn(OutAndInits)
        torch.set_default_device("cpu")
        try:
            return fn(OutAndInits)
        finally:
            torch.set_default_device(None)

    eager = build(lambda cls: cls())
    after_eager = torch.get_rng_state()
    traced = build(fxinit.trace_init)
    assert torch.equal(torch.get_rng_state(), after_eager)
    fxinit.materialize(traced)
    _same(eager, traced)


class Placed(nn.Module):
    """What torch's device context gives a device to, and what it leaves where it is."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("normal", torch.normal(0.0, 1.0, size=(3,)))  # no device argument: CPU
        self.register_buffer("zeros", torch.zeros(2))
        self.register_buffer("arange", torch.arange(3))
        self.register_buffer("constant", torch.tensor([1.0, 2.0]))
        self.register_buffer("eye", torch.eye(2, out=torch.empty(2, 2)))
        self.register_buffer("like", torch.zeros_like(self.normal))  # where its input is
        self.register_buffer("legacy", torch.Tensor(2).zero_())  # the legacy constructor: CPU


def test_devices_under_a_context_for_a_device_this_machine_lacks() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks recording for a device that is absent; tools/gpu_check.py covers CUDA")
    with torch.device("cuda"):
        torch.manual_seed(0)
        m = fxinit.trace_init(Placed)
    devices = {k: str(v.device) for k, v in m.state_dict().items()}
    assert devices == {"normal": "cpu", "zeros": "cuda:0", "arange": "cuda:0", "constant": "cuda:0",
                       "eye": "cuda:0", "like": "cpu", "legacy": "cpu"}
    torch.manual_seed(0)
    eager = Placed()  # on the CPU: the values are the same, drawn from the CPU generator
    fxinit.materialize(m, device="cpu")
    _same(eager, m)


class Moved(nn.Module):
    """Tensors moved or copied onto ``target`` in ``__init__``: deferred ones, real ones (an
    argument, numpy's), and a plain meta skeleton's shape, as transformers' ``from_pretrained``
    gives its non-persistent buffers a device (``torch.empty_like(buffer, device=...)``)."""

    def __init__(self, target: str, given: torch.Tensor) -> None:
        super().__init__()
        made = torch.arange(6.0).reshape(2, 3)  # deferred, on the CPU
        self.register_buffer("to_keyword", made.to(device=target))
        self.register_buffer("to_dtype", made.to(target, torch.float16))
        self.register_buffer("to_other", made.to(torch.empty(1, device=target, dtype=torch.float64)))
        self.register_buffer("full_like", torch.full_like(made, 2.0, device=target))
        self.register_buffer("new_ones", made.new_ones(3, device=target))
        self.register_buffer("given_to", given.to(target))
        self.register_buffer("given_like", torch.zeros_like(given, device=target))
        self.register_buffer("numpy_to", torch.from_numpy(np.arange(3.0)).to(device=target))
        self.register_buffer("new_tensor", made.new_tensor([1.0, 2.0], device=target))
        self.register_buffer("given_new_tensor", given.new_tensor([1, 2], device=target))
        self.register_buffer("new_tensor_dtype", made.new_tensor(torch.arange(3)))  # made's dtype, as eager
        self.register_buffer("as_tensor", torch.as_tensor(made, device=target))
        skeleton = torch.empty(4, device="meta")
        self.register_buffer("from_meta", torch.empty_like(skeleton, device=target).fill_(1.0))
        there = made.to(target)
        self.kept = (there.to(target) is there, there.to(device=target, copy=True) is there)
        self.register_buffer("type_as", made.type_as(torch.empty(1, device=target, dtype=torch.float16)))
        self.register_buffer("back_to_cpu", there.to(torch.empty(1, dtype=torch.float64)))  # the CPU's, float64
        self.type_name = there.type()
        self.lin = nn.Linear(3, 3).to(target)
        if target != "cpu":
            self.register_buffer("cuda_call", made.cuda())
            self.register_buffer("legacy_type", made.type(torch.cuda.HalfTensor))


def test_moves_onto_a_device_this_machine_lacks() -> None:
    """``t.to("cuda")``, ``t.cuda()``, ``zeros_like(t, device="cuda")``: onto the target, from
    deferred and real tensors alike. They had given CPU or meta tensors silently (and a
    skeleton's buffers stayed meta after ``from_pretrained`` on a GPU), or crashed in torch's
    CUDA initialization on a machine without CUDA."""
    if torch.cuda.is_available():
        pytest.skip("checks recording for a device that is absent; tools/gpu_check.py covers CUDA")
    given = torch.linspace(0, 1, 5)
    torch.manual_seed(0)
    m = fxinit.trace_init(Moved, "cuda", given)
    assert {k: str(v.device) for k, v in m.named_buffers() if v.device.type != "cuda"} == {
        "new_tensor_dtype": "cpu", "back_to_cpu": "cpu"}
    assert m.type_name == "torch.cuda.FloatTensor" and m.type_as.dtype == torch.float16
    assert {str(p.device) for p in m.lin.parameters()} == {"cuda:0"}  # "cuda": the current device, as eager says
    assert m.kept == (True, False)
    assert m.to_dtype.dtype == torch.float16 and m.to_other.dtype == torch.float64
    assert str(m.new_tensor_dtype.device) == "cpu" and m.new_tensor_dtype.dtype == torch.float32
    fxinit.materialize(m, device="cpu")
    torch.manual_seed(0)
    eager = Moved("cpu", given)
    got = dict(m.named_buffers())
    assert torch.equal(got.pop("cuda_call"), eager.to_keyword)
    assert torch.equal(got.pop("legacy_type"), eager.to_dtype)
    for k, v in eager.named_buffers():
        assert got[k].dtype == v.dtype and torch.equal(got[k], v), k
    assert all(torch.equal(a, b) for a, b in zip(m.lin.parameters(), eager.lin.parameters()))


class Aliasing(nn.Module):
    """When a move answers with the tensor itself (torch's ``to_will_alias``): an index left
    out means the current device, a format the strides already have is kept, and a positional
    ``copy`` copies."""

    def __init__(self, given: torch.Tensor) -> None:
        super().__init__()
        x = torch.zeros(3, device="cuda")
        x1 = torch.zeros(3, device="cuda:1")
        cl = torch.zeros(2, 3, 4, 5, device="cuda").to(memory_format=torch.channels_last)
        self.same = {
            "to(cuda:1)": x.to("cuda:1") is x, "cuda(1)": x.cuda(1) is x, "to(cuda)": x.to("cuda") is x,
            "cuda() of cuda:1": x1.cuda() is x1, "channels_last": cl.to("cuda", memory_format=torch.channels_last) is cl,
            "positional copy": x.to(torch.float32, False, True) is x,
            "real positional copy": given.to(torch.float32, False, True) is given,
            "legacy type of its own": x.type("torch.cuda.FloatTensor") is x,
            "legacy cpu type": given.type("torch.FloatTensor") is given,
        }
        self.devices = {"to(cuda:1)": x.to("cuda:1").device, "legacy type": x1.type(torch.cuda.HalfTensor).device,
                        "to(0)": given.to(0).device, "zeros_like(device=0)": torch.zeros_like(given, device=0).device,
                        "tensor(device=0)": torch.tensor([1.0], device=0).device, "empty(device=cuda)": x.device,
                        "cuda() of cuda:1": x1.cuda().device, "zeros(device=get_device())":
                            torch.zeros(1, device=x.get_device()).device}
        self.indices = (x.get_device(), x1.get_device(), given.get_device())
        cl = torch.zeros(2, 3, 4, 5).type("torch.cuda.FloatTensor", memory_format=torch.channels_last)
        self.channels_last = cl.is_contiguous(memory_format=torch.channels_last)


def test_moves_alias_as_torch_decides() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks recording for a device that is absent")
    m = fxinit.trace_init(Aliasing, torch.ones(3))
    assert m.same == {"to(cuda:1)": False, "cuda(1)": False, "to(cuda)": True, "cuda() of cuda:1": False,
                      "channels_last": True, "positional copy": False, "real positional copy": False,
                      "legacy type of its own": True, "legacy cpu type": True}
    assert {k: str(v) for k, v in m.devices.items()} == {
        "to(cuda:1)": "cuda:1", "legacy type": "cuda:1", "to(0)": "cuda:0", "zeros_like(device=0)": "cuda:0",
        "tensor(device=0)": "cuda:0", "empty(device=cuda)": "cuda:0", "cuda() of cuda:1": "cuda:0",
        "zeros(device=get_device())": "cuda:0"}
    assert m.indices == (0, 1, -1) and m.channels_last


def test_moves_on_the_cpu_are_eagers() -> None:
    given = torch.linspace(0, 1, 5)
    torch.manual_seed(0)
    eager = Moved("cpu", given)
    torch.manual_seed(0)
    m = fxinit.trace_init(Moved, "cpu", given)
    assert m.kept == eager.kept == (True, False)
    assert m.type_name == eager.type_name == "torch.FloatTensor"
    fxinit.materialize(m)
    _same(eager, m)


class EmptyOnMeta(nn.Module):
    """accelerate's ``init_empty_weights``: each parameter registered is replaced by
    ``type(p)(p.to("meta"), **p.__dict__)``; and moves to meta by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.kept = nn.Linear(3, 2)
        old = nn.Module.register_parameter

        def register_empty_parameter(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            old(module, name, param)
            if param is not None:
                kwargs = module._parameters[name].__dict__
                kwargs["requires_grad"] = param.requires_grad
                module._parameters[name] = type(module._parameters[name])(module._parameters[name].to("meta"), **kwargs)

        nn.Module.register_parameter = register_empty_parameter  # type: ignore[method-assign]
        try:
            self.empty = nn.Linear(3, 2)
        finally:
            nn.Module.register_parameter = old  # type: ignore[method-assign]
        self.register_buffer("low", self.kept.weight.detach().to("meta", torch.float16))


def test_moves_to_meta_are_copies_on_meta() -> None:
    """A deferred tensor is meta underneath, so torch answered ``t.to("meta")`` with ``t`` itself:
    a tensor eager has on meta was materialized with values on the CPU, and ``init_empty_weights``
    crashed on fxinit's own ``__dict__`` entries (found by a sweep of peft's
    ``low_cpu_mem_usage=True``)."""
    torch.manual_seed(0)
    eager = EmptyOnMeta()
    torch.manual_seed(0)
    m = fxinit.trace_init(EmptyOnMeta)
    moved = m.kept.bias.to("meta")
    assert moved is not m.kept.bias and moved.is_meta and not m.kept.bias.is_meta
    assert m.kept.weight.to("cpu") is m.kept.weight
    fxinit.materialize(m)
    for name, t in eager.state_dict().items():
        got = m.state_dict()[name]
        assert (got.device, got.dtype, type(got)) == (t.device, t.dtype, type(t)), name
        assert t.is_meta or torch.equal(got, t), name
    assert isinstance(m.empty.weight, nn.Parameter) and m.empty.weight.is_meta and m.low.dtype == torch.float16


def test_random_op_for_an_absent_device_is_refused_by_name() -> None:
    if torch.cuda.is_available():
        pytest.skip("checks recording for a device that is absent")

    class Permuted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("order", torch.randperm(6))  # CUDA's randperm: not followed without CUDA

    with torch.device("cuda"), pytest.raises(fxinit.DeferredInitError, match="random op for cuda:0.*randperm"):
        fxinit.trace_init(Permuted)


class MyParameter(nn.Parameter):
    pass


class SubclassCheck(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = MyParameter(torch.randn(3))
        self.checks = (isinstance(self.w, MyParameter), isinstance(self.w, nn.Parameter),
                       isinstance(self.w, torch.Tensor), type(self.w).__name__ != "MyParameter")


def test_isinstance_of_a_parameter_subclass_during_the_trace() -> None:
    torch.manual_seed(0)
    eager = SubclassCheck()
    torch.manual_seed(0)
    m = fxinit.trace_init(SubclassCheck)
    assert m.checks[:3] == eager.checks[:3] == (True, True, True)
    assert isinstance(m.w, MyParameter) and fxinit.is_deferred(m.w)
    fxinit.materialize(m)
    assert type(m.w) is MyParameter and torch.equal(m.w, eager.w)


class MaskedGradient(nn.Module):
    """A gradient mask the module never holds: only the hook's closure does."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        mask = torch.ones(4, 4)
        mask[0] = 0
        noise = torch.randn(4)
        self.lin.weight.register_hook(lambda g: g * mask)
        self.lin.register_forward_hook(lambda mod, args, out: out + noise)


def test_tensors_held_by_hooks_are_materialized_with_the_module() -> None:
    x = torch.arange(8.0).reshape(2, 4)
    results = []
    for build in (lambda: MaskedGradient(), lambda: fxinit.materialize(fxinit.trace_init(MaskedGradient))):
        torch.manual_seed(0)
        m = build()
        out = m.lin(x)
        out.sum().backward()
        results.append((out.detach(), m.lin.weight.grad))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1]) and not results[1][1][0].any()


class Ties(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        f = torch.randn(4)
        self.register_buffer("a", f)
        self.register_buffer("b", f)  # one object, two buffer slots
        self.register_buffer("view", f[:2])
        self.sub = nn.Module()
        self.sub.register_buffer("a", f)
        self.p = nn.Parameter(torch.randn(6))
        self.register_buffer("of_p", self.p.detach()[1:3])
        self.plain = torch.randn(3)  # Module.to leaves plain attributes and containers alone
        self.kept = [torch.randn(2)]
        self.register_buffer("freq", torch.arange(3.0))
        self.original_freq = self.freq  # a buffer object a plain attribute holds too
        self.register_buffer("i", torch.arange(3))
        self.register_buffer("i2", self.i)  # integer: .to(bfloat16) keeps it, and the tie


def _layout(m: nn.Module) -> tuple[dict, list]:
    named = {"a": m.a, "b": m.b, "view": m.view, "sub.a": m.sub.a, "p": m.p, "of_p": m.of_p, "plain": m.plain,
             "kept": m.kept[0], "freq": m.freq, "original_freq": m.original_freq, "i": m.i, "i2": m.i2}
    by_storage: dict[int, list[str]] = {}
    for k, t in named.items():
        by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(k)
    return {k: (t.dtype, t.tolist()) for k, t in named.items()}, sorted(by_storage.values())


def test_materialize_dtype_is_module_to() -> None:
    torch.manual_seed(0)
    eager = Ties().to(torch.bfloat16)
    torch.manual_seed(0)
    m = fxinit.materialize(fxinit.trace_init(Ties), dtype=torch.bfloat16)
    assert _layout(m) == _layout(eager)
    assert m.original_freq.dtype == torch.float32 and m.freq.dtype == torch.bfloat16


class Sparse(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.s = torch.sparse_coo_tensor(torch.tensor([[0, 1], [1, 0]]), torch.tensor([3.0, 4.0]), (2, 2))
        self.register_buffer("d", self.s.to_dense())


def test_sparse_tensors_are_built_where_eager_builds_them() -> None:
    with torch.device("cpu"):
        m = fxinit.materialize(fxinit.trace_init(Sparse))
        eager = Sparse()
    assert m.s.device == eager.s.device and torch.equal(m.s.to_dense(), eager.s.to_dense())
    _same(eager, m)
    if not torch.cuda.is_available():  # kept real: it cannot be built for a device this machine lacks
        with torch.device("cuda"), pytest.raises(fxinit.DeferredInitError, match="sparse.*cuda:0"):
            fxinit.trace_init(Sparse)


class NestedContexts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("outer", torch.zeros(2))
        with torch.device("meta"):
            self.lin = nn.Linear(2, 2)
        with torch.device("cpu"):
            self.register_buffer("on_cpu", torch.ones(2))
        self.register_buffer("after", torch.ones(2))


def test_device_contexts_entered_inside_the_constructor() -> None:
    outer = "cpu" if torch.cuda.is_available() else "cuda"  # a device this machine lacks, where it can
    with torch.device(outer):
        m = fxinit.trace_init(NestedContexts)
    want = "cpu" if outer == "cpu" else "cuda:0"
    assert (str(m.outer.device), str(m.lin.weight.device), str(m.on_cpu.device), str(m.after.device)) == \
        (want, "meta", "cpu", want)


def test_swap_tensors_keeps_what_is_deferred() -> None:
    m = fxinit.trace_init(SubclassCheck)
    real = torch.randn(3)
    torch.utils.swap_tensors(m.w, real)  # as Module._apply does with swap_module_params_on_conversion
    assert type(real) is fxinit.DeferredTensor and fxinit.is_deferred(real)
    assert type(m.w) is torch.Tensor and not fxinit.is_deferred(m.w)


class BufferAlsoAttribute(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        f = torch.randn(4)
        self.register_buffer("a", f)
        self.kept = f


def test_state_dict_and_dtype_follow_module_to() -> None:
    sd = {"a": torch.arange(4.0)}
    eager = BufferAlsoAttribute()
    eager.load_state_dict(sd)
    eager.to(torch.bfloat16)
    m = fxinit.materialize(fxinit.trace_init(BufferAlsoAttribute), dtype=torch.bfloat16, state_dict=sd)
    assert (m.a.dtype, m.kept.dtype, m.a is m.kept) == (eager.a.dtype, eager.kept.dtype, eager.a is eager.kept)
    assert torch.equal(m.a, eager.a) and torch.equal(m.kept, eager.kept)


class TiedOn(nn.Module):
    """A tie made in the constructor, and a plain object holding a parameter (olmo-core's
    ``FP8WeightStore.anchor_param``), on ``device``."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 4, device=device)
        self.head = nn.Linear(4, 8, bias=False, device=device)
        self.head.weight = self.emb.weight
        self.w = MyParameter(torch.ones(3, device=device))
        self.w.flag = "set in the constructor"
        self.store = [self.w]


def _move_then_init(m: nn.Module, move: str) -> None:
    if move == "to_empty":
        m.to_empty(device="cpu")
    else:
        m.to(torch.device(move) if move in ("meta", "cpu") else getattr(torch, move))
    if move != "meta":
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in (m.emb.weight, m.head.weight, m.w):
                p.normal_(generator=g)


@pytest.mark.parametrize("built_on, move", [("meta", "to_empty"), ("cpu", "to_empty"), ("cpu", "meta"),
                                            ("meta", "float64"), ("cpu", "float64"), ("cpu", "cpu")])
def test_module_moves_keep_or_replace_parameter_objects_as_eager(built_on: str, move: str) -> None:
    """``Module._apply`` keeps a parameter object (``param.data = new``) only where torch says
    the two tensors' types are compatible: from meta to a real device or back they are not, and
    eager makes new parameters, breaking ties made before. A deferred tensor is meta underneath
    whatever it stands for, so fxinit kept the objects: the tie survived ``to_empty``, and the
    second init overwrote the first (found by an olmo-core sweep)."""
    results = []
    for traced in (False, True):
        torch.manual_seed(0)
        m = fxinit.trace_init(TiedOn, built_on) if traced else TiedOn(built_on)
        _move_then_init(m, move)
        if traced:
            fxinit.materialize(m)
        results.append((m.emb.weight is m.head.weight, m.store[0] is m.w, type(m.w).__name__,
                        getattr(m.w, "flag", None), str(m.w.device), str(m.store[0].device),
                        [p.detach().clone() for p in (m.emb.weight, m.head.weight, m.w)]))
    eager, traced = results
    assert traced[:6] == eager[:6]
    assert all(a.dtype == b.dtype and a.device == b.device and (a.is_meta or torch.equal(a, b))
               for a, b in zip(traced[6], eager[6]))


class ModuleToTensor(nn.Module):
    """vit-pytorch's ``NetWrapper._get_projector``: ``MLP(...).to(hidden)``, ``hidden`` deferred."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4, device="cpu", dtype=torch.float64).to(self.a.weight)
        self.c = nn.Linear(4, 4, device="cpu").to(tensor=self.a.bias, non_blocking=True)
        self.d = nn.Linear(4, 4)


@pytest.mark.parametrize("context", [None, "cuda"])
def test_module_to_a_deferred_tensor_takes_its_device_and_dtype(context: str | None) -> None:
    """``Module.to(t)`` reads ``t``'s device through ``torch._C._nn._parse_to``, which saw the
    meta tensor underneath: the module's tensors were moved to meta, and stayed meta after
    materialize (found by a sweep of lucidrains' libraries)."""
    def build(traced: bool) -> nn.Module:
        torch.manual_seed(0)
        m = fxinit.trace_init(ModuleToTensor) if traced else ModuleToTensor()
        m.d.to(m.a.weight)  # an init step after the trace
        return m

    if context == "cuda":  # recorded for the device eager would use, on a machine without it too
        with torch.device("cuda"):
            m = fxinit.trace_init(ModuleToTensor)
        assert {str(p.device) for p in m.parameters()} == {"cuda:0"}
        assert {p.dtype for p in m.parameters()} == {torch.float32}
        return
    eager, traced = build(False), build(True)
    fxinit.materialize(traced)
    for (name, got), want in zip(traced.named_parameters(), eager.parameters()):
        assert (got.device, got.dtype) == (want.device, want.dtype) and torch.equal(got, want), name


def _real_to_deferred(m: nn.Module) -> list[torch.Tensor]:
    """gpytorch's ``Kernel._set_lengthscale``: ``torch.as_tensor(value).to(self.raw_lengthscale)``."""
    w = m.a.weight
    return [torch.as_tensor(0.5).to(w), torch.arange(3, dtype=torch.float64).to(w, copy=True),
            torch.Tensor.to(torch.ones(2, dtype=torch.int64), w), torch.ones(2).to(tensor=w, non_blocking=True)]


def test_a_real_tensor_moved_like_a_deferred_one_takes_its_device_and_dtype() -> None:
    """``real.to(t)`` after the trace read the meta tensor underneath ``t``: a plain meta tensor,
    whose value no one has (found by a gpytorch sweep: ``kernel.lengthscale = 0.5``)."""
    m = fxinit.trace_init(ModuleToTensor)
    for got, want in zip(_real_to_deferred(m), _real_to_deferred(ModuleToTensor())):
        assert not fxinit.is_deferred(got) and (got.device, got.dtype) == (want.device, want.dtype)
        assert torch.equal(got, want) and (got.item() if got.numel() == 1 else True)
    with torch.device("cuda"):
        m = fxinit.trace_init(ModuleToTensor)
    moved = _real_to_deferred(m)  # a graph constant copied there, where this machine lacks the device
    assert {(str(t.device), t.dtype) for t in moved} == {("cuda:0", torch.float32)}
    assert torch.cuda.is_available() or all(fxinit.is_deferred(t) for t in moved)
    nhwc = torch.randn(2, 3, 4, 4).to(m.a.weight, memory_format=torch.channels_last)
    assert nhwc.stride() == (48, 1, 12, 3)  # eager's layout, on the device this machine lacks too
