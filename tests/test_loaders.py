"""Checkpoint loaders that users already call after building a model, run on a traced one:
accelerate's ``load_checkpoint_and_dispatch`` and ``load_checkpoint_in_model`` (the
``init_empty_weights`` flow fxinit replaces) and torch.distributed.checkpoint's
``set_model_state_dict`` (torchtitan's), whole and partial checkpoints, then ``materialize``
for the rest, against the same calls on eager construction."""

from __future__ import annotations

import gc
import os
import warnings
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.nn as nn
from accelerate import load_checkpoint_and_dispatch, load_checkpoint_in_model
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from transformers import AutoModelForCausalLM, LlamaConfig

import fxinit

CONFIG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, max_position_embeddings=64)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny Llama saved whole, and the same without every third tensor."""
    whole = tmp_path_factory.mktemp("whole")
    torch.manual_seed(123)
    AutoModelForCausalLM.from_config(CONFIG).save_pretrained(whole)
    partial = tmp_path_factory.mktemp("partial")
    tensors = load_file(os.path.join(whole, "model.safetensors"))
    save_file({k: v for i, (k, v) in enumerate(sorted(tensors.items())) if i % 3},
              os.path.join(partial, "model.safetensors"), metadata={"format": "pt"})
    CONFIG.save_pretrained(partial)
    return {"whole": whole, "partial": partial}


def _state(load: Callable[[nn.Module], Any], trace: bool) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # nothing fxinit would warn about
        warnings.filterwarnings("ignore", message=".*(metadata|TypedStorage).*")
        m = fxinit.trace_init(AutoModelForCausalLM.from_config, CONFIG) if trace \
            else AutoModelForCausalLM.from_config(CONFIG)
        load(m)
        if trace:
            fxinit.materialize(m)
    assert not any(fxinit.is_deferred(t) for t in m.state_dict().values())
    return m.state_dict(keep_vars=True)


def _same(load: Callable[[nn.Module], Any]) -> None:
    eager, traced = _state(load, False), _state(load, True)
    assert eager.keys() == traced.keys()
    for k, a in eager.items():
        b = traced[k]
        assert (type(a), a.dtype, a.device, a.requires_grad) == (type(b), b.dtype, b.device, b.requires_grad), k
        assert torch.equal(a, b), k


@pytest.mark.parametrize("which", ["whole", "partial"])
@pytest.mark.parametrize("loader", ["load_checkpoint_and_dispatch", "load_checkpoint_in_model"])
@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_accelerate_loads_into_a_traced_model_as_into_eager(checkpoints: dict[str, Path], which: str, loader: str,
                                                           dtype: torch.dtype | None) -> None:
    """accelerate replaces each loaded parameter with ``type(param)(value, requires_grad=...)``
    (a deferred parameter's type is fxinit's: it used to raise TypeError) or loads through
    ``set_model_state_dict``; the tensors it does not load are materialized."""
    path = checkpoints[which]
    if loader == "load_checkpoint_and_dispatch":
        _same(lambda m: load_checkpoint_and_dispatch(m, str(path), device_map={"": "cpu"}, dtype=dtype,
                                                     strict=which == "whole"))
    else:
        _same(lambda m: load_checkpoint_in_model(m, str(path), dtype=dtype, strict=which == "whole"))


@pytest.mark.parametrize("full_state_dict", [False, True])
@pytest.mark.parametrize("which", ["whole", "partial"])
def test_set_model_state_dict_without_a_process_group(checkpoints: dict[str, Path], full_state_dict: bool,
                                                      which: str) -> None:
    """``full_state_dict=True`` reads the model's devices: told ``meta`` (as torch.distributed's
    layout code is), it asked for the default process group's device and failed without one."""
    tensors = load_file(os.path.join(checkpoints[which], "model.safetensors"))
    options = StateDictOptions(full_state_dict=full_state_dict, strict=which == "whole")
    _same(lambda m: set_model_state_dict(m, dict(tensors), options=options))


class Tagged(nn.Parameter):
    pass


class TaggedModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = Tagged(torch.randn(3))


def test_type_of_a_deferred_parameter_called_on_a_real_value_is_refused_where_it_could_be_another_class() -> None:
    """``type(p)`` of a deferred parameter is fxinit's class whatever ``p`` was made as; called
    on a real value it builds an ``nn.Parameter``, eager's class, unless a live trace made
    deferred tensors of other classes: then it is refused, not answered with the wrong class."""
    gc.collect()
    plain = fxinit.trace_init(nn.Linear, 2, 2)
    built = type(plain.weight)(torch.ones(2, 2), requires_grad=False)
    assert type(built) is nn.Parameter and not built.requires_grad and torch.equal(built, torch.ones(2, 2))
    tagged = fxinit.trace_init(TaggedModel)
    assert isinstance(tagged.w, Tagged)
    with pytest.raises(fxinit.DeferredInitError, match="Tagged"):
        type(plain.weight)(torch.ones(2, 2))
    del tagged
    assert type(type(plain.weight)(torch.ones(2, 2))) is nn.Parameter  # the trace is gone
