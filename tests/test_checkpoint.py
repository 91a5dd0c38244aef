"""Checkpoint-aware materialization: what the checkpoint has is read, never initialized;
the rest initializes exactly as eager construction followed by load_state_dict."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxinit
import fxinit.backends.eager as eager_backend
from fxinit.capture.deferred import state_of
from fxinit.errors import DeferredInitError
from tests.conftest import same_bits

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _llama() -> nn.Module:
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    return transformers.LlamaForCausalLM(cfg)


def _eager_then_load(state: dict[str, torch.Tensor], seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    ref = _llama()
    ref.load_state_dict(state, strict=False)
    return ref


def _assert_equal_to(model: nn.Module, ref: nn.Module) -> None:
    got = dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))
    want = dict(ref.named_parameters(remove_duplicate=False)) | dict(ref.named_buffers(remove_duplicate=False))
    assert got.keys() == want.keys()
    for k in want:
        assert same_bits(got[k], want[k]), k
    assert model.lm_head.weight is model.model.embed_tokens.weight


def _checkpoint(drop: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    torch.manual_seed(123)
    donor = _llama()
    return {k: v for k, v in donor.state_dict().items() if not any(k.startswith(d) for d in drop)}


@pytest.fixture
def executed(monkeypatch: pytest.MonkeyPatch) -> list:
    """Every node the eager backend runs."""
    ran: list = []
    real = eager_backend.run_nodes

    def spy(nodes, *args, **kwargs):
        ran.extend(nodes)
        return real(nodes, *args, **kwargs)

    monkeypatch.setattr(eager_backend, "run_nodes", spy)
    return ran


@pytest.mark.parametrize("fmt", ["dict", "safetensors", "torch"])
def test_full_checkpoint_runs_no_init(tmp_path: Path, fmt: str, executed: list) -> None:
    state = _checkpoint()
    source: object = state
    if fmt == "safetensors":
        source = tmp_path / "w.safetensors"
        safetensors_torch.save_file({k: v for k, v in state.items() if k != "lm_head.weight"}, source)
    elif fmt == "torch":
        source = tmp_path / "w.pt"
        torch.save(state, source)
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    params = list(m.parameters())
    rec = state_of(params[0]).recorder
    param_nodes = {state_of(p).node for p in params}
    param_storages = {rec.storage_id(p) for p in params}
    fxinit.materialize(m, state_dict=source)
    assert executed  # the RoPE buffer is computed...
    assert not any(n.meta.get("rng") for n in executed)  # ...but no parameter is initialized
    assert not param_nodes & set(executed)
    assert not any(param_storages & {*n.meta["reads"], *n.meta["mutates"]} for n in executed)
    _assert_equal_to(m, _eager_then_load(state))
    assert not fxinit.is_deferred(m)


def test_partial_checkpoint_initializes_the_rest_exactly() -> None:
    state = _checkpoint(drop=("model.layers.1.",))
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    fxinit.materialize(m.model.layers[1])  # part of it first, any order still works
    fxinit.materialize(m, state_dict=state)
    _assert_equal_to(m, _eager_then_load(state))


def test_checkpoint_with_prefix_for_a_submodule_and_dtype_conversion() -> None:
    state = {k: v.double() for k, v in _checkpoint().items()}
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    fxinit.materialize(m.model.layers[0], state_dict=state, prefix="model.layers.0.")
    assert m.model.layers[0].mlp.up_proj.weight.dtype == torch.float32
    assert torch.equal(m.model.layers[0].mlp.up_proj.weight, state["model.layers.0.mlp.up_proj.weight"].float())
    assert fxinit.is_deferred(m.model.layers[1])


def test_checkpoint_errors_are_clear() -> None:
    state = _checkpoint()
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    bad = dict(state, **{"model.norm.weight": torch.ones(5)})
    with pytest.raises(DeferredInitError, match=r"'model.norm.weight' has shape \(5,\)"):
        fxinit.materialize(m, state_dict=bad)
    partial = _checkpoint(drop=("model.norm.",))
    with pytest.raises(DeferredInitError, match="missing.*model.norm.weight"):
        fxinit.materialize(m, state_dict=dict(partial, extra=torch.ones(1)), strict=True)
    assert fxinit.is_deferred(m.model.norm)  # nothing was half done
    with pytest.raises(DeferredInitError, match="not found"):
        fxinit.materialize(m, state_dict="/nonexistent/w.safetensors")


class Views(nn.Module):
    """Parameters that are views of one storage, as fused-QKV code makes them."""

    def __init__(self) -> None:
        super().__init__()
        base = torch.empty(6, 4)
        nn.init.normal_(base)
        self.q = nn.Parameter(base[:2])
        self.k = nn.Parameter(base[2:4])
        self.v = nn.Parameter(base[4:])


def test_checkpoint_values_land_in_shared_storage() -> None:
    state = {"k": torch.full((2, 4), 3.0)}
    torch.manual_seed(0)
    ref = Views()
    ref.load_state_dict(state, strict=False)
    torch.manual_seed(0)
    m = fxinit.trace_init(Views)
    fxinit.materialize(m, state_dict=state)
    for name in "qkv":
        assert torch.equal(getattr(m, name), getattr(ref, name)), name
    assert m.q.untyped_storage().data_ptr() == m.k.untyped_storage().data_ptr()


def test_load_state_dict_on_a_deferred_model_is_recorded_and_kills_the_init() -> None:
    state = _checkpoint()
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch's "copying into a meta parameter is a no-op" must not fire
        m.load_state_dict(state)
    assert fxinit.init_graph(m).stats()["random_ops"] == 0
    fxinit.materialize(m)
    _assert_equal_to(m, _eager_then_load(state))
