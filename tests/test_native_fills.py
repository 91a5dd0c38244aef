"""The compiled uniform_/normal_ fills equal torch's bit for bit, or refuse."""

from __future__ import annotations

import logging
import os
import random
import subprocess
import sys
import textwrap

import pytest
import torch

from fxinit.rng import fills
from conftest import TORCH_RELEASE, kernel_takes, native_fill_done
from fxinit.rng.mt19937 import distance

DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
needs_kernel = pytest.mark.skipif(fills.torch_path() is None, reason="no native fill kernel for this torch/CPU")


def _as_int(t: torch.Tensor) -> torch.Tensor:
    return t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])


def _state(rng: random.Random) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(rng.randrange(1 << 40))
    torch.empty(rng.randrange(0, 1300)).uniform_(generator=g)  # any position in a block
    return g.get_state()


def _torch_fill(kind: str, dtype: torch.dtype, size: int, params, state: torch.Tensor) -> torch.Tensor:
    g = torch.Generator()
    g.set_state(state)
    t = torch.empty(size, dtype=dtype)
    getattr(t, kind + "_")(*params, generator=g)
    return t


def _params(kind: str, rng: random.Random) -> tuple[float, float]:
    a, b = rng.uniform(-2, 2), rng.uniform(0.01, 3)
    return (a, b) if kind == "normal" else (a, a + b)


@pytest.fixture
def fresh_checks():
    fills.reset_checks()
    yield
    fills.reset_checks()


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_pieces_equal_torch(kind, dtype):
    rng = random.Random(f"{kind}{dtype}")
    step = 16 if kind == "normal" else 1
    sizes = [16, 17, 31, 32, 33, 47, 64, 65, 1000, 1007, 4097, 65539, 200_003]
    sizes += [rng.randrange(16, 3000) for _ in range(12)]
    if kind == "uniform":
        sizes += [1, 2, 7, 15]
    for size in sizes:
        state, params = _state(rng), _params(kind, rng)
        expect = _torch_fill(kind, dtype, size, params, state)
        for start in {0, rng.randrange(0, size, step), (size - 1) // step * step}:
            for stop in {size, rng.randrange(start + 1, size + 1)}:
                out = torch.full((stop - start,), float("nan"), dtype=dtype)
                if not native_fill_done(fills.native_fill(kind, out, state, params, start=start, total=size,
                                                          threads=rng.choice([1, 2, 3])), kind, dtype):
                    return
                assert torch.equal(_as_int(out), _as_int(expect[start:stop])), (kind, dtype, size, start, stop, params)


@needs_kernel
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_threads_equal_one_thread(kind, dtype):
    rng = random.Random(7)
    size = 3 * fills.MIN_PER_THREAD + 21
    state, params = _state(rng), _params(kind, rng)
    one = torch.empty(size, dtype=dtype)
    many = torch.empty(size, dtype=dtype)
    assert len(fills._jobs(kind, dtype, size, 0, size, 3)) >= 3
    if not native_fill_done(fills.native_fill(kind, one, state, params, threads=1), kind, dtype):
        return
    assert fills.native_fill(kind, many, state, params, threads=3)
    assert torch.equal(_as_int(one), _as_int(many))
    assert torch.equal(_as_int(many), _as_int(_torch_fill(kind, dtype, size, params, state)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("kind", ["uniform", "normal"])
def test_draw_counts(kind, dtype):
    if not kernel_takes(kind, dtype):  # torch 2.11's and 2.12's count; the kernel leaves these fills to torch
        assert not fills.native_fill(kind, torch.empty(64, dtype=dtype), torch.Generator().get_state(), (0.0, 1.0))
        return
    g = torch.Generator()
    g.manual_seed(3)
    for size in (16, 17, 31, 32, 100, 1007):
        before = g.get_state()
        getattr(torch.empty(size, dtype=dtype), kind + "_")(generator=g)
        assert distance(before, g.get_state()) == fills.draws(kind, dtype, size)


@needs_kernel
def test_a_batch_equals_torch_fill_by_fill():
    """``native_fill_batch`` (one kernel call for many small fills): each fill equal to torch's
    from its own state; it stops at the first it cannot take, and says how many it filled."""
    rng = random.Random(5)
    fills_, want = [], []
    for i in range(40):
        kind = rng.choice(["uniform", "normal"])
        dtype = rng.choice([d for d in DTYPES if kernel_takes(kind, d)])
        size = rng.choice([16, 32, 4096, 16 * 7919]) if kind == "normal" else rng.randrange(1, 5000)
        params, state = _params(kind, rng), _state(rng)
        fills_.append((kind, torch.full((size,), float("nan"), dtype=dtype), state, params))
        want.append(_torch_fill(kind, dtype, size, params, state))
    assert fills.native_fill_batch(fills_) == len(fills_)
    for (_, got, _, _), w in zip(fills_, want):
        assert torch.equal(_as_int(got), _as_int(w))
    state = torch.Generator().get_state()
    mixed = [("uniform", torch.empty(10), state, (0.0, 1.0)), ("normal", torch.empty(24), state, (0.0, 1.0)),
             ("uniform", torch.empty(10), state, (0.0, 1.0))]
    assert fills.native_fill_batch(mixed) == 1  # a normal fill of 24: torch redraws its last block
    assert fills.native_fill_batch([("uniform", torch.empty(fills.BATCH_BELOW), state, (0.0, 1.0))]) == 0
    assert fills.native_fill_batch([("uniform", torch.empty(4, 8).t(), state, (0.0, 1.0))]) == 0
    assert fills.native_fill_batch([]) == 0


@needs_kernel
def test_a_batch_split_over_threads_equals_torch(monkeypatch):
    """A batch split by elements over threads: every fill equal to torch's, and where one part
    stops at a fill it cannot take, the count stops there too."""
    monkeypatch.setattr(fills, "BATCH_PER_THREAD", 64)
    rng = random.Random(7)
    fills_, want = [], []
    for i in range(30):
        kind = rng.choice(["uniform", "normal"])
        size = 16 * rng.randrange(1, 40)
        params, state = _params(kind, rng), _state(rng)
        fills_.append((kind, torch.full((size,), float("nan")), state, params))
        want.append(_torch_fill(kind, torch.float32, size, params, state))
    assert fills.native_fill_batch(fills_, threads=3) == len(fills_)
    for (_, got, _, _), w in zip(fills_, want):
        assert torch.equal(_as_int(got), _as_int(w))
    state = torch.Generator().get_state()
    mixed = [("uniform", torch.empty(100), state, (0.0, 1.0)) for _ in range(20)] \
        + [("normal", torch.empty(24), state, (0.0, 1.0))] + [("uniform", torch.empty(100), state, (0.0, 1.0))]
    assert fills.native_fill_batch(mixed, threads=3) == 20


@needs_kernel
def test_refuses_what_it_does_not_do():
    state = torch.Generator().get_state()
    assert not fills.native_fill("normal", torch.empty(8), state, (0.0, 1.0))  # torch's small-tensor sampler
    assert not fills.native_fill("normal", torch.empty(20), state, (0.0, 1.0), start=4, total=24)
    assert not fills.native_fill("normal", torch.empty(4, 8).t(), state, (0.0, 1.0))
    assert not fills.native_fill("uniform", torch.empty(20, dtype=torch.int32), state, (0.0, 1.0))
    assert not fills.native_fill("bernoulli", torch.empty(20), state, (0.5, 0.0))
    assert not fills.native_fill("uniform", torch.empty(20), state, (0.0, 1.0), start=10, total=20)
    assert not fills.native_fill("uniform", torch.empty(20), state[:100], (0.0, 1.0))


@needs_kernel
def test_disagreeing_kernel_falls_back(monkeypatch, fresh_checks, caplog):
    real = fills._kernel_call

    def off_by_a_bit(op, dtype, path, ptr, job, words, consumed, p0, p1):
        return real(op, dtype, path, ptr, job, words, consumed, p0 + 1e-3, p1)

    monkeypatch.setattr(fills, "_kernel_call", off_by_a_bit)
    state = torch.Generator().get_state()
    with caplog.at_level(logging.DEBUG, logger="fxinit"):
        assert not fills.native_fill("uniform", torch.empty(100), state, (0.0, 1.0))
    assert any("differs from torch" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(fills, "_kernel_call", real)
    assert not fills.native_fill("uniform", torch.empty(100), state, (0.0, 1.0))  # for good
    assert fills.native_fill("uniform", torch.empty(100, dtype=torch.float64), state, (0.0, 1.0))  # others work
    fills.reset_checks()
    assert fills.native_fill("uniform", torch.empty(100), state, (0.0, 1.0))


@needs_kernel
def test_params_that_differ_are_refused(monkeypatch, fresh_checks):
    real = fills._kernel_call

    def wrong_for_std_two(op, dtype, path, ptr, job, words, consumed, p0, p1):
        return real(op, dtype, path, ptr, job, words, consumed, p0, p1 * (1.5 if p1 == 2.0 else 1.0))

    monkeypatch.setattr(fills, "_kernel_call", wrong_for_std_two)
    state = torch.Generator().get_state()
    assert fills.native_fill("normal", torch.empty(64), state, (0.0, 1.0))
    assert not fills.native_fill("normal", torch.empty(64), state, (0.0, 2.0))
    assert not fills.native_fill("normal", torch.empty(64), state, (0.0, 1.0))  # the kind is distrusted now


_OTHER_PATH = textwrap.dedent("""
    import random, torch
    from fxinit.rng import fills
    assert fills.torch_path() == {path}, (fills.torch_path(), torch.backends.cpu.get_cpu_capability())
    rng = random.Random(1)
    as_int = lambda t: t.view({8: torch.int64, 4: torch.int32, 2: torch.int16}[t.element_size()])
    for kind in ("uniform", "normal"):
        for dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            for size in (16, 37, 1007, 70001):
                g = torch.Generator(); g.manual_seed(rng.randrange(1 << 30)); state = g.get_state()
                params = (-0.3, 0.7) if kind == "uniform" else (0.2, 1.3)
                expect = torch.empty(size, dtype=dtype); getattr(expect, kind + "_")(*params, generator=g)
                out = torch.empty(size, dtype=dtype)
                if not fills.native_fill(kind, out, state, params, threads=2):
                    assert {older}, (kind, dtype, size)  # declined after the self-check: torch draws otherwise
                    continue
                assert torch.equal(as_int(out), as_int(expect)), (kind, dtype, size)
    print("ok")
""")


@needs_kernel
@pytest.mark.parametrize("capability,path,isa",
                         [("default", 0, "generic"), ("avx2", 1, "avx2"), ("avx2", 1, "generic")])
def test_other_capabilities(capability, path, isa):
    """torch's other dispatch paths, and the kernels' narrower instruction sets."""
    if capability == "avx2" and not fills.library().fxinit_fill_supported(1):
        pytest.skip("no AVX2 here")
    env = dict(os.environ, ATEN_CPU_CAPABILITY=capability, FXINIT_FILLS_ISA=isa)
    script = _OTHER_PATH.replace("{path}", str(path)).replace("{older}", str(TORCH_RELEASE < (2, 13)))
    done = subprocess.run([sys.executable, "-c", script], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


@needs_kernel
def test_parameters_torch_refuses_do_not_distrust(fresh_checks):
    state = torch.Generator().get_state()
    assert fills.native_fill("uniform", torch.empty(100), state, (0.0, 1.0))
    assert not fills.native_fill("uniform", torch.empty(100), state, (1.0, 0.0))  # torch raises: from > to
    assert not fills.native_fill("normal", torch.empty(64), state, (0.0, -1.0))  # std < 0
    assert fills.native_fill("uniform", torch.empty(100), state, (0.0, 2.0))
    assert fills.native_fill("normal", torch.empty(64), state, (0.0, 1.0))


@needs_kernel
def test_check_results_are_remembered_across_processes(tmp_path) -> None:
    """A fresh process reads what an earlier one's self-check found for the same kernel build,
    torch and CPU, instead of checking again (~12 ms a process)."""
    import shutil
    import subprocess
    import sys

    from fxinit.rng.native import cache_dir

    for built in cache_dir().glob("*.so"):  # the kernels, not rebuilt
        shutil.copy(built, tmp_path)
    code = textwrap.dedent("""
        import torch
        from fxinit.rng import fills
        calls = []
        real = fills._passes
        fills._passes = lambda *a: calls.append(a) or real(*a)
        assert fills.native_fill("normal", torch.empty(64), torch.Generator().get_state(), (0.0, 0.02))
        print(len(calls))
    """)
    env = {**os.environ, "FXINIT_CACHE_DIR": str(tmp_path)}
    counts = [int(subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                                 check=True).stdout) for _ in range(2)]
    assert counts == [2, 0]  # the base check and the parameters' check, then neither
