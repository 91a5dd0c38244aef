"""Portable mode: values are a function of (seed, tensor name, element index) only, and
follow the distributions of the eager init functions (fixed statistical tolerances)."""

from __future__ import annotations

import math
import platform
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxinit
from fxinit import execute
from fxinit.backends.interpreter import Interpreter
from fxinit.numerics import Settings
from fxinit.backends.streams import PortableSampler
from fxinit.rng import portable

N = 1 << 20  # elements per statistical check


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)


def _tensors(m: nn.Module) -> dict[str, torch.Tensor]:
    return dict(m.named_parameters(remove_duplicate=False)) | dict(m.named_buffers(remove_duplicate=False))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 16, padding_idx=0)
        self.layers = nn.ModuleList(nn.Linear(16, 16) for _ in range(3))
        self.q = nn.Linear(16, 16, bias=False)
        nn.init.orthogonal_(self.q.weight)
        self.t = nn.Linear(16, 8)
        nn.init.trunc_normal_(self.t.weight, std=0.02)
        self.register_buffer("noise", torch.rand(4, 4))


def test_order_subset_threads_and_seed() -> None:
    torch.manual_seed(7)
    g = fxinit.init_graph(fxinit.trace_init(Net))
    full = g.materialize(rng="portable")
    assert g.seed == 7
    one = g.materialize(["layers.2.weight"], rng="portable")
    assert torch.equal(one["layers.2.weight"], full["layers.2.weight"])
    plan = g.plan(rng="portable")
    assert plan.seed == 7 and set(plan.streams) == {n for n in plan.nodes if n.meta.get("generators")}
    serial = Interpreter(plan, g.constants, PortableSampler(7, plan.streams), Settings(g.default_dtype, g.numerics)).run()
    threaded = execute.run(g, plan, workers=4)
    for node in plan.keep:
        assert torch.equal(serial[node], threaded[node])
    other = g.materialize(rng="portable", seed=8)
    assert not torch.equal(other["layers.0.weight"], full["layers.0.weight"])
    assert torch.equal(full["emb.weight"][0], torch.zeros(16))  # padding row still zeroed after the draw

    torch.manual_seed(123)  # a different global state: portable values do not care
    m = fxinit.trace_init(Net)
    fxinit.materialize(m.layers[1], rng="portable", seed=7)
    for layer in reversed(m.layers):
        fxinit.materialize(layer, rng="portable", seed=7)
    fxinit.materialize(m, rng="portable", seed=7)
    for k, v in _tensors(m).items():
        assert torch.equal(v, full[k]), k


class Neighbours(nn.Module):
    def __init__(self, extra: bool) -> None:
        super().__init__()
        if extra:
            self.first = nn.Linear(32, 32).double()  # a neighbour added, in another dtype
        self.fc = nn.Linear(16, 16)


def test_values_do_not_depend_on_neighbours() -> None:
    torch.manual_seed(0)
    a = fxinit.init_graph(fxinit.trace_init(Neighbours, False)).materialize(rng="portable", seed=1)
    b = fxinit.init_graph(fxinit.trace_init(Neighbours, True)).materialize(rng="portable", seed=1)
    assert torch.equal(a["fc.weight"], b["fc.weight"]) and torch.equal(a["fc.bias"], b["fc.bias"])


def test_shards_compute_the_same_elements() -> None:
    """A piece of a fill from any element on (odd ones too: the second of a Box-Muller pair)
    equals that piece of the whole fill."""
    s = portable.stream_key(3, "w")
    for kind, params in (("uniform", dict(low=-1.0, high=1.0)), ("normal", dict(mean=0.0, std=1.0))):
        for dtype in (torch.float32, torch.bfloat16):
            whole = portable.sample(kind, s, 0, 1000, dtype, "cpu", **params)
            for lo, hi in ((600, 1000), (601, 1000), (601, 620), (7, 8), (0, 999)):
                part = portable.sample(kind, s, lo, hi - lo, dtype, "cpu", **params)
                assert torch.equal(whole[lo:hi], part), (kind, dtype, lo, hi)


def _documented_units(stream: int, start: int, n: int) -> torch.Tensor:
    """Element i's 24-bit unit as the module docstring defines it, from ``portable.words``:
    bits 8..31 of word i // 2 for even i, bits 40..63 for odd i."""
    i = torch.arange(start, start + n)
    w = portable.words(stream, 0, (start + n + 1) // 2)[i // 2]
    return torch.where(i % 2 == 0, (w >> 8) & 0xFFFFFF, (w >> 40) & 0xFFFFFF)


def test_samples_follow_the_documented_definition() -> None:
    """uniform(0, 1) is each element's unit / 2^24 exactly; normal(0, 1) is Box-Muller of each
    pair's units, r cos t for the even element and r sin t for the odd one, with
    r = sqrt(-2 log(1 - u_odd)) and t = 2 pi u_even (within float32 rounding of float64 math)."""
    s = portable.stream_key(11, "definition")
    start, n = 1001, 20001  # odd: the first element is the second of its pair
    units = _documented_units(s, start, n).double() / (1 << 24)
    u = portable.sample("uniform", s, start, n, torch.float32, "cpu", low=0.0, high=1.0)
    assert torch.equal(u.double(), units)

    z = portable.sample("normal", s, start, n, torch.float32, "cpu", mean=0.0, std=1.0).double()
    pairs = _documented_units(s, start - 1, n + 1).double().view(-1, 2) / (1 << 24)  # the pairs it covers
    r, t = torch.sqrt(-2 * torch.log1p(-pairs[:, 1])), 2 * math.pi * pairs[:, 0]
    ref = torch.stack([r * torch.cos(t), r * torch.sin(t)], 1).view(-1)[1:n + 1]
    assert (z - ref).abs().max() < 1e-6


def test_c_kernel_and_torch_ops_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused C samplers and the torch-op path (CUDA, or no compiler) agree bit for bit,
    with parameters that float32 cannot hold exactly."""
    from fxinit.rng import native

    s = portable.stream_key(5, "x")
    for dtype in (torch.float32, torch.float64, torch.bfloat16):
        for kind, params in (("uniform", dict(low=-0.0315, high=0.0315)), ("normal", dict(mean=0.1, std=0.02)),
                             ("normal", dict(mean=0.0, std=1.0)), ("exponential", dict(lambd=3.0)),
                             ("log_normal", dict(mean=0.0, std=0.5))):
            native.portable_library.cache_clear()
            fast = portable.fill_(torch.empty(3 * portable.CHUNK + 5, dtype=dtype), kind, s, **params)
            monkeypatch.setenv("FXINIT_NO_NATIVE", "1")
            native.portable_library.cache_clear()
            slow = portable.fill_(torch.empty(3 * portable.CHUNK + 5, dtype=dtype), kind, s, **params)
            monkeypatch.delenv("FXINIT_NO_NATIVE")
            assert torch.equal(fast, slow), (dtype, kind, params)
    native.portable_library.cache_clear()
    assert native.portable_library() is not None


def test_fills_batched_in_one_c_call_give_each_fills_values() -> None:
    """``fill_batch`` (``passes.batched_fills`` on the CPU): each job its own stream, kind,
    scale and shift, float32 and bfloat16, odd sizes; it stops at the first job it cannot
    run (float64), which the caller then runs alone."""
    if portable.portable_library() is None:
        pytest.fail("fxinit's C kernel did not build here (a C compiler is part of the setup)")
    jobs, wants = [], []
    for k, (kind, dtype, n) in enumerate([("normal", torch.float32, 1), ("uniform", torch.bfloat16, 7),
                                          ("normal", torch.bfloat16, 4097), ("uniform", torch.float32, 64),
                                          ("normal", torch.float64, 8), ("normal", torch.float32, 8)]):
        stream = portable.stream_key(5, f"w{k}/0")
        jobs.append((torch.full((n,), float("nan"), dtype=dtype), kind, stream, 0.5 + k, -0.25 * k))
        params = {"mean": -0.25 * k, "std": 0.5 + k} if kind == "normal" else {"low": -0.25 * k, "high": 0.5 + 0.75 * k}
        wants.append(portable.sample(kind, stream, 0, n, dtype, "cpu", **params))
    assert portable.fill_batch(jobs) == 4
    for (out, *_), want in zip(jobs[:4], wants):
        assert torch.equal(out.view(torch.int16 if out.element_size() == 2 else torch.int32),
                           want.view(torch.int16 if want.element_size() == 2 else torch.int32))
    assert jobs[4][0].isnan().all() and jobs[5][0].isnan().all()


def test_pairwise_torch_ops_compute_each_elements_definition() -> None:
    """``range24`` (one word, radius, cos and sin per pair: what a GPU without a compiler runs)
    gives ``sample24``'s bits (each element on its own), at any start and length."""
    for kind in ("uniform", "normal"):
        for stream in (portable.stream_key(2, "y"), -1, 0):
            for start, n in ((0, 1), (1, 1), (1, 2), (2, 3), (7, 4099), (2**33 + 1, 1000)):
                want = portable.sample24(kind, torch.arange(start, start + n), stream)
                got = portable.range24(kind, stream, start, n, "cpu")
                assert torch.equal(_bits(want), _bits(got)), (kind, stream, start, n)


def _cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    return set(next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), []))


def test_every_build_and_the_scalar_path_give_the_same_bits(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused sampler picked for this CPU (a target clone), one-target builds for every
    instruction set this CPU runs (x86-64 baseline, AVX2, AVX-512), and the kernel's scalar
    path (one element per call) agree bit for bit with the torch-op twin, from odd and even
    starts: no contraction, no reassociation, no conditional that a vector ISA evaluates
    differently."""
    import ctypes

    from fxinit.rng import native

    builds = {"cloned": native.portable_library()}
    isas = {"baseline": ()}
    if platform.machine() in ("x86_64", "AMD64"):
        cpu = _cpu_flags()
        if "avx2" in cpu:
            isas["avx2"] = ("-mavx2",)
        if {"avx512f", "avx512bw", "avx512dq", "avx512vl"} <= cpu:
            isas["avx512"] = ("-march=x86-64-v4",)
    for name, extra in isas.items():
        flags = (*native.FLAGS, native.NO_CLONES, *extra)
        builds[name] = ctypes.CDLL(str(native.build(native.PORTABLE_SOURCE, flags)))
    stream, n = portable.stream_key(9, "builds"), 3000 + 37

    def fill(lib: ctypes.CDLL, out: torch.Tensor, kind: int, code: int, start: int, scale: float, shift: float) -> None:
        lib.fxinit_portable_fill(ctypes.c_void_p(out.data_ptr()), kind, code, ctypes.c_int64(out.numel()),
                                 ctypes.c_int64(start), ctypes.c_uint64(stream & ((1 << 64) - 1)),
                                 ctypes.c_double(scale), ctypes.c_double(shift))

    for dtype, code in ((torch.float32, 0), (torch.bfloat16, 1)):
        for kind, name, params in ((0, "uniform", dict(low=-0.0315, high=0.0315)),
                                   (1, "normal", dict(mean=0.1, std=0.02))):
            scale, shift = portable._AFFINE[name](params)
            for start in (12345, 12346):
                twin = _twin(monkeypatch, name, stream, start, n, dtype, **params)
                for label, lib in builds.items():
                    out = torch.empty(n, dtype=dtype)
                    fill(lib, out, kind, code, start, scale, shift)
                    assert torch.equal(out, twin), (label, dtype, name, start)
                scalar = torch.empty(300, dtype=dtype)  # one element per call: the kernel's edge code
                for k in range(300):
                    fill(builds["cloned"], scalar[k:k + 1], kind, code, start + k, scale, shift)
                assert torch.equal(scalar, twin[:300]), ("scalar", dtype, name, start)


def _twin(monkeypatch: pytest.MonkeyPatch, kind: str, stream: int, start: int, n: int, dtype: torch.dtype,
          **params: float) -> torch.Tensor:
    """The torch-op samplers (what CUDA runs) for elements ``start .. start+n``."""
    from fxinit.rng import native

    with monkeypatch.context() as patch:
        patch.setenv("FXINIT_NO_NATIVE", "1")
        native.portable_library.cache_clear()
        values = portable.sample(kind, stream, start, n, dtype, "cpu", **params)
    native.portable_library.cache_clear()
    return values


def test_own_log_cos_and_sin_of_the_normal_sampler_are_accurate() -> None:
    """The float32 Box-Muller's log, cos and sin (fxinit's own, for bitwise portability)
    against float64 references, on every 5th input of their 2^24 and at both ends: within
    about one unit in the last place."""
    m = torch.cat([torch.arange(1, (1 << 24) + 1, 5, dtype=torch.int32), torch.tensor([1 << 24], dtype=torch.int32)])
    got, ref = portable._neg2log24(m).double(), -2 * torch.log(m.double() / (1 << 24))
    assert got[-1] == 0 and ((got - ref).abs() / ref.clamp(min=1e-30))[:-1].max() < 1e-7
    j = torch.cat([torch.arange(0, 1 << 24, 5, dtype=torch.int32), torch.tensor([(1 << 24) - 1], dtype=torch.int32)])
    angle = 2 * math.pi * j.double() / (1 << 24)
    assert (portable._cos2pi24(j).double() - torch.cos(angle)).abs().max() < 1.2e-7
    assert (portable._cos2pi24(j, 1).double() - torch.sin(angle)).abs().max() < 1.2e-7


def test_normal_follows_the_normal_cdf_and_pairs_are_independent() -> None:
    """The empirical CDF of 2^20 portable normals stays within 0.002 of Phi (a fixed-sample
    Kolmogorov-Smirnov bound; the 99.9% band for this many samples is 0.0019); the two values
    of a Box-Muller pair (which share their radius) are uncorrelated, and so are their squares."""
    z = portable.sample("normal", portable.stream_key(0, "cdf"), 0, N, torch.float32, "cpu", mean=0.0, std=1.0)
    pairs = z.double().view(-1, 2)
    for a, b in ((pairs[:, 0], pairs[:, 1]), (pairs[:, 0] ** 2, pairs[:, 1] ** 2)):
        assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 4 / math.sqrt(N / 2)  # 4 sigma
    z = z.double().sort().values
    phi = 0.5 * (1 + torch.erf(z / math.sqrt(2)))
    rank = torch.arange(1, N + 1, dtype=torch.float64) / N
    assert torch.maximum((phi - rank).abs(), (phi - (rank - 1 / N)).abs()).max() < 0.002


def test_artifact_round_trip_keeps_portable_values(tmp_path: Path) -> None:
    torch.manual_seed(2)
    g = fxinit.init_graph(fxinit.trace_init(Net))
    g.save(tmp_path / "n.pt")
    h = fxinit.load_graph(tmp_path / "n.pt")
    a, b = g.materialize(rng="portable"), h.materialize(rng="portable")
    assert all(torch.equal(a[k], b[k]) for k in a)


def _fill(init, shape=(N,), dtype=torch.float32) -> torch.Tensor:
    class One(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(shape, dtype=dtype))
            init(self.w)

    torch.manual_seed(0)
    return fxinit.init_graph(fxinit.trace_init(One)).materialize(rng="portable")["w"].detach().double()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_uniform_and_normal_statistics(dtype: torch.dtype) -> None:
    u = _fill(lambda w: nn.init.uniform_(w, -2.0, 3.0), dtype=dtype)
    assert u.min() >= -2.0 and u.max() <= 3.0
    assert abs(u.mean() - 0.5) < 0.01 and abs(u.var() / (25 / 12) - 1) < 0.01
    x = _fill(lambda w: nn.init.normal_(w, 1.0, 0.5), dtype=dtype)
    assert abs(x.mean() - 1.0) < 0.003 and abs(x.std() / 0.5 - 1) < 0.01
    assert abs(((x - 1) / 0.5).pow(4).mean() - 3) < 0.05  # normal kurtosis, not just two moments


def test_kaiming_trunc_normal_orthogonal_sparse() -> None:
    k = _fill(lambda w: nn.init.kaiming_uniform_(w, a=math.sqrt(5)), shape=(1024, 1024))
    bound = 1 / math.sqrt(1024)
    assert k.abs().max() <= bound and abs(k.std() / (bound / math.sqrt(3)) - 1) < 0.01

    t = _fill(lambda w: nn.init.trunc_normal_(w, std=0.02, a=-0.03, b=0.03))
    assert t.min() >= -0.03 and t.max() <= 0.03
    alpha = 1.5  # truncated at 1.5 sigma: variance factor 1 - 2*alpha*phi(alpha)/(2*Phi(alpha)-1)
    phi = math.exp(-alpha * alpha / 2) / math.sqrt(2 * math.pi)
    z = math.erf(alpha / math.sqrt(2))
    assert abs(t.std() / (0.02 * math.sqrt(1 - 2 * alpha * phi / z)) - 1) < 0.01

    q = _fill(lambda w: nn.init.orthogonal_(w, gain=2.0), shape=(64, 256))
    assert torch.allclose(q @ q.T, 4 * torch.eye(64, dtype=torch.float64), atol=1e-4)

    s = _fill(lambda w: nn.init.sparse_(w, sparsity=0.3), shape=(100, 40))
    assert ((s == 0).sum(0) == math.ceil(0.3 * 100)).all()
    assert abs(s[s != 0].std() / 0.01 - 1) < 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trunc_normal_is_made_of_operations_every_device_rounds_alike(dtype: torch.dtype,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """By rejection on the float32 normal stream (``normal24``, the ops CUDA runs): the C
    kernel and the torch-op twin give the same bits, each element depends on its index only
    (a chunk boundary cannot move a value), and the law is torch's truncated normal."""
    from fxinit.backends import streams

    def fill(shape: tuple[int, ...], *args: float, twin: bool = False, chunk: int = portable.CHUNK) -> torch.Tensor:
        with monkeypatch.context() as patch:
            patch.setattr(portable, "CHUNK", chunk)
            if twin:
                patch.setattr(portable, "portable_library", lambda: None)
            t = torch.empty(shape, dtype=dtype)
            streams._trunc_normal(t, portable.stream_key(5, "vit.pos_embed/0"), *args)
            return t

    args = (0.0, 0.02, -0.03, 0.03)  # 1.5 sigma: about one draw in seven redrawn, some twice or more
    whole = fill((700, 301), *args)
    assert torch.equal(whole, fill((700, 301), *args, twin=True))
    assert torch.equal(whole, fill((700, 301), *args, chunk=4096 + 3))
    strided = torch.empty(301, 700, dtype=dtype).T  # a non-contiguous tensor: values in logical order
    streams._trunc_normal(strided, portable.stream_key(5, "vit.pos_embed/0"), *args)
    assert torch.equal(strided, whole)
    assert whole.min() >= -0.03 and whole.max() <= 0.03 + 2**-10
    eager = torch.empty(whole.shape, dtype=torch.float64)
    torch.nn.init.trunc_normal_(eager, *args)
    assert abs(whole.double().std() / eager.std() - 1) < 0.02 and abs(whole.double().mean()) < 3e-4
    far = fill((1000,), 0.0, 1.0, 3.0, 4.0)  # far in a tail: inverse CDF (float64 ndtri), inside too
    assert far.min() >= 3.0 and far.max() <= 4.0
    u = 2.0 ** -23  # bounds inside one float32 step of the mean, on the side it never rounds to
    narrow = fill((64,), 1 + 0.49 * u, 0.02 * u, 1 + 0.51 * u, 1 + 0.9 * u)  # rejection gives up, in time
    assert narrow.double().min() >= 1 + 0.51 * u - u and narrow.double().max() <= 1 + 2 * u


def test_other_samplers() -> None:
    b = _fill(lambda w: w.data.bernoulli_(0.3))
    assert set(b.unique().tolist()) == {0.0, 1.0} and abs(b.mean() - 0.3) < 0.003
    e = _fill(lambda w: w.data.exponential_(2.0))
    assert e.min() >= 0 and abs(e.mean() / 0.5 - 1) < 0.01
    r = _fill(lambda w: w.data.random_(0, 10))
    counts = torch.bincount(r.long(), minlength=10).double() / N
    assert r.min() == 0 and r.max() == 9 and (counts - 0.1).abs().max() < 0.002

    class Perm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("p", torch.randperm(1000))

    torch.manual_seed(0)
    p = fxinit.init_graph(fxinit.trace_init(Perm)).materialize(rng="portable")["p"]
    assert torch.equal(p.sort().values, torch.arange(1000)) and not torch.equal(p, torch.arange(1000))


def test_cauchy_geometric_log_normal_statistics() -> None:
    s = portable.stream_key(0, "more samplers")
    c = portable.sample("cauchy", s, 0, N, torch.float64, "cpu", median=1.0, sigma=2.0)
    q1, q2, q3 = torch.quantile(c, torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)).tolist()
    assert abs(q2 - 1.0) < 0.01 and abs((q3 - q1) / 4.0 - 1) < 0.01  # quartiles at median -/+ sigma
    g = portable.sample("geometric", s, 0, N, torch.float64, "cpu", p=0.2)
    assert g.min() == 1 and torch.equal(g, g.round()) and abs(g.mean() / 5.0 - 1) < 0.01
    x = portable.sample("log_normal", s, 0, N, torch.float32, "cpu", mean=0.5, std=0.25).double().log()
    assert abs(x.mean() - 0.5) < 0.003 and abs(x.std() / 0.25 - 1) < 0.01


def test_factories_and_dirac() -> None:
    class Factories(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("i", torch.randint(3, 13, (N,)))
            base = torch.empty(N)
            self.register_buffer("u", torch.rand_like(base))
            self.register_buffer("z", torch.randn_like(base))
            self.register_buffer("n", torch.normal(2.0, 0.5, (N,)))
            self.d = nn.Parameter(torch.empty(6, 3, 3, 3))
            nn.init.dirac_(self.d, groups=2)

    torch.manual_seed(0)
    out = fxinit.init_graph(fxinit.trace_init(Factories)).materialize(rng="portable")
    i = out["i"]
    assert i.dtype == torch.int64 and i.min() == 3 and i.max() == 12
    assert (torch.bincount(i - 3, minlength=10).double() / N - 0.1).abs().max() < 0.002
    u, z, n = out["u"].double(), out["z"].double(), out["n"].double()
    assert u.min() >= 0 and u.max() < 1 and abs(u.mean() - 0.5) < 0.003
    assert abs(z.mean()) < 0.003 and abs(z.std() - 1) < 0.01
    assert abs(n.mean() - 2.0) < 0.003 and abs(n.std() / 0.5 - 1) < 0.01
    assert torch.equal(out["d"], nn.init.dirac_(torch.empty(6, 3, 3, 3), groups=2))  # draws nothing


def test_unsupported_random_ops_fail_clearly() -> None:
    class TensorP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.register_buffer("m", torch.empty(8).bernoulli_(torch.full((8,), 0.5)))

    torch.manual_seed(0)
    g = fxinit.init_graph(fxinit.trace_init(TensorP))
    with pytest.raises(fxinit.DeferredInitError, match="no portable implementation"):
        g.materialize(rng="portable")
    g.materialize()  # exact mode still works


class Mixer(nn.Module):
    """mamba's dt_proj.bias pattern: a parameter computed from a random temporary."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 8)
        with torch.no_grad():
            dt = torch.exp(torch.rand(8) * 3 - 4)
            self.proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))


class RandomTemporary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inner = Mixer()


def test_random_temporaries_get_the_same_key_live_and_from_the_graph() -> None:
    torch.manual_seed(0)
    graph_values = fxinit.init_graph(fxinit.trace_init(RandomTemporary)).materialize(rng="portable")
    torch.manual_seed(0)
    m = fxinit.trace_init(RandomTemporary)
    fxinit.materialize(m.inner, rng="portable")
    assert torch.equal(m.inner.proj.bias, graph_values["inner.proj.bias"])
