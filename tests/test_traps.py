"""The PyTorch traps of DESIGN.md (and a few more), each against eager construction bit for bit."""

from __future__ import annotations

import copy
import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrizations as P

import fxinit
from conftest import (
    assert_bits,
    assert_modules_equal,
    assert_same_as_eager,
    default_dtype,
    rng_state,
    same_bits,
)


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    n = math.prod(shape)
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.37).sin().to(dtype)


# ----------------------------------------------------------------------------- tying, sharing, views
class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 4, padding_idx=0)
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)  # draws its own kaiming_uniform_ first
        self.head.weight = self.emb.weight
        self.after = nn.Parameter(torch.randn(3))  # stream position after the tie


class SharedSubmodule(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = self.a
        self.layers = nn.ModuleList([self.a, nn.Linear(3, 3), self.a])
        self.norm = nn.LayerNorm(3)


class ParamViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        base = torch.randn(4, 6)
        self.p = nn.Parameter(base[1:3])
        self.q = nn.Parameter(base[3:, ::2])  # a non-contiguous view of the same storage
        self.register_buffer("whole", base)
        self.t = nn.Parameter(torch.randn(5, 3).t())  # transposed layout


class BufferAliasesParam(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("w_row", self.w.data[1])  # a buffer viewing a parameter
        with torch.no_grad():
            self.w[1].fill_(2.0)  # visible through the buffer too


class DataIndexWrites(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.w.data[0] = 1.0
        self.w.data[:, 1] = torch.arange(3.0)
        self.w.data[2, 2:] = torch.tensor([7.0, 8.0])
        self.register_buffer("mask", torch.ones(3, 3, dtype=torch.bool))
        self.mask[0, 1:] = False


class DataInplaceInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 5)
        self.a.weight.data.normal_(mean=0.0, std=0.02)
        self.a.bias.data.zero_()
        self.b = nn.Parameter(torch.empty(3, 3))
        self.b.data.uniform_(-0.1, 0.1)
        self.c = nn.Parameter(torch.empty(7))
        self.c.data.fill_(0.01)
        self.d = nn.Linear(3, 3)
        self.d.weight.data.copy_(torch.from_numpy(np.arange(9, dtype=np.float32).reshape(3, 3)))


class DataRebindDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(3, 4))
        self.w.data = self.w.data.to(torch.float64)
        self.v = nn.Parameter(torch.zeros(2))
        self.v.data = torch.randn(5, 2)  # new shape, new storage
        self.lin = nn.Linear(3, 3)
        self.lin.weight.data = self.lin.weight.data.t().contiguous().to(torch.bfloat16)


class NoGradBlocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 4))
        with torch.no_grad():
            self.w.mul_(0.5)
            self.w.add_(torch.eye(4))
            self.w.clamp_(-1.0, 1.0)
        self.s = nn.Parameter(torch.ones(4))
        with torch.no_grad():
            self.s.copy_(self.w.diagonal())


class InplaceThroughViews(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(4, 6))
        with torch.no_grad():
            self.w[0].fill_(1)
            self.w.view(-1)[::2].zero_()
            self.w[:, -1].normal_()  # a random fill of a non-contiguous view
            self.w.t()[1].mul_(3)
        self.u = nn.Parameter(torch.empty(3, 8))
        nn.init.normal_(self.u[:, :5])  # nn.init on a non-contiguous view
        nn.init.uniform_(self.u[:, 5:])


# ----------------------------------------------------------------------------- computed buffers
class Rotary(nn.Module):
    def __init__(self, dim: int = 8, max_pos: int = 16, base: float = 10000.0) -> None:
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        t = torch.arange(max_pos, dtype=inv_freq.dtype)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cached", emb.cos(), persistent=False)
        self.register_buffer("sin_cached", emb.sin(), persistent=False)


class CausalAndPositions(nn.Module):
    def __init__(self, n: int = 6) -> None:
        super().__init__()
        self.register_buffer("bias", torch.tril(torch.ones(n, n)).view(1, 1, n, n))
        self.register_buffer("mask", torch.tril(torch.ones(n, n, dtype=torch.bool)))
        self.register_buffer("position_ids", torch.arange(n).expand((1, -1)), persistent=False)
        self.register_buffer("neg", torch.full((n, n), float("-inf")).triu(1))
        slopes = [2 ** (-8 * (i + 1) / 4) for i in range(4)]
        self.register_buffer("alibi", torch.tensor(slopes).unsqueeze(-1) * torch.arange(n))
        self.register_buffer("token_type_ids", torch.zeros(self.position_ids.size(), dtype=torch.long), persistent=False)


class DropPathSchedule(nn.Module):
    """Vision models: Python floats read off a constant tensor during construction."""

    def __init__(self, depth: int = 4) -> None:
        super().__init__()
        dpr = [x.item() for x in torch.linspace(0, 0.1, depth)]
        dpr2 = torch.linspace(0, 0.2, depth).tolist()
        self.blocks = nn.ModuleList([nn.Linear(3, 3) for _ in range(depth)])
        self.register_buffer("rates", torch.tensor(dpr) + torch.tensor(dpr2))
        n = int(torch.tensor(depth).sum())
        self.extra = nn.Parameter(torch.randn(n))
        if torch.arange(3).sum() > 2:  # Python control flow on a constant tensor
            self.flag = nn.Parameter(torch.ones(2))


class ReadsWrittenValues(nn.Module):
    """Values read in Python, then written, then read again: each read sees the current
    value (a mid-size constant computed on first read and kept; a random one likewise)."""

    def __init__(self) -> None:
        super().__init__()
        x = torch.arange(10000, dtype=torch.float32)
        first, again = x[7].item(), x[9].item()
        x.mul_(2)
        x[9] = -1.0
        w = torch.empty(5000).uniform_()
        drawn = w[3].item()
        w.normal_()
        self.register_buffer("reads", torch.tensor([first, again, x[7].item(), x[9].item(), drawn, w[3].item()]))
        self.register_buffer("x", x)
        self.w = nn.Parameter(w)


class NumpyConstants(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        arr = np.array([[1.5, 2.0], [3.25, -4.0]], dtype=np.float32)
        self.register_buffer("a", torch.from_numpy(arr))
        self.register_buffer("b", torch.tensor([1.0, 2.0, 3.0]))
        self.register_buffer("c", torch.as_tensor(np.arange(6).reshape(2, 3)))
        self.register_buffer("d", torch.tensor(np.float64(0.1)))
        self.register_buffer("e", torch.asarray([[1, 2], [3, 4]], dtype=torch.int32))
        self.register_buffer("f", torch.tensor([True, False, True]))
        self.w = nn.Parameter(torch.randn(2, 2) + torch.from_numpy(arr))
        self.v = nn.Parameter(torch.as_tensor([0.5, 0.25], dtype=torch.float64))
        self.n = nn.Parameter(self.w.new_tensor([[9.0, 8.0]]))


class SinusoidalTable(nn.Module):
    """transformers' Marian/Pegasus positions: numpy tables written into slices of a fresh tensor."""

    def __init__(self, n_pos: int = 6, dim: int = 4) -> None:
        super().__init__()
        enc = np.array([[pos / np.power(10000, 2 * (j // 2) / dim) for j in range(dim)] for pos in range(n_pos)])
        out = torch.empty(n_pos, dim, requires_grad=False)
        out[:, : dim // 2] = torch.FloatTensor(np.sin(enc[:, 0::2]))
        out[:, dim // 2 :] = torch.FloatTensor(np.cos(enc[:, 1::2]))
        self.weight = nn.Parameter(out, requires_grad=False)


# ----------------------------------------------------------------------------- dtypes, devices
class ExplicitDeviceDtype(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3, device="cpu", dtype=torch.float64)
        self.register_buffer("z", torch.zeros(3, device="cpu"))
        self.register_buffer("r", torch.randn(3, dtype=torch.float64, device=torch.device("cpu")))
        self.register_buffer("ar", torch.arange(4, device="cpu", dtype=torch.int16))
        self.p = nn.Parameter(torch.rand(2, 2, device="cpu").to("cpu"))


class CastsInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3).to(torch.bfloat16)
        self.b = nn.Linear(3, 3).double()
        self.c = nn.Linear(3, 3).half().float()
        self.d = nn.Conv2d(2, 2, 2).to(memory_format=torch.channels_last)
        self.e = nn.Linear(3, 3).to("cpu")
        self.register_buffer("buf", torch.randn(3).to(torch.bfloat16))


class CastsWholeSelf(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.n = nn.LayerNorm(3)
        self.register_buffer("ids", torch.arange(3))
        self.to(torch.float64)


class SetsDefaultDtypeInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        saved = torch.get_default_dtype()
        torch.set_default_dtype(torch.float64)
        try:
            self.a = nn.Linear(3, 3)
            self.register_buffer("r", torch.arange(0, 4, 2) / 3)
        finally:
            torch.set_default_dtype(saved)
        self.b = nn.Linear(3, 3)


def _under_default_dtype(dtype):
    def factory():
        with default_dtype(dtype):
            return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), Rotary(), nn.Embedding(5, 3))

    return factory


# ----------------------------------------------------------------------------- RNG inside __init__
class SeedsInInit(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 3)
        torch.manual_seed(123)
        self.a = nn.Linear(3, 3)
        torch.manual_seed(123)
        self.b = nn.Linear(3, 3)  # equals a in eager
        self.c = nn.Parameter(torch.randn(4))


class RestoresRngState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        state = torch.get_rng_state()
        self.a = nn.Parameter(torch.randn(4))
        torch.set_rng_state(state)
        self.b = nn.Parameter(torch.randn(4))  # equals a in eager
        with torch.random.fork_rng():
            torch.manual_seed(5)
            self.c = nn.Parameter(torch.rand(3))
        self.d = nn.Parameter(torch.rand(3))


class KeepsGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.g = torch.Generator().manual_seed(0)
        self.w = nn.Parameter(torch.empty(4, 5))
        with torch.no_grad():
            self.w.normal_(generator=self.g)
        self.v = nn.Parameter(torch.empty(3))
        nn.init.uniform_(self.v, generator=self.g)
        self.u = nn.Parameter(torch.randn(3))  # global generator in between
        self.register_buffer("noise", torch.randn(6, generator=self.g))


class RandomFactories(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("randn", torch.randn(3, 5))
        self.register_buffer("rand", torch.rand(17))
        self.register_buffer("perm", torch.randperm(10))
        self.register_buffer("ints", torch.randint(0, 10, (3, 4)))
        self.register_buffer("ints_low", torch.randint(5, (6,), dtype=torch.int32))
        self.register_buffer("normal", torch.normal(0.0, 1.0, size=(3,)))
        self.register_buffer("bern", torch.bernoulli(torch.full((5,), 0.5)))
        self.register_buffer("expo", torch.empty(4).exponential_())
        self.register_buffer("rnd", torch.empty(4, dtype=torch.int64).random_(0, 100))
        self.register_buffer("cauchy", torch.empty(3).cauchy_())
        self.register_buffer("lognorm", torch.empty(3).log_normal_())
        self.register_buffer("geom", torch.empty(3).geometric_(0.3))
        self.register_buffer("multi", torch.multinomial(torch.ones(6), 3))
        self.register_buffer("randn_like", torch.randn_like(self.randn))
        self.register_buffer("rand_f64", torch.rand(5, dtype=torch.float64))
        self.p = nn.Parameter(torch.randn(3, 4) * 0.02)
        self.q = nn.Parameter(torch.rand(2, 2) - 0.5, requires_grad=False)
        self.drop = nn.Dropout(0.5)
        self.register_buffer("dropped", F.dropout(torch.ones(20), 0.5, training=True))


# ----------------------------------------------------------------------------- parametrizations, RNN
def _weight_norm():
    return P.weight_norm(nn.Linear(4, 3))


def _spectral_norm():
    return P.spectral_norm(nn.Linear(5, 4))


def _spectral_norm_conv():
    return P.spectral_norm(nn.Conv2d(2, 3, 2), n_power_iterations=2)


def _orthogonal_square():
    return P.orthogonal(nn.Linear(4, 4))


def _orthogonal_householder():
    return P.orthogonal(nn.Linear(3, 5))


def _old_weight_norm():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.nn.utils.weight_norm(nn.Linear(4, 3))


def _old_spectral_norm():
    return torch.nn.utils.spectral_norm(nn.Linear(5, 4))


class WithRNN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(7, 3)
        self.rnn = nn.LSTM(3, 4, num_layers=2, batch_first=True)
        for name, p in self.rnn.named_parameters():
            if "weight_hh" in name:
                nn.init.orthogonal_(p)
            elif "bias" in name:
                nn.init.zeros_(p)
                p.data[4:8].fill_(1.0)  # forget-gate bias
        self.head = nn.Linear(4, 7)

    def forward(self, x):
        return self.head(self.rnn(self.emb(x))[0])


class ClonesAndDetaches(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Parameter(torch.randn(3, 3))
        self.b = nn.Parameter(self.a.detach().clone())
        self.c = copy.deepcopy(self.a)
        self.register_buffer("d", self.a.data.clone().mul_(2))
        self.frozen = nn.Parameter(torch.randn(2), requires_grad=False)
        self.lin = nn.Linear(2, 2)
        self.lin.weight.requires_grad_(False)


class ReInitTwice(nn.Module):
    """transformers draws each Linear weight twice (default init, then _init_weights)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])
        self.norm = nn.LayerNorm(4)
        self.apply(self._init_weights)

    def _init_weights(self, m):
        if isinstance(m, nn.Linear):
            m.weight.data.normal_(mean=0.0, std=0.02)
            if m.bias is not None:
                m.bias.data.zero_()
        elif isinstance(m, nn.LayerNorm):
            m.bias.data.zero_()
            m.weight.data.fill_(1.0)


class InplaceViewOps(nn.Module):
    """``t_()``, ``unsqueeze_()``, ``transpose_()`` make the same tensor object another view."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.empty(4, 6)
        nn.init.kaiming_uniform_(w)
        w.t_()
        self.w = nn.Parameter(w)  # detached after the view changed
        b = torch.randn(6)
        b.unsqueeze_(0)
        self.register_buffer("b", b)
        c = torch.empty(2, 3, 4).normal_()
        c.transpose_(0, 2)
        c.mul_(2.0)
        self.register_buffer("c", c)
        d = torch.empty(3, 5).uniform_()
        d.t_()
        self.d = nn.Parameter(d)  # a tensor object of its own, keeping this view
        d.t_()
        d.unsqueeze_(0)
        self.register_buffer("e", d)  # the same storage, the view d ends with


class RegisteredViewOfBuffer(nn.Module):
    """A buffer and a view of it both registered; a view taken before ``t_()`` written after."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.empty(4, 4).normal_()
        x = w[1:3]
        w.t_()
        x.mul_(2.0)
        self.register_buffer("w", w)
        self.register_buffer("x", x)
        self.p = nn.Parameter(torch.randn(3, 4))
        self.register_buffer("row", self.p.data[1])


TRAP_CASES = [
    ("weight_tying", TiedLM, None),
    ("submodule_under_two_names", SharedSubmodule, lambda m: m.layers[2](_x(2, 3))),
    ("parameters_that_are_views", ParamViews, None),
    ("buffer_aliases_parameter", BufferAliasesParam, None),
    ("embedding_padding_idx", lambda: nn.Embedding(8, 3, padding_idx=3), None),
    ("param_data_index_writes", DataIndexWrites, None),
    ("param_data_inplace_init", DataInplaceInit, None),
    ("param_data_rebind_dtype", DataRebindDtype, None),
    ("no_grad_blocks", NoGradBlocks, None),
    ("inplace_through_views", InplaceThroughViews, None),
    ("inplace_view_ops", InplaceViewOps, None),
    ("registered_view_of_a_buffer", RegisteredViewOfBuffer, None),
    ("rope_inv_freq", Rotary, None),
    ("causal_mask_position_ids", CausalAndPositions, None),
    ("drop_path_schedule_item_tolist", DropPathSchedule, None),
    ("values_read_written_read_again", ReadsWrittenValues, None),
    ("numpy_and_python_constants", NumpyConstants, None),
    ("sinusoidal_table_from_numpy", SinusoidalTable, None),
    ("explicit_device_dtype", ExplicitDeviceDtype, None),
    ("casts_in_init", CastsInInit, lambda m: m.d(_x(1, 2, 3, 3).to(memory_format=torch.channels_last))),
    ("self_to_float64_in_init", CastsWholeSelf, None),
    ("set_default_dtype_inside_init", SetsDefaultDtypeInside, None),
    ("default_dtype_float64_around", _under_default_dtype(torch.float64), None),
    ("default_dtype_bfloat16_around", _under_default_dtype(torch.bfloat16), None),
    ("manual_seed_twice_in_init", SeedsInInit, None),
    ("set_rng_state_and_fork_rng_in_init", RestoresRngState, None),
    ("generator_kept_as_attribute", KeepsGenerator, None),
    ("random_factories", RandomFactories, None),
    ("weight_norm", _weight_norm, lambda m: (m.weight, m(_x(2, 4)))),
    ("spectral_norm", _spectral_norm, lambda m: (m.eval().weight, m(_x(2, 5)))),
    ("spectral_norm_conv", _spectral_norm_conv, lambda m: m.eval()(_x(1, 2, 3, 3))),
    ("orthogonal_matrix_exp", _orthogonal_square, lambda m: (m.weight, m(_x(2, 4)))),
    ("orthogonal_householder", _orthogonal_householder, lambda m: (m.weight, m(_x(2, 3)))),
    ("old_weight_norm", _old_weight_norm, lambda m: m(_x(2, 4))),
    ("old_spectral_norm", _old_spectral_norm, lambda m: m.eval()(_x(2, 5))),
    ("rnn_flat_weights_custom_init", WithRNN, lambda m: m(torch.tensor([[1, 2, 3], [4, 5, 6]]))),
    ("clones_detaches_frozen", ClonesAndDetaches, None),
    ("reinit_in_init_weights", ReInitTwice, None),
]


@pytest.mark.parametrize("factory,forward", [pytest.param(f, fw, id=i) for i, f, fw in TRAP_CASES])
def test_trap_equals_eager(factory, forward) -> None:
    assert_same_as_eager(factory, forward=forward)


def test_seeds_in_init_make_equal_layers_and_leave_rng_like_eager() -> None:
    torch.manual_seed(0)
    m = fxinit.trace_init(SeedsInInit)
    after_trace = rng_state()
    torch.manual_seed(0)
    ref = SeedsInInit()
    assert torch.equal(after_trace, rng_state())
    fxinit.materialize(m.b)
    fxinit.materialize(m.a)
    assert same_bits(m.a.weight, m.b.weight)  # as in eager: both drawn right after manual_seed(123)
    assert_bits(m.b.weight, ref.b.weight, "b.weight")


def test_default_dtype_around_trace_but_not_around_materialize() -> None:
    for dtype in (torch.float64, torch.bfloat16):
        with default_dtype(dtype):
            torch.manual_seed(0)
            ref = nn.Sequential(nn.Linear(4, 3), Rotary(), nn.Embedding(5, 3))
            torch.manual_seed(0)
            m = fxinit.trace_init(lambda: nn.Sequential(nn.Linear(4, 3), Rotary(), nn.Embedding(5, 3)))
        assert torch.get_default_dtype() == torch.float32
        fxinit.materialize(m)
        assert_modules_equal(m, ref)


class MetaSkeletonThenReal(nn.Module):
    """Small modules built on meta (as ``from_pretrained`` builds its skeleton), then real ones:
    eager's meta init draws nothing, so the real layers see the generator untouched."""

    def __init__(self) -> None:
        super().__init__()
        self.skeleton = nn.Linear(4, 4, device="meta")
        with torch.device("meta"):
            self.table = nn.Embedding(16, 4)
            self.register_buffer("scaled", torch.ones(8).uniform_().mul_(2))  # small: capture has its value
        self.real = nn.Linear(4, 4)
        self.register_buffer("noise", torch.randn(3))


def test_init_on_meta_inside_the_constructor_draws_nothing() -> None:
    torch.manual_seed(0)
    ref = MetaSkeletonThenReal()
    ref_state = torch.get_rng_state()
    torch.manual_seed(0)
    m = fxinit.trace_init(MetaSkeletonThenReal)
    assert torch.equal(torch.get_rng_state(), ref_state)
    fxinit.materialize(m)
    assert m.skeleton.weight.is_meta and m.table.weight.is_meta and m.scaled.is_meta
    got, want = m.state_dict(), ref.state_dict()
    for name in ("real.weight", "real.bias", "noise"):
        assert same_bits(got[name], want[name]), name


def _mixes_real_and_deferred(loaded_g: torch.Tensor, loaded_bias: nn.Parameter) -> nn.Module:
    m = nn.Module()
    m.v = nn.Parameter(torch.randn(4, 3))
    m.register_buffer("w", torch._weight_norm(m.v.detach(), loaded_g, 0))  # checks devices before dispatch
    m.bias = loaded_bias
    m.bias.data = F.pad(m.bias.data, (0, 2))  # as transformers' tie_weights adjusts a loaded bias
    m.after = nn.Parameter(torch.randn(2))
    return m


def test_real_tensors_from_outside_meet_deferred_ones() -> None:
    """What ``from_pretrained`` does under trace_init: loaded (real) tensors meet deferred ones."""
    torch.manual_seed(0)
    ref = _mixes_real_and_deferred(torch.full((4, 1), 2.0), nn.Parameter(torch.ones(3)))
    torch.manual_seed(0)
    bias = nn.Parameter(torch.ones(3))
    m = fxinit.trace_init(_mixes_real_and_deferred, torch.full((4, 1), 2.0), bias)
    assert m.bias is bias and not fxinit.is_deferred(m.bias) and torch.equal(m.bias, ref.bias)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)


def test_unregistered_tensor_attribute() -> None:
    """A tensor kept as a plain attribute (not a parameter or buffer) is used by forward."""

    class Scaled(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.scale = torch.tensor(0.5)
            self.table = torch.arange(6).reshape(2, 3).float()

        def forward(self, x):
            return self.lin(x) * self.scale + self.table[0]

    torch.manual_seed(0)
    ref = Scaled()
    torch.manual_seed(0)
    m = fxinit.trace_init(Scaled)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)
    for name in ("scale", "table"):
        assert not fxinit.is_deferred(getattr(m, name)), f"plain tensor attribute {name!r} is still deferred after materialize(m)"
        assert_bits(getattr(m, name), getattr(ref, name), name)
    assert same_bits(m(_x(2, 3)), ref(_x(2, 3)))


def test_tie_made_after_trace() -> None:
    def post(m):
        m[1].weight = m[0].weight

    assert_same_as_eager(lambda: nn.Sequential(nn.Embedding(6, 4), nn.Linear(4, 6, bias=False)), post=post)


def test_random_buffers_are_not_all_equal_across_seeds() -> None:
    """Guards the oracle itself: different seeds must give different eager values here."""
    torch.manual_seed(0)
    a = RandomFactories()
    torch.manual_seed(1)
    b = RandomFactories()
    assert not same_bits(a.randn, b.randn)
