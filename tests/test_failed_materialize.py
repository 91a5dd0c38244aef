"""A materialize that fails leaves everything deferred, across traces and tensor by tensor;
tensors a model builds on meta stay meta."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fxinit
from conftest import assert_modules_equal, same_bits


def _all_deferred(m: nn.Module) -> bool:
    return all(fxinit.is_deferred(t) for t in list(m.parameters()) + list(m.buffers()))


class WantsMissingDevice(nn.Module):
    """A deterministic buffer meant for a device that this machine may not have."""

    def __init__(self, device: str) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("z", torch.ones(4, device=device))
        # data constants built directly there: torch.tensor(data, device=...)
        self.register_buffer("table", torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device))
        self.register_buffer("scaled", torch.tensor([0.5, 1.5], device=device) * 2)


def _missing_device() -> str:
    for dev in ("cuda", "xpu", "mps"):
        mod = getattr(torch, dev, None)
        if mod is None or not mod.is_available():
            return dev
    pytest.skip("every device type is available here")


def test_failing_materialize_leaves_everything_deferred() -> None:
    dev = _missing_device()
    torch.manual_seed(0)
    ref = WantsMissingDevice("cpu")
    torch.manual_seed(0)
    m = fxinit.trace_init(WantsMissingDevice, dev)
    assert m.z.shape == (4,) and fxinit.init_graph(m).spec("table").device.type == dev
    with pytest.raises(fxinit.DeferredInitError):
        fxinit.materialize(m)  # the buffer's device is not available
    assert _all_deferred(m), "a failed materialize left some tensors materialized"
    fxinit.materialize(m, device="cpu")  # the documented way out
    assert_modules_equal(m, ref)


class BuildsOnMeta(nn.Module):
    """Model code that builds some tensors on meta itself, as eager would keep them."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 3)
        with torch.device("meta"):
            self.seen = torch.tensor([]).device  # model code may branch on it
            self.lazy = nn.Linear(3, 2)
        self.register_buffer("shape_only", torch.tensor([1.0, 2.0], device="meta"))
        self.register_buffer("real", torch.tensor([1.0, 2.0]))


@pytest.mark.parametrize("outer", [None, "meta"])
def test_tensors_the_model_builds_on_meta_stay_meta(outer: str | None) -> None:
    torch.manual_seed(0)
    ref = BuildsOnMeta()
    torch.manual_seed(0)
    if outer is None:
        m = fxinit.trace_init(BuildsOnMeta)
    else:
        with torch.device(outer):
            m = fxinit.trace_init(BuildsOnMeta)
    assert m.seen == ref.seen == torch.device("meta")
    if outer is not None:  # everything was built on meta, as eager would: no values, and never a silent meta
        with pytest.raises(fxinit.DeferredInitError, match="built on the meta device"):
            fxinit.materialize(m, device="cpu")
        assert _all_deferred(m)
        with pytest.raises(fxinit.DeferredInitError, match="default device was meta around trace_init"):
            fxinit.materialize(m)
        assert _all_deferred(m)
        m.to_empty(device="cpu")  # the way out the hint gives: to_empty, then an init step
        with torch.no_grad():
            m.lin.reset_parameters()
            m.real.copy_(torch.tensor([1.0, 2.0]))
        fxinit.materialize(m)
        assert not fxinit.is_deferred(m) and m.real.tolist() == [1.0, 2.0]
        return
    with pytest.raises(fxinit.DeferredInitError, match=r"3 tensor\(s\)"):
        fxinit.materialize(m, device="cpu")
    fxinit.materialize(m)
    assert m.shape_only.is_meta and m.lazy.weight.is_meta and m.shape_only.shape == (2,)
    assert same_bits(m.lin.weight, ref.lin.weight) and same_bits(m.real, ref.real)


def test_failing_materialize_across_two_traces_leaves_everything_deferred() -> None:
    """The first part computes fine, the second cannot be computed any more: nothing is swapped."""
    with fxinit.meta_init():
        part = nn.Linear(2, 2)
    other = fxinit.trace_init(nn.Linear, 2, 2)
    root = nn.Sequential(other, part)
    with fxinit.meta_init():
        throwaway = torch.ones(1)
    fxinit.materialize(throwaway)  # keep_cache=False clears the meta_init cache, `part`'s included
    with pytest.raises(fxinit.DeferredInitError):
        fxinit.materialize(root)
    assert _all_deferred(root), "a failed materialize left some tensors materialized"
    fxinit.materialize(other)
    assert not fxinit.is_deferred(other)


def test_failing_materialize_of_one_tensor_keeps_the_module_usable() -> None:
    dev = _missing_device()
    m = fxinit.trace_init(WantsMissingDevice, dev)
    with pytest.raises(fxinit.DeferredInitError):
        fxinit.materialize(m.z)
    assert fxinit.is_deferred(m.z)
    fxinit.materialize(m.lin)
    assert not fxinit.is_deferred(m.lin)
    assert fxinit.is_deferred(m.z)
