"""A fast slice of the fidelity corpus: real transformers architectures against eager.

The whole corpus (every architecture that builds tiny, several seeds and default dtypes)
runs in CI through ``tools/corpus.py``; these cover the families with the known traps:
RoPE buffers and tied heads (llama), ``trunc_normal_`` rejection sampling (vit, dinov2),
``linspace(...).item()`` drop-path schedules (convnext, swin), BatchNorm buffers and
``post_init`` re-init (bert), MoE experts (mixtral), encoder-decoder ties (bart, t5).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import corpus  # noqa: E402

CASES = [
    ("llama", 0, "float32"),
    ("llama", 1, "bfloat16"),
    ("vit", 0, "float32"),
    ("dinov2", 2, "float64"),
    ("convnext", 0, "float32"),
    ("swin", 1, "bfloat16"),
    ("bert", 0, "float32"),
    ("mixtral", 0, "float32"),
    ("bart", 3, "float32"),
    ("t5", 0, "bfloat16"),
    ("gpt2", 0, "float64"),
    ("resnet", 0, "float32"),
]


@pytest.mark.parametrize("model_type,seed,dtype", CASES, ids=[f"{m}-{s}-{d}" for m, s, d in CASES])
def test_architecture_is_bitwise_equal_to_eager(model_type: str, seed: int, dtype: str) -> None:
    result = corpus.check_model(model_type, seed, dtype, variant="tiny")
    assert result["whole"] == "ok", result["whole"]
    assert result["reverse"] == "ok", result["reverse"]


def test_compare_catches_a_single_flipped_bit() -> None:
    """The corpus oracle itself must be able to fail."""
    import torch
    from transformers import AutoModel

    cfg = corpus.build_config("bert", "tiny")
    torch.manual_seed(0)
    ref = AutoModel.from_config(cfg)
    torch.manual_seed(0)
    other = AutoModel.from_config(cfg)
    assert corpus.compare(ref, other) == []
    with torch.no_grad():
        w = other.embeddings.word_embeddings.weight
        w.view(-1).view(torch.int32)[5] ^= 1
    assert any("values" in p for p in corpus.compare(ref, other))
