"""Checkpoint-aware materialization: what the checkpoint has is read, never initialized;
the rest initializes exactly as eager construction followed by load_state_dict."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxinit
import fxinit.execute as execute
import fxinit.checkpoint as checkpoint_module
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
    """Every node the interpreter runs (the nodes of every plan run)."""
    ran: list = []
    real = execute.run

    def spy(program, plan, *args, **kwargs):
        ran.extend(plan.nodes)
        return real(program, plan, *args, **kwargs)

    monkeypatch.setattr(execute, "run", spy)
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
    assert not any(n.meta.get("generators") for n in executed)  # ...but no parameter is initialized
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


def test_non_persistent_buffers_are_not_read_as_load_state_dict_does() -> None:
    """Older checkpoints hold RoPE ``inv_freq``, now a non-persistent buffer: load_state_dict
    ignores it (and strict=True calls it unexpected), and so does materialize."""
    state = _checkpoint()
    stale = dict(state, **{"model.rotary_emb.inv_freq": torch.full((4,), 7.0)})
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    with pytest.raises(DeferredInitError, match=r"unexpected key\(s\) \['model.rotary_emb.inv_freq'\]"):
        fxinit.materialize(m, state_dict=stale)  # strict by default, as load_state_dict
    keys = fxinit.materialize(m, state_dict=stale, strict=False)
    assert (keys.missing_keys, keys.unexpected_keys) == ([], ["model.rotary_emb.inv_freq"])
    _assert_equal_to(m, _eager_then_load(state))
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    fxinit.materialize(m, state_dict=state, strict=True)  # lacks no buffer load_state_dict would read
    _assert_equal_to(m, _eager_then_load(state))


def _save_pretrained_shards(state: dict[str, torch.Tensor], directory: Path) -> Path:
    """``save_pretrained`` of a model holding ``state``, in several shards with an index."""
    donor = _llama()
    donor.load_state_dict(state)
    donor.save_pretrained(directory, max_shard_size="20KB")
    assert len(list(directory.glob("model-*.safetensors"))) > 2
    return directory


@pytest.mark.parametrize("form", ["directory", "index", "shard list"])
def test_sharded_checkpoint(tmp_path: Path, form: str, executed: list) -> None:
    state = _checkpoint()
    directory = _save_pretrained_shards(state, tmp_path)
    source: object = {"directory": directory, "index": directory / "model.safetensors.index.json",
                      "shard list": sorted(directory.glob("model-*.safetensors"))}[form]
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    fxinit.materialize(m, state_dict=source, strict=True)
    assert not any(n.meta.get("generators") for n in executed)  # every parameter came from the shards
    _assert_equal_to(m, _eager_then_load(state))


def test_torch_save_shards_with_an_index(tmp_path: Path) -> None:
    """The ``pytorch_model.bin.index.json`` layout, half of it missing: the rest initializes."""
    state = _checkpoint(drop=("model.layers.1.",))
    names = sorted(state)
    shards = {"pytorch_model-00001-of-00002.bin": names[: len(names) // 2],
              "pytorch_model-00002-of-00002.bin": names[len(names) // 2:]}
    for shard, keys in shards.items():
        torch.save({k: state[k] for k in keys}, tmp_path / shard)
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (tmp_path / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    fxinit.materialize(m, state_dict=tmp_path, strict=False)
    _assert_equal_to(m, _eager_then_load(state))


@pytest.mark.parametrize("layout", ["one file", "shards with an index"])
def test_a_diffusers_save_pretrained_directory(tmp_path: Path, layout: str) -> None:
    """diffusers names its files ``diffusion_pytorch_model*``: its directory is read as well."""
    from safetensors.torch import save_file

    state = _checkpoint()
    if layout == "one file":
        save_file({k: v.clone() for k, v in state.items()}, tmp_path / "diffusion_pytorch_model.safetensors")
    else:
        names = sorted(state)
        shards = {"diffusion_pytorch_model-00001-of-00002.safetensors": names[: len(names) // 2],
                  "diffusion_pytorch_model-00002-of-00002.safetensors": names[len(names) // 2:]}
        for shard, keys in shards.items():
            save_file({k: state[k].clone() for k in keys}, tmp_path / shard)
        (tmp_path / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {k: shard for shard, keys in shards.items() for k in keys}}))
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    fxinit.materialize(m, state_dict=tmp_path, strict=True)
    _assert_equal_to(m, _eager_then_load(state))


def test_only_the_shards_holding_requested_tensors_are_opened(tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    state = _checkpoint()
    directory = _save_pretrained_shards(state, tmp_path)
    weight_map = json.loads((directory / "model.safetensors.index.json").read_text())["weight_map"]
    opened: list[str] = []
    real_open = checkpoint_module._Part._open

    def spy(part):  # noqa: ANN001
        if part.path is not None and part._file is None and part._dict is None:
            opened.append(part.path.name)
        real_open(part)

    monkeypatch.setattr(checkpoint_module._Part, "_open", spy)
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    fxinit.materialize(m.model.layers[0], state_dict=directory, prefix="model.layers.0.")
    wanted = {shard for k, shard in weight_map.items() if k.startswith("model.layers.0.")}
    assert sorted(opened) == sorted(wanted)
    assert len(wanted) < len(set(weight_map.values()))
    assert torch.equal(m.model.layers[0].mlp.up_proj.weight, state["model.layers.0.mlp.up_proj.weight"])
    assert fxinit.is_deferred(m.model.layers[1])


def test_sharded_checkpoint_errors_are_clear(tmp_path: Path) -> None:
    state = _checkpoint()
    directory = _save_pretrained_shards(state, tmp_path / "ckpt")
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    shards = sorted(directory.glob("model-*.safetensors"))
    with pytest.raises(DeferredInitError, match="is in both"):
        fxinit.materialize(m, state_dict=[shards[0], shards[0]])
    shards[-1].unlink()
    with pytest.raises(DeferredInitError, match=f"names {shards[-1].name}, which does not exist"):
        fxinit.materialize(m, state_dict=directory)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DeferredInitError, match="has none of model.safetensors.index.json"):
        fxinit.materialize(m, state_dict=tmp_path / "empty")
    (tmp_path / "bad.index.json").write_text("{}")
    with pytest.raises(DeferredInitError, match="cannot read checkpoint index"):
        fxinit.materialize(m, state_dict=tmp_path / "bad.index.json")
    assert fxinit.is_deferred(m.model.norm)  # nothing was half done


def test_trace_of_from_pretrained_defers_what_the_checkpoint_lacks_exactly(tmp_path: Path) -> None:
    """transformers builds the skeleton on meta, loads what the checkpoint has and initializes
    the rest: under trace_init the rest is deferred, and equals eager from_pretrained's."""
    torch.manual_seed(123)
    _llama().save_pretrained(tmp_path)
    ckpt = tmp_path / "model.safetensors"
    kept = {k: v for k, v in safetensors_torch.load_file(ckpt).items() if not k.startswith("model.layers.1.mlp.")}
    safetensors_torch.save_file(kept, ckpt, metadata={"format": "pt"})
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path)
    ref_state = torch.get_rng_state()
    torch.manual_seed(0)
    m = fxinit.trace_init(transformers.LlamaForCausalLM.from_pretrained, tmp_path)
    assert torch.equal(torch.get_rng_state(), ref_state)
    deferred = sorted(k for k, v in m.state_dict().items() if fxinit.is_deferred(v))
    assert [k for k in deferred if "rotary" not in k] == sorted(
        f"model.layers.1.mlp.{p}_proj.weight" for p in ("down", "gate", "up"))
    fxinit.materialize(m)
    _assert_equal_to(m, ref)


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
    keys = fxinit.materialize(m, state_dict=state, strict=False)
    assert keys == ref.load_state_dict(state, strict=False)
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


def test_checkpoints_are_strict_by_default_and_name_the_prefix_that_explains_them() -> None:
    """A DDP checkpoint (``module.`` on every key) loads nothing into a bare model: refused,
    with both lists and the prefix that fixes it; strict=False returns load_state_dict's result."""
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    state = _checkpoint()
    ddp = {f"module.{k}": v for k, v in state.items()}
    with pytest.raises(DeferredInitError, match=r"(?s)missing key.*unexpected key.*prefix='module\.'"):
        fxinit.materialize(m, state_dict=ddp)
    assert fxinit.is_deferred(m)
    fxinit.materialize(m, state_dict=ddp, prefix="module.")
    _assert_equal_to(m, _eager_then_load(state))
    torch.manual_seed(0)
    m = fxinit.trace_init(_llama)
    ref = _llama()
    got = fxinit.materialize(m, state_dict=dict(state, extra=torch.ones(1)), strict=False)
    assert got == ref.load_state_dict(dict(state, extra=torch.ones(1)), strict=False)


class _KeepsExtraState(nn.Linear):
    """A layer with extra state in its ``state_dict`` (``<name>._extra_state``), as
    megatron-core's parallel linears and Transformer Engine's layers have."""

    def __init__(self) -> None:
        super().__init__(3, 3)
        self.amax: Any = None

    def get_extra_state(self) -> Any:
        return self.amax

    def set_extra_state(self, state: Any) -> None:
        self.amax = state


class _WithExtraState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = _KeepsExtraState()
        self.b = nn.Linear(3, 2)


def test_a_modules_extra_state_in_a_checkpoint_loads_as_load_state_dict_loads_it() -> None:
    """Found by a sweep of megatron-core: its checkpoints' ``_extra_state`` keys were refused
    as unexpected, and with ``strict=False`` the modules' ``set_extra_state`` never ran."""
    torch.manual_seed(1)
    source = _WithExtraState()
    source.a.amax = {"amax": 2.5}
    state = source.state_dict()
    assert "a._extra_state" in state
    torch.manual_seed(0)
    eager = _WithExtraState()
    eager.load_state_dict(state)
    torch.manual_seed(0)
    m = fxinit.trace_init(_WithExtraState)
    assert fxinit.materialize(m, state_dict=state) is m
    assert m.a.amax == {"amax": 2.5} and all(same_bits(x, y) for x, y in zip(m.parameters(), eager.parameters()))

    tensors_only = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(RuntimeError, match="a._extra_state"):
        _WithExtraState().load_state_dict(tensors_only)
    m = fxinit.trace_init(_WithExtraState)
    with pytest.raises(DeferredInitError, match=r"1 missing key\(s\) \['a._extra_state'\], 0 unexpected"):
        fxinit.materialize(m, state_dict=tensors_only)
    keys = fxinit.materialize(m, state_dict=tensors_only, strict=False)
    assert tuple(keys) == tuple(_WithExtraState().load_state_dict(tensors_only, strict=False)) and m.a.amax is None


def test_extra_state_is_left_out_of_exports_and_said_so(tmp_path: Path) -> None:
    """fxinit's checkpoints hold the model's tensors; a module's extra state is not one. A
    module with its own ``_save_to_state_dict`` beside it no longer makes the export refuse."""
    class Router(nn.Linear):
        def _save_to_state_dict(self, *args: Any, **kwargs: Any) -> None:
            super()._save_to_state_dict(*args, **kwargs)

    class M(_WithExtraState):
        def __init__(self) -> None:
            super().__init__()
            self.router = Router(3, 2)

    torch.manual_seed(0)
    m = fxinit.trace_init(M)
    assert list(fxinit.init_graph(m).outputs) == ["a.weight", "a.bias", "b.weight", "b.bias", "router.weight",
                                                  "router.bias"]
    with pytest.warns(UserWarning, match=r"the extra state of 1 module\(s\) \(a._extra_state: get_extra_state\)"):
        fxinit.save(m, tmp_path / "m.safetensors", format="safetensors")
    torch.manual_seed(0)
    eager = M()
    saved = safetensors_torch.load_file(tmp_path / "m.safetensors")
    assert sorted(saved) == sorted(k for k in eager.state_dict() if not k.endswith("_extra_state"))
    assert all(same_bits(saved[k], v) for k, v in eager.state_dict().items() if k in saved)


class _Fused(nn.Module):
    """torchtune's ``FusionLayer``: its ``state_dict`` drops ``layer.`` from the keys of the
    layer it wraps, and a load pre-hook puts it back."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 3)
        self.gate = nn.Linear(3, 1)
        self._register_state_dict_hook(_Fused._drop)
        self._register_load_state_dict_pre_hook(_Fused._put_back, with_module=True)

    @staticmethod
    def _drop(module: nn.Module, state: dict, prefix: str, *args: Any) -> None:
        for key in [k for k in state if k.startswith(prefix + "layer.")]:
            state[prefix + key[len(prefix + "layer."):]] = state.pop(key)

    def _put_back(self, state: dict, prefix: str, *args: Any) -> None:
        for key in [k for k in state if k.startswith(prefix) and k[len(prefix):] in ("weight", "bias")]:
            state[prefix + "layer." + key[len(prefix):]] = state.pop(key)


def test_a_model_whose_load_hooks_rename_keys_loads_by_its_own_code(tmp_path: Path) -> None:
    """Found by a sweep of torchtune (its fusion layers, Llama 3.2 Vision): fxinit read the
    checkpoint by module path, so with ``strict=False`` the renamed tensors initialized where
    eager's ``load_state_dict`` loads them (and ``strict=True`` refused). Such a model runs
    its own ``load_state_dict`` on the deferred model, recorded, then materializes."""
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fused = _Fused()
            self.head = nn.Linear(3, 2)

    torch.manual_seed(1)
    state = M().state_dict()
    assert "fused.weight" in state and "fused.layer.weight" not in state
    torch.manual_seed(0)
    eager = M()
    eager.load_state_dict(state)
    for strict in (True, False):
        torch.manual_seed(0)
        m = fxinit.trace_init(M)
        got = fxinit.materialize(m, state_dict=state, strict=strict)
        assert got is m if strict else (got.missing_keys, got.unexpected_keys) == ([], [])
        assert all(same_bits(a, b) for a, b in zip(m.state_dict().values(), eager.state_dict().values()))
    partial = {k: v for k, v in state.items() if not k.startswith("head.")}
    torch.manual_seed(0)
    m = fxinit.trace_init(M)
    keys = fxinit.materialize(m, state_dict=partial, strict=False)
    torch.manual_seed(0)
    want = M().load_state_dict(partial, strict=False)
    assert (keys.missing_keys, keys.unexpected_keys) == (want.missing_keys, want.unexpected_keys) == (
        ["head.weight", "head.bias"], [])
    with pytest.raises(DeferredInitError, match="as its own load_state_dict says"):
        fxinit.materialize(fxinit.trace_init(M), state_dict=partial)
    with pytest.raises(DeferredInitError, match=r"init=False, state_dict=.*\(fused\)"):
        fxinit.materialize(fxinit.trace_init(M), state_dict=state, init=False)


def _conv_bn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))


def test_a_norm_checkpoint_older_than_num_batches_tracked_loads_as_eagers() -> None:
    """torchvision's ImageNet files (and any plain dict without ``_metadata``) lack
    ``num_batches_tracked``: ``_NormBase`` fills it in with its own value when the module's
    version in the checkpoint is below 2 or absent, so eager's strict load accepts it; fxinit
    refused it as missing (found by a sweep of torchvision's models)."""
    torch.manual_seed(1)
    full = _conv_bn().state_dict()
    old = {k: v for k, v in full.items() if "num_batches_tracked" not in k}
    for strict in (True, False):
        torch.manual_seed(0)
        eager = _conv_bn()
        want = eager.load_state_dict(dict(old), strict=strict)
        torch.manual_seed(0)
        m = fxinit.trace_init(_conv_bn)
        got = fxinit.materialize(m, state_dict=dict(old), strict=strict)
        assert want.missing_keys == [] and (strict or got.missing_keys == [])
        assert all(same_bits(a, b) for a, b in zip(m.state_dict().values(), eager.state_dict().values()))
    versioned = type(full)(old)
    versioned._metadata = full._metadata  # version 2: the key is missing, in eager too
    torch.manual_seed(0)
    want = _conv_bn().load_state_dict(versioned, strict=False)
    got = fxinit.materialize(fxinit.trace_init(_conv_bn), state_dict=versioned, strict=False)
    assert got.missing_keys == want.missing_keys == ["1.num_batches_tracked"]


class _Versioned(nn.Module):
    """Reads its version from the checkpoint's metadata, as torchvision's MNASNet does."""

    _version = 2

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(2, 2)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, *args) -> None:  # noqa: ANN001
        if local_metadata.get("version") != 2:
            raise ValueError(f"version {local_metadata.get('version')}")
        super()._load_from_state_dict(state_dict, prefix, local_metadata, *args)


def test_a_models_own_loading_reads_the_checkpoints_metadata() -> None:
    """A model that loads by its own code got the checkpoint's entries without ``_metadata``,
    and its ``_load_from_state_dict`` raised where eager's loads."""
    torch.manual_seed(1)
    sd = nn.Sequential(_Versioned()).state_dict()
    torch.manual_seed(0)
    eager = nn.Sequential(_Versioned())
    eager.load_state_dict(sd)
    torch.manual_seed(0)
    m = fxinit.trace_init(lambda: nn.Sequential(_Versioned()))
    fxinit.materialize(m, state_dict=sd)
    assert same_bits(m[0].lin.weight, eager[0].lin.weight) and same_bits(m[0].lin.weight, sd["0.lin.weight"])
    inner = fxinit.trace_init(_Versioned)  # under a prefix: the metadata under it, relative to it
    fxinit.materialize(inner, state_dict=sd, prefix="0.")
    assert same_bits(inner.lin.weight, sd["0.lin.weight"])
