"""passes.waves: a materialize planned and run in waves gives what one plan gives.

On a GPU, materialize plans a wave while the device runs the one before; on the CPU it plans
whole. These tests cut every slice into waves on the CPU (``_overlapping`` forced true, slices
of any size cut), so the path a GPU takes is checked here bit for bit against eager.
"""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn as nn

import fxinit
from conftest import assert_same_as_eager, compare_modules
from fxinit.capture.deferred import state_of
from fxinit.passes import waves as waves_pass

values_module = importlib.import_module("fxinit.values")


@pytest.fixture
def in_waves(monkeypatch):
    """Every materialize of 2 tensors or more cut into waves, as on a GPU; the waves taken, recorded."""
    taken: list[list[list[int]]] = []
    cut = values_module.waves

    def recording(targets, nbytes, min_count=None):
        found = cut(targets, nbytes, min_count)
        taken.append(found)
        return found

    monkeypatch.setattr(values_module, "_overlapping", lambda devices: True)
    monkeypatch.setattr(values_module, "waves", recording)
    monkeypatch.setattr(waves_pass, "MIN_COUNT", 2)
    monkeypatch.setattr(waves_pass, "MIN_BYTES", 0)
    return taken


def test_waves_keep_a_storage_together_and_the_largest_first() -> None:
    m = fxinit.trace_init(lambda: nn.Sequential(*[nn.Linear(32, 32) for _ in range(12)], nn.Embedding(4096, 64)))
    rec = state_of(m[0].weight).recorder
    views = [m[3].weight[1], m[3].weight[:2]]  # (tensors a caller asks for with the weight)
    tensors = [*m.parameters(), *views]
    targets = [(state_of(t).node, rec.storage_id(t)) for t in tensors]
    found = waves_pass.waves(targets, [t.numel() * t.element_size() for t in tensors], min_count=1, min_bytes=1)
    assert len(found) == len(waves_pass.BOUNDS)
    assert sorted(i for w in found for i in w) == list(range(len(targets)))
    assert found[0][0] == len(tensors) - 3  # the embedding: the largest, first
    wave_of = {i: w for w, wave in enumerate(found) for i in wave}
    weight = next(i for i, t in enumerate(tensors) if t is m[3].weight)
    assert wave_of[len(tensors) - 2] == wave_of[len(tensors) - 1] == wave_of[weight]
    whole = [list(range(len(targets)))]
    assert waves_pass.waves(targets, [1 << 30] * len(targets)) == whole  # below MIN_COUNT
    assert waves_pass.waves(targets, [1] * len(targets), min_count=1) == whole  # below MIN_BYTES


class Shared(nn.Module):
    """Values that cross groups' edges if anything does: a tied parameter, a buffer viewing a
    parameter, a buffer computed from one (a gradient path), a parameter written in place
    through a view after an init, and a weight-normed layer."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.b.weight = self.a.weight
        self.register_buffer("head", self.a.bias[:4])
        self.scaled = self.b.bias * 2
        self.c = nn.utils.parametrizations.weight_norm(nn.Linear(16, 8))
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(6))
        with torch.no_grad():
            self.blocks[2].weight[:, :3].zero_()
            self.blocks[3].weight.copy_(self.blocks[4].weight * 0.5)
        self.rnn = nn.LSTM(8, 8, num_layers=2)


def test_shared_values_equal_eager_in_waves(in_waves) -> None:
    assert_same_as_eager(Shared)
    assert any(len(w) > 1 for w in in_waves)


def test_transformers_models_equal_eager_in_waves(in_waves) -> None:
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    llama = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=128, tie_word_embeddings=True)
    assert_same_as_eager(LlamaForCausalLM, llama, orders=("whole", "reverse"))
    bert = BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=128)
    assert_same_as_eager(BertModel, bert, seeds=(0,))
    assert sum(len(w) > 1 for w in in_waves) >= 2


def test_dtype_in_waves_and_portable_whole(in_waves) -> None:
    make = lambda: nn.Sequential(*[nn.Linear(16, 16) for _ in range(8)], nn.Embedding(64, 16))  # noqa: E731
    torch.manual_seed(0)
    ref = make().to(torch.bfloat16)
    torch.manual_seed(0)
    m = fxinit.materialize(fxinit.trace_init(make), dtype=torch.bfloat16)
    assert compare_modules(m, ref) == []
    assert len(in_waves) == 1 and len(in_waves[0]) > 1
    fxinit.materialize(fxinit.trace_init(make), rng="portable")  # batched fills: planned whole
    assert len(in_waves) == 1


def test_only_an_asynchronous_device_is_cut() -> None:
    overlapping = values_module._overlapping
    assert not overlapping({torch.device("cpu")})
    assert not overlapping({torch.device("meta")})
    assert not overlapping({None})
    assert not overlapping({torch.device("cuda", 0), torch.device("cpu")})
    assert overlapping({torch.device("cuda", 0)}) is torch.cuda.is_available()
