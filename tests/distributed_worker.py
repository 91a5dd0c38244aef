"""Worker processes for tests/test_distributed.py (gloo, CPU): each scenario returns a list
of failures, empty when every rank's tensors match eager construction bit for bit."""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

import fxinit
from tests.launch import serve


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 16, padding_idx=0)
        self.layers = nn.Sequential(*[nn.Linear(16, 16) for _ in range(3)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 7)
        nn.init.trunc_normal_(self.head.weight, std=0.02)
        self.register_buffer("scale", torch.arange(16).float() / 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.emb(x)) * self.scale))


def llama(tied: bool = False) -> nn.Module:
    import transformers

    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=61, tie_word_embeddings=tied)
    return transformers.LlamaForCausalLM(cfg)


def tied_llama() -> nn.Module:
    return llama(tied=True)


class Simple(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(37, 8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.emb(x))


def _full(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        out[name] = t.full_tensor() if hasattr(t, "full_tensor") else t
    return {k: v.detach().clone() for k, v in out.items()}


def _ties(model: nn.Module) -> list[str]:
    """Names of parameters that are one object under several names."""
    seen: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        seen.setdefault(id(p), []).append(name)
    return sorted("=".join(v) for v in seen.values() if len(v) > 1)


def _compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> list[str]:
    errors = [f"{what}: names differ {sorted(set(got) ^ set(want))[:4]}"] if got.keys() != want.keys() else []
    errors += [f"{what}: {k} differs" for k in want if k in got and not torch.equal(got[k], want[k])]
    return errors


def _fsdp2(model: nn.Module, blocks: Callable[[nn.Module], list[nn.Module]]) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    for b in blocks(model):
        fully_shard(b)
    fully_shard(model)
    return model


def _step(model: nn.Module, vocab: int) -> None:
    torch.manual_seed(1234)
    x = torch.randint(1, vocab, (3, 5))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = model(x)
    loss = (out.logits if hasattr(out, "logits") else out).float().pow(2).mean()
    loss.backward()
    opt.step()


def fsdp2_exact(factory: Callable[[], nn.Module], blocks, vocab: int) -> list[str]:
    torch.manual_seed(0)
    eager = _fsdp2(factory(), blocks)
    torch.manual_seed(0)
    model = fxinit.trace_init(factory)
    _fsdp2(model, blocks)
    errors = [] if fxinit.is_deferred(model) else ["not deferred after fully_shard"]
    fxinit.materialize(model)
    errors += [] if not fxinit.is_deferred(model) else ["still deferred after materialize"]
    errors += [] if _ties(model) == _ties(eager) else [f"ties differ: {_ties(model)} vs {_ties(eager)}"]
    errors += _compare(_full(model), _full(eager), "fsdp2 exact")
    _step(eager, vocab)
    _step(model, vocab)
    errors += _compare(_full(model), _full(eager), "fsdp2 exact after a training step")
    return errors


def fsdp2_piecewise(factory: Callable[[], nn.Module], blocks, vocab: int) -> list[str]:
    """Materialized module by module, leaves first, and tensor by tensor, last first: a weight
    tied across modules stays one parameter, and ``materialize(dtensor)`` fills that object
    (a sweep found the tie split in two, and the DTensor left deferred without a word)."""
    torch.manual_seed(0)
    eager = _fsdp2(factory(), blocks)
    errors = []
    for how in ("modules", "tensors"):
        torch.manual_seed(0)
        model = _fsdp2(fxinit.trace_init(factory), blocks)
        held = [t for _, t in [*model.named_parameters(), *model.named_buffers()]]
        for piece in reversed(list(model.modules()) if how == "modules" else held):
            if how == "tensors":
                assert fxinit.materialize(piece) is piece and not fxinit.is_deferred(piece)
            else:
                fxinit.materialize(piece)
        errors += [] if not fxinit.is_deferred(model) else [f"{how}: still deferred"]
        errors += [] if _ties(model) == _ties(eager) else [f"{how}: ties differ: {_ties(model)} vs {_ties(eager)}"]
        errors += _compare(_full(model), _full(eager), f"fsdp2 {how}")
        _step(model, vocab)
        if how == "tensors":
            _step(eager, vocab)
            errors += _compare(_full(model), _full(eager), f"fsdp2 {how} after a training step")
    return errors


def fsdp2_under_hf_guard() -> list[str]:
    """transformers' ``initialize_weights`` runs init functions under its
    ``guard_torch_init_functions``, which puts its own ``normal_`` in ``torch.nn.init``; torch's
    hands that to ``__torch_function__``, where fxinit knew only torch's by its module and
    refused a sharded meta model's init (a sweep of RL-trainer flows). It acts on the global
    tensor now, as ``nn.init.normal_`` itself does."""
    from transformers.initialization import guard_torch_init_functions

    def init(model: nn.Module, guarded: bool) -> dict[str, torch.Tensor]:
        _fsdp2(model, lambda m: list(m.layers))
        with torch.no_grad(), (guard_torch_init_functions() if guarded else contextlib.nullcontext()):
            for p in model.parameters():
                torch.nn.init.normal_(p, std=0.02)
        fxinit.materialize(model)
        return _full(model)

    torch.manual_seed(0)
    want = init(fxinit.trace_init(Net), guarded=False)
    torch.manual_seed(0)
    return _compare(init(fxinit.trace_init(Net), guarded=True), want, "fsdp2 under transformers' guard")


def fsdp2_bf16(factory: Callable[[], nn.Module], blocks, vocab: int) -> list[str]:
    """``materialize(dtype=bfloat16)`` on a sharded model == eager, ``.to(bfloat16)``, then sharded."""
    torch.manual_seed(0)
    eager = _fsdp2(factory().to(torch.bfloat16), blocks)
    torch.manual_seed(0)
    model = _fsdp2(fxinit.trace_init(factory), blocks)
    fxinit.materialize(model, dtype=torch.bfloat16)
    errors = _compare(_full(model), _full(eager), "fsdp2 bfloat16")
    errors += [f"{n} is {p.dtype}" for n, p in model.named_parameters() if p.dtype != torch.bfloat16]
    _step(eager, vocab)
    _step(model, vocab)
    return errors + _compare(_full(model), _full(eager), "fsdp2 bfloat16 after a training step")


def fsdp2_checkpoint(factory: Callable[[], nn.Module], blocks, rank: int) -> list[str]:
    """``materialize(state_dict=file)`` on a sharded model: each rank reads its part of the
    tensors the checkpoint has and initializes the rest exactly, as eager construction +
    ``load_state_dict(strict=False)`` + ``fully_shard`` would."""
    import tempfile

    from safetensors.torch import save_file

    torch.manual_seed(7)
    ckpt = {k: v.contiguous() for k, v in factory().state_dict().items()}
    dropped = sorted(ckpt)[len(ckpt) // 2]  # one tensor the checkpoint lacks: initialized instead
    del ckpt[dropped]
    torch.manual_seed(0)
    reference = factory()
    reference.load_state_dict(ckpt, strict=False)
    want = _full(_fsdp2(reference, blocks))
    with tempfile.TemporaryDirectory() as d:
        path = f"{d}/rank{rank}.safetensors"
        save_file(ckpt, path)
        torch.manual_seed(0)
        model = _fsdp2(fxinit.trace_init(factory), blocks)
        keys = fxinit.materialize(model, state_dict=path, strict=False)  # partial, as load_state_dict(strict=False)
    errors = [] if keys.missing_keys == [dropped] and not keys.unexpected_keys else [f"incompatible keys {keys}"]
    return errors + _compare(_full(model), want, f"fsdp2 checkpoint (without {dropped})")


def fsdp2_dcp_load(factory: Callable[[], nn.Module], blocks, vocab: int) -> list[str]:
    """torch.distributed.checkpoint's ``set_model_state_dict`` with a full state dict (rank 0's
    broadcast, or every rank's own) lacking one tensor, into a sharded traced model, then
    ``materialize`` for the rest: as into eager's sharded model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    torch.manual_seed(7)
    ckpt = {k: v.contiguous() for k, v in factory().state_dict().items()}
    del ckpt[sorted(ckpt)[len(ckpt) // 2]]
    errors = []
    for broadcast in (False, True):
        options = StateDictOptions(full_state_dict=True, strict=False, broadcast_from_rank0=broadcast)
        models = []
        for trace in (False, True):
            torch.manual_seed(0)
            model = _fsdp2(fxinit.trace_init(factory) if trace else factory(), blocks)
            set_model_state_dict(model, dict(ckpt) if not broadcast or dist.get_rank() == 0 else {}, options=options)
            if trace:
                fxinit.materialize(model)
            models.append(model)
        what = f"fsdp2 set_model_state_dict (broadcast_from_rank0={broadcast})"
        errors += _compare(_full(models[1]), _full(models[0]), what)
        for model in models:
            _step(model, vocab)
        errors += _compare(_full(models[1]), _full(models[0]), what + " after a training step")
    return errors


def fsdp2_portable(factory: Callable[[], nn.Module], blocks) -> tuple[list[str], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = fxinit.trace_init(factory)
    _fsdp2(model, blocks)
    fxinit.materialize(model, rng="portable")
    return [], _full(model)


def fsdp1(factory: Callable[[], nn.Module], auto_wrap: bool, how: str, mixed: bool) -> list[str]:
    """``how``: ``"param_init_fn"`` (FSDP calls fxinit.materialize_module), ``"own_init_fn"``
    (any other ``param_init_fn``, which eager's FSDP never calls on a built model), ``"meta"``
    (built under ``torch.device("meta")``: FSDP's own ``to_empty`` + ``reset_parameters``),
    ``"meta_init_fn"`` (the same, with a ``param_init_fn``), ``"idiom"``
    (torchdistX's documented ``FSDP(deferred_init(M), ...)``, nothing else) or
    ``"materialized"`` (materialize first, then wrap: the plain way)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import MixedPrecision
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy

    options = dict(auto_wrap_policy=ModuleWrapPolicy({nn.Linear}) if auto_wrap else None,
                   device_id=torch.device("cpu"),
                   mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                   if mixed else None)
    meta = torch.device("meta") if how.startswith("meta") else contextlib.nullcontext()
    init_fn = _reset_on_cpu if how == "meta_init_fn" else None
    torch.manual_seed(0)
    with meta:  # built on meta: FSDP gives each unit values (its param_init_fn, or to_empty + reset_parameters)
        built = factory()
    eager = FSDP(built, param_init_fn=init_fn, **options)
    torch.manual_seed(0)
    with meta:
        model = fxinit.deferred_init(factory)
    if how == "meta_init_fn":
        wrapped = FSDP(model, param_init_fn=init_fn, **options)
    elif how == "param_init_fn":
        wrapped = FSDP(model, param_init_fn=fxinit.materialize_module, **options)
    elif how == "own_init_fn":  # a framework's (composer's) or torch's documented one: eager never calls it
        wrapped = FSDP(model, param_init_fn=_reset_on_cpu, **options)
    elif how in ("idiom", "meta"):
        wrapped = FSDP(model, **options)
    else:
        wrapped = FSDP(fxinit.materialize(model), **options)
    what = f"fsdp1 {factory.__name__} auto_wrap={auto_wrap} {how} mixed={mixed}"
    errors = []
    with FSDP.summon_full_params(wrapped), FSDP.summon_full_params(eager):
        errors += _compare(dict(wrapped.named_parameters()), dict(eager.named_parameters()), what)
    _step(eager, 37)
    _step(wrapped, 37)
    with FSDP.summon_full_params(wrapped), FSDP.summon_full_params(eager):
        errors += _compare({k: v.clone() for k, v in wrapped.named_parameters()},
                           {k: v.clone() for k, v in eager.named_parameters()}, what + " after a step")
    return errors


def _reset_on_cpu(module: nn.Module) -> None:
    """FSDP1's documented ``param_init_fn`` for modules built on meta."""
    module.to_empty(device=torch.device("cpu"), recurse=False)
    if hasattr(module, "reset_parameters"):
        module.reset_parameters()


def fsdp1_wrap_in_constructor() -> list[str]:
    """FSDP1's manual wrapping (``enable_wrap`` + ``wrap`` inside ``__init__``) builds flat
    parameters while the capture is on: refused, with a way out."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp.wrap import enable_wrap, wrap

    class Wrapped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = wrap(nn.Linear(4, 4))
            self.head = nn.Linear(4, 2)

    with enable_wrap(wrapper_cls=FSDP, device_id=torch.device("cpu")):
        try:
            fxinit.trace_init(Wrapped)
        except fxinit.DeferredInitError as exc:
            return [] if "auto_wrap_policy" in str(exc) else [f"fsdp1 wrap in __init__: unclear refusal {exc}"]
    return ["fsdp1 wrap in __init__: not refused"]


def pipeline_stage(rank: int, world: int) -> list[str]:
    torch.manual_seed(0)
    eager = _full(Net())
    torch.manual_seed(0)
    model = fxinit.trace_init(Net)
    stage = model.layers[rank % len(model.layers)]
    fxinit.materialize(stage)
    errors = [] if fxinit.is_deferred(model) else ["the other stages were materialized too"]
    prefix = f"layers.{rank % len(model.layers)}."
    got = {prefix + k: v for k, v in stage.state_dict().items()}
    errors += _compare(got, {k: v for k, v in eager.items() if k.startswith(prefix)}, "pipeline stage")
    return errors


def run(rank: int, world: int, port: int, scenarios: list[str], queue: Any) -> None:
    serve(rank, world, port, queue, lambda: {name: _scenario(name, rank, world) for name in scenarios})


def _scenario(name: str, rank: int, world: int) -> Any:
    llama_blocks = lambda m: list(m.model.layers)  # noqa: E731
    net_blocks = lambda m: list(m.layers)  # noqa: E731
    if name == "fsdp2_exact":
        return (fsdp2_exact(Net, net_blocks, 37) + fsdp2_exact(llama, llama_blocks, 61)
                + fsdp2_exact(tied_llama, llama_blocks, 61))
    if name == "fsdp2_piecewise":
        return (fsdp2_piecewise(tied_llama, llama_blocks, 61) + fsdp2_piecewise(Net, net_blocks, 37)
                + fsdp2_under_hf_guard())
    if name == "fsdp2_bf16":
        return fsdp2_bf16(llama, llama_blocks, 61) + fsdp2_bf16(tied_llama, llama_blocks, 61)
    if name == "fsdp2_checkpoint":
        return fsdp2_checkpoint(llama, llama_blocks, rank) + fsdp2_checkpoint(Net, net_blocks, rank)
    if name == "fsdp2_dcp_load":
        return fsdp2_dcp_load(llama, llama_blocks, 61) + fsdp2_dcp_load(Net, net_blocks, 37)
    if name == "fsdp2_portable":
        return {"net": fsdp2_portable(Net, net_blocks)[1], "llama": fsdp2_portable(llama, llama_blocks)[1]}
    if name == "fsdp1":
        hows = ("param_init_fn", "own_init_fn", "idiom", "materialized")
        errors = [e for f in (Simple, Net) for aw in (True, False) for how in hows
                  for e in fsdp1(f, aw, how, mixed=False)]
        errors += [e for aw in (True, False) for how in ("meta", "meta_init_fn")
                   for e in fsdp1(Simple, aw, how, mixed=False)]
        errors += fsdp1_wrap_in_constructor()
        return errors + [e for how in hows for e in fsdp1(Simple, True, how, mixed=True)]  # CPU layer_norm has no bf16 mixed mode
    if name == "pipeline":
        return pipeline_stage(rank, world)
    raise KeyError(name)
