"""fxinit against the model code of training frameworks you can install (not test dependencies).

    python tools/framework_sweep.py timm   [--limit 400] [--stub-missing]
    python tools/framework_sweep.py litgpt [--stub-missing]
    python tools/framework_sweep.py diffusers
    python tools/framework_sweep.py peft
    python tools/framework_sweep.py torchvision   (torch 2.14.1 + torchvision 0.29.1: DEVELOPERS.md)
    python tools/framework_sweep.py xtransformers

``timm``: every architecture whose name marks a small variant (``tiny``, ``nano``, ``small``,
``resnet18``...), built with ``timm.create_model(name, num_classes=10)``: ``fxinit.check`` (eager
vs ``trace_init`` + ``materialize``, every tensor bit for bit, and the global generator).
``litgpt``: one config per model family, shrunk to 2 layers of width 64, built as litgpt's
``pretrain`` does — ``GPT(config)``, then its own ``initialize_weights`` (``reset_parameters``
replaced per module) on the model — with only the constructor line wrapped in ``trace_init``.
``diffusers``: its main UNets, autoencoders and diffusion transformers from tiny configs (most
taken from diffusers' own tests), each checked whole and materialized child by child in reverse
order. (A sweep of all 150 ``ModelMixin`` classes of diffusers 0.42.1, the configs of its test
suite, found every one equal but ``LuminaNextDiT2DModel``, whose ``pad_token`` is an
uninitialized ``torch.empty``: two eager builds differ, as ``check`` says.)
``peft``: adapters on a tiny Llama, ``get_peft_model`` run on the traced model as on eager's,
then materialized whole, and module by module in reverse; the global RNG compared after. (A
wider sweep of peft 0.21.2 — 30 tuners, five architectures, merges, loading, orders — found
the layout of ``_linalg_svd``'s ``Vh`` and moves to meta: ``capture/layouts.py``,
``capture/doors.py``.)

``torchvision``: every builder of ``torchvision.models`` (but the four over 200M parameters),
``weights=None``, with ``fxinit.check``, then loaded from a plain checkpoint without
``num_batches_tracked`` (as torchvision's own files are) against eager ``load_state_dict``. (A
wider sweep of torchvision 0.29.1 — reverse order, ``dtype=``, forward and backward, device
contexts, FrozenBatchNorm checkpoints, quantization's ``fuse_model`` and QAT — found the two
checkpoint refusals ``checkpoint._filled_by_norms`` and ``_metadata`` now follow.)
``xtransformers``: lucidrains' ``TransformerWrapper`` with one attention-layer flag per model,
whole and child by child in reverse. (A sweep of x-transformers 2.31.10 — 93 configs, its other
wrappers, ten flows each with forward and backward — found one silent difference: a backward
from a closure over a traced model's weight, ``capture.lifted.LiftedWithGrad``.)

Prints one line per model and the totals; exits 1 on any difference or crash (refusals are
counted apart). ``--stub-missing`` stands in empty modules for imports the model code does not
use (``torchvision`` without its C extension where no CPU wheel matches torch, ``lightning``
for litgpt's package ``__init__``); the models themselves are the frameworks' own.
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.abc
import importlib.machinery
import math
import re
import sys
import time
import types
from typing import Any, Callable

import torch

_SMALL = re.compile(r"(atto|femto|pico|nano|tiny|small|mobile|_xs|_xxs|resnet18|resnet10|b0|lcnet_050|_s$|18)")
_STUBBED = ("lightning", "lightning_utilities", "jsonargparse", "tokenizers", "litdata", "torchmetrics",
            "bitsandbytes", "thunder", "psutil", "boto3", "requests", "torchvision")


class _Stubs(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Empty modules for ``_STUBBED`` imports that fail: any attribute is a do-nothing class."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name.split(".")[0] not in _STUBBED:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            try:
                spec = finder.find_spec(name, path, target)
            except (ImportError, AttributeError):
                spec = None
            if spec is not None and name.split(".")[0] != "torchvision":
                return None  # installed: use it
        return importlib.machinery.ModuleSpec(name, self, is_package=True)

    def create_module(self, spec: Any) -> types.ModuleType:
        module = types.ModuleType(spec.name)
        module.__path__ = []

        class Anything(type):  # class attributes too (an enum's members)
            def __getattr__(cls, name: str) -> str:
                if name.startswith("__"):
                    raise AttributeError(name)
                return name

        def attribute(name: str) -> Any:
            if name.startswith("__"):
                raise AttributeError(name)
            return Anything(name, (), {"__init__": lambda self, *a, **k: None, "__bool__": lambda self: False,
                                       "__call__": lambda self, *a, **k: None})

        module.__getattr__ = attribute  # type: ignore[method-assign]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        if module.__name__ == "torchvision.ops.misc":  # timm's one use: a plain nn.Module
            module.FrozenBatchNorm2d = torch.nn.BatchNorm2d  # type: ignore[attr-defined]


def _timm(limit: int) -> list[tuple[str, Callable[[], Any]]]:
    import timm

    names = [n for n in timm.list_models() if _SMALL.search(n)][:limit]
    return [(n, lambda n=n: _check(timm.create_model, n, num_classes=10)) for n in names]


def _litgpt(limit: int) -> list[tuple[str, Callable[[], Any]]]:
    import fxinit
    import litgpt.pretrain as pretrain
    from litgpt.config import Config, configs
    from litgpt.model import GPT

    class Fabric:  # initialize_weights asks only whether the strategy is FSDP's
        strategy = object()

    def small(c: dict) -> dict:
        d: dict[str, Any] = dict(n_layer=2, n_embd=64, n_head=4, block_size=64, padded_vocab_size=128, vocab_size=128)
        groups = c.get("n_query_groups") or 4
        d["n_query_groups"] = 4 if groups >= c.get("n_head", 4) else (2 if groups > 1 else 1)
        for key, value in (("intermediate_size", 128), ("head_size", 16), ("moe_intermediate_size", 32),
                           ("sliding_window_size", 16)):
            if c.get(key):
                d[key] = value
        if c.get("n_expert"):
            d["n_expert"], d["n_expert_per_token"] = min(c["n_expert"], 4), min(c.get("n_expert_per_token", 1), 2)
        return d

    def flow(config: Any) -> str:
        from tests.conftest import compare_modules

        models = []
        for traced in (False, True):
            torch.manual_seed(0)
            model = fxinit.trace_init(GPT, config) if traced else GPT(config)
            pretrain.initialize_weights(Fabric(), model, config.n_layer, config.n_embd)
            if traced:
                fxinit.materialize(model)
            models.append((model, torch.rand(3)))
        errors = compare_modules(models[1][0], models[0][0], "")
        errors += [] if torch.equal(models[0][1], models[1][1]) else ["the global generator differs after the flow"]
        return "equal" if not errors else "different: " + "; ".join(errors[:3])

    families: dict[str, dict] = {}
    for c in configs:
        families.setdefault(c["hf_config"]["org"] + "/" + c["name"].split("-")[0], c)
    return [(c["name"], lambda c=c: flow(Config.from_name(c["name"], **small(c)))) for c in families.values()][:limit]


_DIFFUSERS = {
    "UNet2DConditionModel": dict(block_out_channels=[4, 8], norm_num_groups=4, layers_per_block=1, sample_size=16,
                                 down_block_types=["CrossAttnDownBlock2D", "DownBlock2D"], cross_attention_dim=8,
                                 up_block_types=["UpBlock2D", "CrossAttnUpBlock2D"], attention_head_dim=2,
                                 in_channels=4, out_channels=4),
    "UNet2DModel": dict(block_out_channels=[4, 8], norm_num_groups=2,
                        down_block_types=["DownBlock2D", "AttnDownBlock2D"], up_block_types=["AttnUpBlock2D", "UpBlock2D"],
                        attention_head_dim=3, in_channels=3, out_channels=3, layers_per_block=2, sample_size=32),
    "AutoencoderKL": dict(block_out_channels=[8, 16], in_channels=3, out_channels=3, latent_channels=4,
                          down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                          norm_num_groups=4, layers_per_block=1),
    "VQModel": dict(block_out_channels=[8, 16], norm_num_groups=8, in_channels=3, out_channels=3, latent_channels=3,
                    down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2),
    "ControlNetModel": dict(block_out_channels=(4, 8), layers_per_block=1, in_channels=4, norm_num_groups=2,
                            down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), cross_attention_dim=8,
                            conditioning_embedding_out_channels=(4, 8), attention_head_dim=2),
    "SD3Transformer2DModel": dict(sample_size=32, patch_size=1, in_channels=4, num_layers=4, attention_head_dim=8,
                                  num_attention_heads=4, caption_projection_dim=32, joint_attention_dim=32,
                                  pooled_projection_dim=64, out_channels=4, pos_embed_max_size=96),
    "FluxTransformer2DModel": dict(patch_size=1, in_channels=4, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=[4, 4, 8]),
    "PixArtTransformer2DModel": dict(sample_size=8, num_layers=1, patch_size=2, attention_head_dim=2,
                                     num_attention_heads=2, in_channels=4, cross_attention_dim=8, out_channels=8,
                                     attention_bias=True, activation_fn="gelu-approximate", num_embeds_ada_norm=8,
                                     norm_type="ada_norm_single", norm_elementwise_affine=False, norm_eps=1e-6,
                                     use_additional_conditions=False, caption_channels=None),
    "DiTTransformer2DModel": dict(in_channels=4, out_channels=8, activation_fn="gelu-approximate",
                                  num_attention_heads=2, attention_head_dim=4, attention_bias=True, num_layers=1,
                                  norm_type="ada_norm_zero", num_embeds_ada_norm=8, patch_size=2, sample_size=8),
    "HunyuanDiT2DModel": dict(sample_size=8, patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8,
                              num_attention_heads=2, cross_attention_dim=8, cross_attention_dim_t5=8,
                              pooled_projection_dim=4, hidden_size=16, text_len=4, text_len_t5=4,
                              activation_fn="gelu-approximate"),
    "QwenImageTransformer2DModel": dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2,
                                        attention_head_dim=16, num_attention_heads=4, joint_attention_dim=16,
                                        guidance_embeds=False, axes_dims_rope=[8, 4, 4]),
    "WanTransformer3DModel": dict(patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=12, in_channels=4,
                                  out_channels=4, text_dim=16, freq_dim=256, ffn_dim=32, num_layers=2,
                                  cross_attn_norm=True, qk_norm="rms_norm_across_heads", rope_max_seq_len=32),
}


def _whole_then_children(fn: Callable[..., Any], **config: Any) -> str:
    """``fxinit.check``, then the model materialized child by child in reverse, against eager."""
    whole = _check(fn, **config)
    if whole != "equal":
        return whole
    import fxinit
    from tests.conftest import compare_modules

    torch.manual_seed(0)
    eager = fn(**config)
    torch.manual_seed(0)
    model = fxinit.trace_init(fn, **config)
    for child in reversed(list(model.children())):
        fxinit.materialize(child)
    fxinit.materialize(model)
    errors = compare_modules(model, eager, "")
    return "equal" if not errors else "different (children in reverse): " + "; ".join(errors[:3])


def _diffusers(limit: int) -> list[tuple[str, Callable[[], Any]]]:
    import diffusers

    return [(name, lambda name=name, c=c: _whole_then_children(getattr(diffusers, name), **c))
            for name, c in _DIFFUSERS.items()][:limit]


_XTRANSFORMERS = {  # attention-layer flags (x-transformers 2.31): positions, norms, residuals, memory
    "decoder": {}, "encoder": dict(layer="Encoder"), "rotary": dict(rotary_pos_emb=True),
    "alibi": dict(alibi_pos_bias=True), "rel_pos_bias": dict(rel_pos_bias=True),
    "dynamic_pos_bias": dict(dynamic_pos_bias=True), "ff_glu swish": dict(ff_glu=True, ff_swish=True),
    "memory kv": dict(attn_num_mem_kv=2), "qk_norm": dict(attn_qk_norm=True), "rmsnorm": dict(use_rmsnorm=True),
    "sandwich_norm": dict(sandwich_norm=True), "residual_attn": dict(residual_attn=True),
    "macaron": dict(macaron=True), "shift_tokens": dict(shift_tokens=1), "gate_residual": dict(gate_residual=True),
    "gate_values head_scale": dict(attn_gate_values=True, attn_head_scale=True),
    "scalenorm scale_residual": dict(use_scalenorm=True, scale_residual=True),
    "value residual": dict(add_value_residual=True, learned_value_residual_mix=True), "tied embedding": dict(wrapper=dict(tie_embedding=True)),
    "memory tokens l2norm_embed": dict(wrapper=dict(num_memory_tokens=2, l2norm_embed=True)),
}


def _xtransformers(limit: int) -> list[tuple[str, Callable[[], Any]]]:
    import x_transformers

    def build(layer: str = "Decoder", wrapper: dict | None = None, **flags: Any) -> Any:
        layers = getattr(x_transformers, layer)(dim=32, depth=2, heads=2, attn_dim_head=16, **flags)
        return x_transformers.TransformerWrapper(num_tokens=64, max_seq_len=16, attn_layers=layers, **(wrapper or {}))

    return [(name, lambda c=c: _whole_then_children(build, **c)) for name, c in _XTRANSFORMERS.items()][:limit]


_PEFT = {  # adapter configs (peft 0.21): LoRA's initializations, DoRA (reads the base weight's norm),
    # PiSSA and OLoRA (an SVD and a QR of the base weight), OSF (SVD halves kept apart: the layout of
    # Vh), and the other tuners' own inits
    "LoraConfig": {}, "LoraConfig gaussian": dict(init_lora_weights="gaussian"),
    "LoraConfig rslora": dict(use_rslora=True), "LoraConfig dora": dict(use_dora=True),
    "LoraConfig pissa": dict(init_lora_weights="pissa"), "LoraConfig olora": dict(init_lora_weights="olora"),
    "LoraConfig all-linear": dict(target_modules="all-linear"),
    "IA3Config": dict(target_modules=["k_proj", "down_proj"], feedforward_modules=["down_proj"]),
    "LoHaConfig": {}, "LoKrConfig": {}, "VeraConfig": {}, "BOFTConfig": dict(boft_block_size=4),
    "AdaLoraConfig": dict(total_step=10), "OSFConfig": dict(target_modules=["q_proj", "v_proj"]),
    "OSFConfig init_weights=False": dict(target_modules=["q_proj", "v_proj"], init_weights=False),
}


def _peft(limit: int) -> list[tuple[str, Callable[[], Any]]]:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=128)

    def adapted(traced: bool, adapter: Any, order: str) -> tuple[Any, torch.Tensor]:
        import fxinit

        torch.manual_seed(0)
        base = fxinit.trace_init(LlamaForCausalLM, config) if traced else LlamaForCausalLM(config)
        model = peft.get_peft_model(base, adapter)  # peft's own init steps, on the deferred model
        if traced:
            for child in (reversed(list(model.modules())[1:]) if order == "reverse" else ()):
                fxinit.materialize(child)
            fxinit.materialize(model)
        return model, torch.rand(3)

    def both(name: str, kwargs: dict) -> str:
        from tests.conftest import compare_modules, same_bits

        cls = getattr(peft, name.split()[0])
        kwargs = {"target_modules": ["q_proj", "v_proj", "up_proj"], **kwargs} if "target_modules" in \
            cls.__dataclass_fields__ and "target_modules" not in kwargs else kwargs
        eager, eager_rng = adapted(False, cls(**kwargs), "whole")
        for order in ("whole", "reverse"):
            model, rng = adapted(True, cls(**kwargs), order)
            errors = compare_modules(model, eager, "") + ([] if same_bits(rng, eager_rng) else ["the global RNG"])
            if errors:
                return f"different ({order}): " + "; ".join(errors[:3])
        return "equal"

    return [(name, lambda name=name, c=c: both(name, c)) for name, c in _PEFT.items()][:limit]


_TORCHVISION_HUGE = {"regnet_y_128gf", "vit_h_14", "vit_l_16", "vit_l_32"}  # over 200M parameters


def _torchvision(limit: int) -> list[tuple[str, Callable[[], Any]]]:
    import inspect

    import torchvision

    def builder(name: str) -> Callable[[], Any]:
        accepts = inspect.signature(torchvision.models.get_model_builder(name)).parameters
        kwargs = {k: v for k, v in (("num_classes", 10), ("weights_backbone", None)) if k in accepts}
        return functools.partial(torchvision.models.get_model, name, weights=None, **kwargs)

    def both(name: str) -> str:
        build = builder(name)
        whole = _check(build)
        if whole != "equal":
            return whole
        import fxinit
        from tests.conftest import compare_modules

        # a checkpoint as torchvision's own files are: a plain dict without num_batches_tracked
        torch.manual_seed(1)
        sd = {k: v for k, v in build().state_dict().items() if not k.endswith("num_batches_tracked")}
        torch.manual_seed(0)
        eager = build()
        try:
            eager.load_state_dict(sd)
        except (RuntimeError, ValueError):
            return "equal"  # eager refuses that checkpoint (MNASNet asks for its version)
        torch.manual_seed(0)
        model = fxinit.trace_init(build)
        fxinit.materialize(model, state_dict=sd)
        errors = compare_modules(model, eager, "")
        return "equal" if not errors else "different (checkpoint): " + "; ".join(errors[:3])

    names = [n for n in torchvision.models.list_models() if n not in _TORCHVISION_HUGE]
    return [(n, lambda n=n: both(n)) for n in names][:limit]


def _check(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> str:
    import fxinit

    report = fxinit.check(fn, *args, **kwargs)
    return report.status if report.ok or report.status == "refused" else "different: " + str(report).splitlines()[0]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("framework", choices=["timm", "litgpt", "diffusers", "peft", "torchvision", "xtransformers"])
    parser.add_argument("--limit", type=int, default=400)
    parser.add_argument("--stub-missing", action="store_true")
    args = parser.parse_args(argv)
    if args.stub_missing:
        sys.meta_path.insert(0, _Stubs())
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent.parent))
    cases = {"timm": _timm, "litgpt": _litgpt, "diffusers": _diffusers, "peft": _peft,
             "torchvision": _torchvision, "xtransformers": _xtransformers}[args.framework](args.limit)
    counts: collections.Counter[str] = collections.Counter()
    started = time.perf_counter()
    for name, run in cases:
        t0 = time.perf_counter()
        try:
            status = run()
        except Exception as exc:  # noqa: BLE001 - counted and shown
            status = f"crash: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
        counts[status.split(":")[0]] += 1
        print(f"{name:48s} {time.perf_counter() - t0:6.1f}s  {status}", flush=True)
    total = sum(counts.values())
    print(f"{args.framework}: {total} models in {math.ceil(time.perf_counter() - started)} s: "
          + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    return 0 if counts["equal"] + counts["refused"] == total else 1


if __name__ == "__main__":
    sys.exit(main())
