"""``DistributedDataParallel`` of a deferred model is refused by name (found by a Lightning
sweep): with ``init_sync=False`` DDP's reducer kept the deferred parameters, ``materialize``
could not swap them while it held them (a warning), and the materialized model's gradients
were never averaged across ranks, silently; with the default, torch's broadcast failed in C++.
A model materialized first is wrapped as eager's is."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxinit

if not torch.distributed.is_available():
    pytest.skip("torch without distributed", allow_module_level=True)
dist = torch.distributed


@pytest.fixture
def one_rank(tmp_path: Path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("init_sync", [True, False])
def test_ddp_of_a_deferred_model_is_refused_by_name(one_rank: None, init_sync: bool) -> None:
    m = fxinit.trace_init(lambda: nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3)))
    with pytest.raises(fxinit.DeferredInitError, match=r"DistributedDataParallel of a model with deferred tensors "
                                                       r"\(0\.weight\)") as info:
        nn.parallel.DistributedDataParallel(m, init_sync=init_sync)
    assert "test_ddp.py" in str(info.value)  # the caller's line


def test_ddp_of_a_materialized_model_trains_as_eagers(one_rank: None) -> None:
    def trained(m: nn.Module) -> torch.Tensor:
        ddp = nn.parallel.DistributedDataParallel(m)
        torch.manual_seed(1)
        ddp(torch.randn(5, 4)).square().sum().backward()
        return m.weight.grad

    torch.manual_seed(0)
    want = trained(nn.Linear(4, 3))
    torch.manual_seed(0)
    assert torch.equal(trained(fxinit.materialize(fxinit.trace_init(nn.Linear, 4, 3))), want)
