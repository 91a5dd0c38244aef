"""fxinit with the real torchtitan package (0.3.0): its trainer's flow with only the build line
changed (``model = fxinit.trace_init(model_config.build)``, ``fxinit.materialize(model)`` at
the end), bit for bit against the same flow without fxinit, on one process for every model
family, and laid out on 4 gloo CPU processes with torchtitan's own ``ParallelDims`` and
``parallelize_fn`` (FSDP2, TP, 2-D, HSDP, full_dtensor, expert parallel): each rank's local
shards against the matching slices of the single-process values.

torchtitan is installed with ``--no-deps`` (see ``torchtitan_worker.INSTALL``); without it
these tests fail, saying how to install it."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxinit
from tests import torchtitan_worker as worker
from tests.conftest import TORCH_RELEASE, compare_modules
from tests.launch import launch


#: torchtitan 0.3 imports ``torch.distributed.fsdp.DataParallelMeshDims``, new in torch 2.12.
TORCHTITAN_NEEDS = (2, 12)


def _require_torchtitan() -> None:
    """Fail (not skip): these tests are part of the suite, and the package is installable;
    skip only under a torch older than the one torchtitan 0.3 is written for."""
    if TORCH_RELEASE < TORCHTITAN_NEEDS:
        pytest.skip(f"torchtitan 0.3 needs torch >= {'.'.join(map(str, TORCHTITAN_NEEDS))}")
    why = worker.missing()
    if why is not None:
        pytest.fail(why, pytrace=False)


def _trainer_flow(family: str, flavor: str, n_layers: int | None, how: str,
                  meta: bool = False) -> tuple[nn.Module, torch.Tensor]:
    """Seed 0, the trainer's order on one process (build, verify_module_protocol, count,
    to_empty, init_weights(buffer_device=None)), ``fxinit.materialize`` last where traced;
    and ``torch.rand(4)`` right after: the global stream must be where eager leaves it."""
    spec = worker.model_spec(family, flavor, n_layers)
    torch.manual_seed(0)
    if meta:  # the user kept the trainer's torch.device("meta") around fxinit's line
        with torch.device("meta"):
            model = worker.build(spec.model, how)
    else:
        model = worker.build(spec.model, how)
    model.verify_module_protocol()
    spec.model.get_nparams_and_flops(model, worker.SEQ_LEN)
    worker.init(model)
    if how == "fxinit":
        fxinit.materialize(model)
    return model, torch.rand(4)


@functools.lru_cache(maxsize=1)
def _flows(family: str, flavor: str, n_layers: int | None) -> tuple[Any, Any]:
    """The eager flow (built on the CPU: trace_init replays the constructors as they run
    there) and fxinit's (cached for the next test of the same model)."""
    return _trainer_flow(family, flavor, n_layers, "cpu"), _trainer_flow(family, flavor, n_layers, "fxinit")


def _assert_same(eager: nn.Module, traced: nn.Module, what: str) -> None:
    """The repo's oracle (tests/conftest.py): every parameter and buffer, non-persistent
    buffers included, by name: bits, dtype, shape, stride, device, requires_grad, type, ties
    and storage sharing; and nothing left deferred."""
    errors = compare_modules(traced, eager, f"{what}: ")
    assert not errors, f"{len(errors)} differences from eager:\n" + "\n".join(errors[:8])
    assert not fxinit.is_deferred(traced), f"{what}: still deferred after materialize"


def test_llama3_forward_gives_the_same_logits() -> None:
    """A forward pass of llama3 debugmodel (flex attention, the trainer's attention masks)
    on a few tokens: the same logits, bit for bit."""
    _require_torchtitan()
    if TORCH_RELEASE < (2, 13):  # eager's own forward fails there: not fxinit's to test
        pytest.skip("torchtitan 0.3's attention masks call torch 2.13's create_block_mask(separate_full_blocks=)")
    (eager, _), (traced, _) = _flows("llama3", "debugmodel", None)  # FAMILIES[0]: cached for its test below
    tokens = torch.randint(0, 2048, (2, 8), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(8).repeat(2, 1)
    logits = []
    for model in (eager, traced):
        with torch.no_grad():
            logits.append(model(tokens, positions=positions, attention_masks=model.get_attention_masks(positions)))
    assert logits[0].shape == (2, 8, 2048) and torch.isfinite(logits[0]).all()
    assert worker.bits_equal(logits[1], logits[0]), worker.describe(logits[1], logits[0])


@pytest.mark.parametrize(("family", "flavor", "n_layers"), worker.FAMILIES,
                         ids=[f"{f}-{v}" for f, v, _ in worker.FAMILIES])
def test_trainer_flow_matches_eager(family: str, flavor: str, n_layers: int | None) -> None:
    """Every parameter and buffer (non-persistent ones too), bit for bit, and the global
    random stream after both flows."""
    _require_torchtitan()
    (eager, rand_eager), (traced, rand_traced) = _flows(family, flavor, n_layers)
    _assert_same(eager, traced, f"{family}/{flavor}")
    assert torch.equal(rand_traced, rand_eager), "the global random stream differs after the two flows"


def test_trainer_flow_with_meta_kept_matches_the_trainers_own_values() -> None:
    """``with torch.device("meta"): model = fxinit.trace_init(model_config.build)`` (the
    trainer's line wrapped rather than replaced, as in docs/guide.md): the constructors draw
    nothing, as on meta, so the values are the trainer's own meta flow's."""
    _require_torchtitan()
    eager, rand_eager = _trainer_flow("llama3", "debugmodel", 2, "meta")
    traced, rand_traced = _trainer_flow("llama3", "debugmodel", 2, "fxinit", meta=True)
    _assert_same(eager, traced, "llama3/debugmodel under meta")
    assert torch.equal(rand_traced, rand_eager), "the global random stream differs after the two flows"


def test_checkpoint_manager_loads_fxinit_dcp_export_as_its_seed_checkpoint(tmp_path: Any) -> None:
    """``fxinit.save(model, dir, format="dcp")`` in place of ``--checkpoint.create_seed_checkpoint``:
    torchtitan's own ``CheckpointManager`` loads it as ``initial_load_path`` into a model built
    with another seed. Qwen3's fused QKV renames ``wqkv`` into ``wq``/``wk``/``wv`` in a
    state-dict post-hook, so the export must hold the keys of ``state_dict()``, not the
    parameter names."""
    _require_torchtitan()
    from torchtitan.components.checkpointer import CheckpointManager

    spec = worker.model_spec("qwen3", "debugmodel", 2)
    torch.manual_seed(0)
    traced = worker.init(worker.build(spec.model, "fxinit"))
    assert any(k.endswith("qkv_linear.wk.weight") for k in traced.state_dict())
    fxinit.save(traced, tmp_path / "seed", format="dcp")
    torch.manual_seed(0)
    eager = worker.init(worker.build(spec.model, "cpu"))
    torch.manual_seed(1)
    fresh = worker.init(worker.build(spec.model, "cpu"))
    config = CheckpointManager.Config(enable=True, folder="checkpoint", initial_load_path=str(tmp_path / "seed"),
                                      initial_load_model_only=True)
    manager = CheckpointManager(config, dataloader=None, model_parts=[fresh], optimizers=None, lr_schedulers=None,
                                states={}, sd_adapter=None, base_folder=str(tmp_path))
    assert manager.load()
    want, got = worker.tensors(eager), worker.tensors(fresh)
    differ = [k for k in want if not worker.bits_equal(got[k], want[k])]
    assert not differ, f"differ from eager after torchtitan loaded fxinit's export: {differ}"


# ------------------------------------------------------------------------------ 4 ranks
@pytest.fixture(scope="module")
def four_ranks() -> dict[int, dict] | None:
    if worker.missing() is not None or TORCH_RELEASE < TORCHTITAN_NEEDS:
        return None  # each test fails, saying how to install it, or skips
    return launch(worker.run, 4, list(worker.SCENARIOS))


@pytest.mark.parametrize("scenario", list(worker.SCENARIOS))
def test_layout(four_ranks: dict[int, dict] | None, scenario: str) -> None:
    """torchtitan's own parallelize_fn on 4 gloo CPU ranks: the eager torchtitan flow on the
    layout runs (its seed-independent tensors equal the single-process slices), and with
    fxinit every rank's local shard of every parameter and buffer is, bit for bit, the
    matching slice of single-process eager construction; nothing is left deferred or meta."""
    _require_torchtitan()
    assert four_ranks is not None
    failures = {rank: res[scenario] for rank, res in four_ranks.items() if res[scenario]}
    assert not failures, "\n".join(f"rank {rank}: " + "\n".join(errs[:4]) for rank, errs in failures.items())
