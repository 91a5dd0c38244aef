"""fxinit under torch.distributed (gloo, CPU, 2 and 4 processes): FSDP2, FSDP1 and pipeline
stages, compared with eager construction bit for bit."""

from __future__ import annotations

import pytest
import torch

import fxinit
from tests import distributed_worker as worker
from tests.launch import launch

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch without distributed", allow_module_level=True)


def _launch(world: int, scenarios: list[str]) -> dict[int, dict]:
    return launch(worker.run, world, scenarios)


@pytest.fixture(scope="module")
def two_ranks() -> dict[int, dict]:
    return _launch(2, ["fsdp2_exact", "fsdp2_piecewise", "fsdp2_bf16", "fsdp2_checkpoint", "fsdp2_dcp_load", "fsdp2_portable", "fsdp1",
                       "pipeline"])


@pytest.mark.parametrize("scenario", ["fsdp2_exact", "fsdp2_piecewise", "fsdp2_bf16", "fsdp2_checkpoint", "fsdp2_dcp_load", "fsdp1",
                                      "pipeline"])
def test_each_rank_matches_eager(two_ranks: dict[int, dict], scenario: str) -> None:
    for rank, res in two_ranks.items():
        assert res[scenario] == [], f"rank {rank}: {res[scenario][:5]}"


def _unsharded_portable(factory) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return fxinit.init_graph(fxinit.trace_init(factory)).materialize(rng="portable")


def test_portable_values_do_not_depend_on_world_size(two_ranks: dict[int, dict]) -> None:
    four = _launch(4, ["fsdp2_portable"])
    for model, factory in (("net", worker.Net), ("llama", worker.llama)):
        alone = _unsharded_portable(factory)
        for results in (two_ranks, four):
            for rank, res in results.items():
                got = res["fsdp2_portable"][model]
                for name, value in got.items():
                    assert torch.equal(value, alone[name]), (model, rank, name)


def test_fsdp1_torchdistx_branch_through_fxinit_torchdistx() -> None:
    """FSDP1's own torchdistX branch, reached through ``fxinit.torchdistx.install()``: the
    scenarios of PyTorch's test_fsdp_meta.py torchdistX tests, on 2 gloo ranks, bit for bit."""
    from tests import torchdistx_worker

    for rank, res in launch(torchdistx_worker.run, 2, ["torchdistx"]).items():
        assert res["torchdistx"] == [], f"rank {rank}: {res['torchdistx'][:5]}"
