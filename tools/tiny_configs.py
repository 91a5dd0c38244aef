"""Tiny configs for every transformers architecture, for the fidelity corpus.

``tiny_config(model_type)`` shrinks the default config of a model type generically
(widths ~32, 2 layers, few heads and experts, small vocab and positions), recursing
into sub-configs. Some architectures reject a fully shrunk config; ``candidate_configs``
then offers milder variants, and the corpus keeps the first one that builds with
fewer than 20M parameters (counted on the meta device, so nothing large is allocated).
"""

from __future__ import annotations

import os
from typing import Any, Iterator

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoConfig, PretrainedConfig  # noqa: E402

WIDTH = {"hidden_size", "d_model", "n_embd", "embed_dim", "embedding_size", "projection_dim", "hidden_dim",
         "encoder_hidden_size", "decoder_hidden_size", "projector_hidden_size", "out_hidden_size",
         "output_hidden_size", "word_embed_proj_dim", "d_embed", "memory_attention_hidden_size",
         "encoder_hidden_dim", "text_embed_dim", "vision_embed_dim", "hidden_channels", "embedding_dim",
         "emb_dim", "d_latents", "entity_emb_size"}
FFN = {"intermediate_size", "encoder_ffn_dim", "decoder_ffn_dim", "ffn_dim", "d_ff", "n_inner",
       "decoder_intermediate_size", "encoder_intermediate_size"}
SMALL_FFN = {"moe_intermediate_size", "shared_expert_intermediate_size", "shared_intermediate_size"}
LAYERS = {"num_hidden_layers", "num_layers", "n_layer", "n_layers", "encoder_layers", "decoder_layers",
          "num_decoder_layers", "num_encoder_layers", "depth", "memory_attention_num_layers", "text_layers",
          "vision_layers"}
HEADS = {"num_attention_heads", "n_head", "n_heads", "num_heads", "encoder_attention_heads",
         "decoder_attention_heads", "decoder_num_attention_heads", "memory_attention_num_attention_heads"}
HEAD_DIMS = {"head_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8, "d_kv": 8,
             "kv_lora_rank": 16, "q_lora_rank": 16, "qk_head_dim": 16, "index_head_dim": 8}
EXPERTS = {"num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2,
           "moe_topk": 2, "n_group": 1, "topk_group": 1, "n_shared_experts": 1, "num_shared_experts": 1,
           "index_n_heads": 2, "index_topk": 8}
VOCABS = {"vocab_size", "n_words", "entity_vocab_size", "src_vocab_size", "tgt_vocab_size"}
POSITIONS = {"max_position_embeddings": 128, "n_positions": 128, "max_source_positions": 128,
             "max_target_positions": 128, "max_2d_position_embeddings": 128}
LAYER_LISTS = ("layer_types", "mlp_layer_types", "mlp_only_layers", "indexer_types")
VOCAB = 128


def _shrink(cfg: PretrainedConfig, level: int) -> None:
    """level 2: everything; level 1: depth, vocab and positions only."""
    d = cfg.to_dict()
    layers = None
    for k, v in d.items():
        if isinstance(v, bool):
            continue
        new: Any = None
        if k in LAYERS and isinstance(v, int) and v > 2:
            new = layers = 2
        elif k in VOCABS and isinstance(v, int) and v > VOCAB:
            new = VOCAB
        elif k in POSITIONS and isinstance(v, int) and v > POSITIONS[k]:
            new = POSITIONS[k]
        elif level >= 2:
            if k in WIDTH and isinstance(v, int) and v > 32:
                new = 32
            elif k in FFN and isinstance(v, int) and v > 64:
                new = 64
            elif k in SMALL_FFN and isinstance(v, int) and v > 32:
                new = 32
            elif k in HEADS and isinstance(v, int) and v > 4:
                new = 4
            elif k == "num_key_value_heads" and isinstance(v, int) and v > 2:
                new = 2
            elif k in HEAD_DIMS and isinstance(v, int) and v > HEAD_DIMS[k]:
                new = HEAD_DIMS[k]
            elif k == "num_latents" and isinstance(v, int) and v > 8:
                new = 8
            elif k in EXPERTS and isinstance(v, int) and v > EXPERTS[k]:
                new = EXPERTS[k]
            elif k == "image_size" and isinstance(v, int) and "patch_size" in d and v > 32:
                new = 32
            elif k == "patch_size" and isinstance(v, int) and v > 8:
                new = 8
            elif k == "hidden_sizes" and isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                new = [32 * 2 ** i for i in range(len(v))]
            elif k == "depths" and isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                new = [1] * len(v)
            elif k in HEADS and isinstance(v, list) and v and all(isinstance(x, int) for x in v):
                new = [1] * len(v)
            elif k == "embed_dim" and isinstance(v, list):
                new = [8 * 2 ** i for i in range(len(v))]
        if new is not None:
            _set(cfg, k, new)
    n_layers = layers or getattr(cfg, "num_hidden_layers", None)
    for k in LAYER_LISTS:
        v = getattr(cfg, k, None)
        if isinstance(v, list) and isinstance(n_layers, int) and len(v) > n_layers:
            _set(cfg, k, v[:n_layers] if not all(isinstance(x, int) for x in v) else [x for x in v if x < n_layers])
    vocab = getattr(cfg, "vocab_size", None)
    if isinstance(vocab, int):
        taken = vocab - 1
        for k, v in cfg.to_dict().items():
            if (k.endswith("_token_id") or k.endswith("_token_index") or k == "padding_idx") \
                    and isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
                _set(cfg, k, max(taken, 0))
                taken -= 1
    for k, v in list(vars(cfg).items()):
        if isinstance(v, PretrainedConfig):
            _shrink(v, level)


def _set(cfg: PretrainedConfig, key: str, value: Any) -> None:
    try:
        setattr(cfg, key, value)
    except Exception:  # strict dataclass validation: keep the default
        pass


def candidate_configs(model_type: str) -> Iterator[tuple[str, PretrainedConfig]]:
    """Shrunk configs for ``model_type``, most shrunk first, then the default."""
    for level, label in ((2, "tiny"), (1, "shallow")):
        cfg = AutoConfig.for_model(model_type)
        _shrink(cfg, level)
        yield label, cfg
    yield "default", AutoConfig.for_model(model_type)


def tiny_config(model_type: str) -> PretrainedConfig:
    """The most shrunk config of ``model_type`` (it may still not build: see the corpus list)."""
    return next(candidate_configs(model_type))[1]
