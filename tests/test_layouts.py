"""Every torch.distributed layout of a traced model (gloo, CPU, 1, 2, 4 and 8 processes):
tensor parallel, sequence parallel, FSDP2 over TP (2-D), HSDP, HSDP x TP (3-D), expert
parallel, distribute_tensor with every placement, ties, torchtitan's to_empty + init_weights
flow; exact against single-process eager bit for bit, portable identical across layouts."""

from __future__ import annotations

import pytest
import torch

from tests import layouts_worker as worker
from tests.launch import launch

pytest.importorskip("transformers")
if not torch.distributed.is_available():
    pytest.skip("torch without distributed", allow_module_level=True)

TWO = ["tensor_parallel", "tensor_parallel_bf16", "titan_tp", "titan_fsdp", "refusals", "portable"]
FOUR = ["titan_2d", "fsdp_over_tp", "distribute_directly", "experts_and_hsdp", "portable"]


@pytest.fixture(scope="module")
def two() -> dict[int, dict]:
    return launch(worker.run, 2, TWO)


@pytest.fixture(scope="module")
def four() -> dict[int, dict]:
    return launch(worker.run, 4, FOUR)


@pytest.mark.parametrize("scenario", [s for s in TWO if s != "portable"])
def test_two_ranks(two: dict[int, dict], scenario: str) -> None:
    for rank, res in two.items():
        assert res[scenario] == [], f"rank {rank}: {res[scenario][:6]}"


@pytest.mark.parametrize("scenario", [s for s in FOUR if s != "portable"])
def test_four_ranks(four: dict[int, dict], scenario: str) -> None:
    for rank, res in four.items():
        assert res[scenario] == [], f"rank {rank}: {res[scenario][:6]}"


def test_three_dimensional_mesh() -> None:
    """HSDP (2 replicas x 2 shards) x tensor parallel 2: eight processes."""
    for rank, res in launch(worker.run, 8, ["titan_hsdp_tp"]).items():
        assert res["titan_hsdp_tp"] == [], f"rank {rank}: {res['titan_hsdp_tp'][:6]}"


def _single_process_portable() -> dict[str, dict[str, torch.Tensor]]:
    import fxinit

    t = worker.titan()
    args = t.ModelArgs()
    torch.manual_seed(0)
    traced = fxinit.init_graph(fxinit.trace_init(t.Transformer, args)).materialize(rng="portable")
    torch.manual_seed(3)
    with torch.device("meta"):
        model = fxinit.trace_init(t.Transformer, args)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=torch.device("cpu"))
    fxinit.materialize(model, rng="portable")
    return {"traced": traced, "titan": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def test_portable_values_do_not_depend_on_the_layout(two: dict[int, dict], four: dict[int, dict]) -> None:
    alone = _single_process_portable()
    one = launch(worker.run, 1, ["portable"])
    seen = set()
    for world, results in ((1, one), (2, two), (4, four)):
        for rank, res in results.items():
            for key, tensors in res["portable"].items():
                flow, layout = key.split("/")
                seen.add(key)
                for name, value in tensors.items():
                    want = alone[flow][name]
                    assert torch.equal(value, want), (world, rank, key, name)
    assert {"traced/tp", "traced/fsdp", "traced/2d", "titan/tp", "titan/2d"} <= seen
