"""Every module class of ``torch.nn`` that owns parameters or buffers, traced and materialized,
must equal eager construction bit for bit (values, layout, ties, RNG state).

The classes are found by walking ``torch.nn.modules``; ``test_every_nn_module_class_is_classified``
fails as soon as a torch version adds a module class that none of the tables below mentions,
so a new module never goes silently untested.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil
import warnings

import pytest
import torch
import torch.nn as nn

import fxinit
from conftest import assert_modules_equal, assert_same_as_eager, named_tensors, rng_state, same_bits


def _x(*shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A deterministic input that draws no random numbers."""
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n, dtype=torch.float64).reshape(shape) * 0.37).sin().to(dtype)


def _idx(*shape: int, high: int) -> torch.Tensor:
    n = 1
    for s in shape:
        n *= s
    return (torch.arange(n) * 7 % high).reshape(shape)


# ----------------------------------------------------------------------------- the table
# class name -> list of (case id, factory, forward or None). Factories run under trace_init,
# so tensors they create (loss weights, pretrained embeddings) are deferred too.
def _enc_layer(**kw):
    return nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, **kw)


def _dec_layer(**kw):
    return nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, **kw)


CASES: dict[str, list[tuple[str, callable, callable | None]]] = {
    "Linear": [
        ("plain", lambda: nn.Linear(5, 3), lambda m: m(_x(2, 5))),
        ("no_bias", lambda: nn.Linear(5, 3, bias=False), None),
        ("float64", lambda: nn.Linear(5, 3, dtype=torch.float64), lambda m: m(_x(2, 5, dtype=torch.float64))),
        ("bfloat16", lambda: nn.Linear(5, 3, dtype=torch.bfloat16), None),
        ("zero_in", lambda: nn.Linear(0, 3), None),
    ],
    "NonDynamicallyQuantizableLinear": [
        ("plain", lambda: nn.modules.linear.NonDynamicallyQuantizableLinear(4, 3), None),
    ],
    "Bilinear": [
        ("plain", lambda: nn.Bilinear(3, 4, 2), lambda m: m(_x(2, 3), _x(2, 4))),
        ("no_bias", lambda: nn.Bilinear(3, 4, 2, bias=False), None),
    ],
    "Conv1d": [
        ("plain", lambda: nn.Conv1d(2, 4, 3), lambda m: m(_x(1, 2, 6))),
        ("groups_circular", lambda: nn.Conv1d(4, 4, 3, groups=2, padding=1, padding_mode="circular"), None),
    ],
    "Conv2d": [
        ("plain", lambda: nn.Conv2d(2, 4, 3), lambda m: m(_x(1, 2, 5, 5))),
        ("no_bias_groups", lambda: nn.Conv2d(4, 6, (2, 3), groups=2, bias=False), None),
    ],
    "Conv3d": [("plain", lambda: nn.Conv3d(2, 2, 2), lambda m: m(_x(1, 2, 3, 3, 3)))],
    "ConvTranspose1d": [("plain", lambda: nn.ConvTranspose1d(2, 4, 3), lambda m: m(_x(1, 2, 4)))],
    "ConvTranspose2d": [
        ("groups", lambda: nn.ConvTranspose2d(4, 2, 3, groups=2), lambda m: m(_x(1, 4, 3, 3))),
        ("no_bias", lambda: nn.ConvTranspose2d(2, 3, 2, bias=False), None),
    ],
    "ConvTranspose3d": [("plain", lambda: nn.ConvTranspose3d(2, 2, 2), None)],
    "BatchNorm1d": [
        ("plain", lambda: nn.BatchNorm1d(4), lambda m: m(_x(3, 4))),
        ("no_affine", lambda: nn.BatchNorm1d(4, affine=False), None),
        ("no_running_stats", lambda: nn.BatchNorm1d(4, track_running_stats=False), None),
        ("cumulative", lambda: nn.BatchNorm1d(4, momentum=None, dtype=torch.float64), None),
    ],
    "BatchNorm2d": [("plain", lambda: nn.BatchNorm2d(3), lambda m: m(_x(2, 3, 2, 2)))],
    "BatchNorm3d": [("plain", lambda: nn.BatchNorm3d(3), None)],
    "SyncBatchNorm": [("plain", lambda: nn.SyncBatchNorm(3), None)],
    "InstanceNorm1d": [
        ("default_stateless", lambda: nn.InstanceNorm1d(3), None),
        ("affine", lambda: nn.InstanceNorm1d(3, affine=True), lambda m: m(_x(2, 3, 4))),
        ("affine_running", lambda: nn.InstanceNorm1d(3, affine=True, track_running_stats=True), None),
    ],
    "InstanceNorm2d": [("running", lambda: nn.InstanceNorm2d(3, track_running_stats=True), None)],
    "InstanceNorm3d": [("affine_running", lambda: nn.InstanceNorm3d(2, affine=True, track_running_stats=True), None)],
    "GroupNorm": [
        ("plain", lambda: nn.GroupNorm(2, 4), lambda m: m(_x(2, 4, 3))),
        ("no_affine_stateless", lambda: nn.GroupNorm(2, 4, affine=False), None),
    ],
    "LayerNorm": [
        ("plain", lambda: nn.LayerNorm(4), lambda m: m(_x(2, 4))),
        ("shape_no_bias", lambda: nn.LayerNorm((2, 3), bias=False), None),
        ("no_affine_stateless", lambda: nn.LayerNorm(4, elementwise_affine=False), None),
    ],
    "RMSNorm": [
        ("plain", lambda: nn.RMSNorm(4), lambda m: m(_x(2, 4))),
        ("shape_eps", lambda: nn.RMSNorm([2, 3], eps=1e-5, dtype=torch.float64), None),
    ],
    "Embedding": [
        ("plain", lambda: nn.Embedding(10, 4), lambda m: m(_idx(2, 3, high=10))),
        ("padding_idx", lambda: nn.Embedding(10, 4, padding_idx=0), lambda m: m(_idx(2, 3, high=10))),
        ("padding_idx_negative", lambda: nn.Embedding(10, 4, padding_idx=-2), None),
        ("max_norm", lambda: nn.Embedding(10, 4, max_norm=1.0), None),
        ("sparse_bf16", lambda: nn.Embedding(6, 3, sparse=True, dtype=torch.bfloat16), None),
        ("from_pretrained", lambda: nn.Embedding.from_pretrained(torch.randn(5, 3), freeze=False, padding_idx=1), None),
        ("_weight", lambda: nn.Embedding(5, 3, _weight=torch.rand(5, 3), _freeze=True), None),
    ],
    "EmbeddingBag": [
        ("plain", lambda: nn.EmbeddingBag(10, 4), lambda m: m(_idx(2, 3, high=10))),
        ("sum_padding", lambda: nn.EmbeddingBag(10, 4, mode="sum", padding_idx=2), None),
        ("from_pretrained", lambda: nn.EmbeddingBag.from_pretrained(torch.randn(5, 3), mode="max"), None),
    ],
    "RNN": [
        ("plain", lambda: nn.RNN(3, 4), lambda m: m(_x(2, 1, 3))),
        ("deep_bi_relu", lambda: nn.RNN(3, 4, num_layers=2, nonlinearity="relu", bidirectional=True),
         lambda m: m(_x(2, 1, 3))),
    ],
    "LSTM": [
        ("plain", lambda: nn.LSTM(3, 4), lambda m: m(_x(2, 1, 3))),
        ("deep_bi_proj", lambda: nn.LSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2),
         lambda m: m(_x(2, 1, 3))),
        ("batch_first_no_bias", lambda: nn.LSTM(3, 4, batch_first=True, bias=False), lambda m: m(_x(1, 2, 3))),
    ],
    "GRU": [
        ("deep", lambda: nn.GRU(3, 4, num_layers=2), lambda m: m(_x(2, 1, 3))),
        ("bi_no_bias", lambda: nn.GRU(3, 4, bidirectional=True, bias=False), None),
    ],
    "RNNBase": [("gru_mode", lambda: nn.RNNBase("GRU", 3, 4), None)],
    "RNNCell": [
        ("plain", lambda: nn.RNNCell(3, 4), lambda m: m(_x(2, 3))),
        ("relu_no_bias", lambda: nn.RNNCell(3, 4, bias=False, nonlinearity="relu"), None),
    ],
    "LSTMCell": [("plain", lambda: nn.LSTMCell(3, 4), lambda m: m(_x(2, 3)))],
    "GRUCell": [("no_bias", lambda: nn.GRUCell(3, 4, bias=False), lambda m: m(_x(2, 3)))],
    "RNNCellBase": [("plain", lambda: nn.RNNCellBase(3, 4, True, 2), None)],
    "MultiheadAttention": [
        ("plain", lambda: nn.MultiheadAttention(8, 2), lambda m: m(_x(2, 1, 8), _x(2, 1, 8), _x(2, 1, 8))),
        ("kdim_vdim", lambda: nn.MultiheadAttention(8, 2, kdim=4, vdim=6),
         lambda m: m(_x(2, 1, 8), _x(3, 1, 4), _x(3, 1, 6))),
        ("bias_kv_zero_attn", lambda: nn.MultiheadAttention(8, 2, add_bias_kv=True, add_zero_attn=True),
         lambda m: m(_x(2, 1, 8), _x(2, 1, 8), _x(2, 1, 8))),
        ("no_bias_batch_first", lambda: nn.MultiheadAttention(8, 2, bias=False, batch_first=True), None),
    ],
    "Transformer": [
        ("small", lambda: nn.Transformer(d_model=8, nhead=2, num_encoder_layers=1, num_decoder_layers=2,
                                         dim_feedforward=16, dropout=0.0),
         lambda m: m(_x(3, 1, 8), _x(2, 1, 8))),
    ],
    "TransformerEncoderLayer": [
        ("plain", lambda: _enc_layer(), lambda m: m(_x(3, 1, 8))),
        ("norm_first_gelu", lambda: _enc_layer(norm_first=True, activation="gelu", batch_first=True), None),
    ],
    "TransformerDecoderLayer": [("plain", lambda: _dec_layer(), lambda m: m(_x(3, 1, 8), _x(2, 1, 8)))],
    "TransformerEncoder": [
        # _get_clones deep-copies the layer built moments before, inside the constructor
        ("two_layers", lambda: nn.TransformerEncoder(_enc_layer(), 2, enable_nested_tensor=False),
         lambda m: m(_x(3, 1, 8))),
    ],
    "TransformerDecoder": [
        ("two_layers_norm", lambda: nn.TransformerDecoder(_dec_layer(), 2, norm=nn.LayerNorm(8)), None),
    ],
    "PReLU": [
        ("plain", lambda: nn.PReLU(), lambda m: m(_x(2, 3))),
        ("channels_init", lambda: nn.PReLU(3, init=0.1), None),
    ],
    "AdaptiveLogSoftmaxWithLoss": [
        ("plain", lambda: nn.AdaptiveLogSoftmaxWithLoss(8, 10, [4, 8]), None),
        ("head_bias", lambda: nn.AdaptiveLogSoftmaxWithLoss(8, 12, [3, 6], div_value=2.0, head_bias=True),
         lambda m: m.log_prob(_x(2, 8))),
    ],
    "LinearCrossEntropyLoss": [
        ("plain", lambda: nn.LinearCrossEntropyLoss(4, 3), None),
        ("bias_weight", lambda: nn.LinearCrossEntropyLoss(4, 3, bias=True, weight=torch.rand(3)), None),
    ],
    # losses own a buffer when given a weight: built inside the traced factory, so it is deferred
    "BCELoss": [("weight", lambda: nn.BCELoss(weight=torch.rand(3)), None)],
    "BCEWithLogitsLoss": [("weight_pos_weight", lambda: nn.BCEWithLogitsLoss(weight=torch.rand(3), pos_weight=torch.randn(3)), None)],
    "CrossEntropyLoss": [("weight", lambda: nn.CrossEntropyLoss(weight=torch.rand(4)), None)],
    "NLLLoss": [("weight", lambda: nn.NLLLoss(weight=torch.tensor([0.2, 0.3, 0.5])), None)],
    "NLLLoss2d": [("weight", lambda: nn.NLLLoss2d(weight=torch.rand(3)), None)],
    "MultiMarginLoss": [("weight", lambda: nn.MultiMarginLoss(weight=torch.ones(3) / 3), None)],
    "MultiLabelSoftMarginLoss": [("weight", lambda: nn.MultiLabelSoftMarginLoss(weight=torch.rand(3)), None)],
    "FractionalMaxPool2d": [("samples", lambda: nn.FractionalMaxPool2d(2, output_size=2, _random_samples=torch.rand(1, 3, 2)), None)],
    "FractionalMaxPool3d": [("samples", lambda: nn.FractionalMaxPool3d(2, output_size=2, _random_samples=torch.rand(1, 3, 3)), None)],
    "Sequential": [
        ("mlp", lambda: nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2)),
         lambda m: m(_x(3, 4))),
    ],
    "ModuleList": [("linears", lambda: nn.ModuleList([nn.Linear(3, 3) for _ in range(3)]), None)],
    "ModuleDict": [("mixed", lambda: nn.ModuleDict({"a": nn.Linear(3, 2), "b": nn.LayerNorm(3)}), None)],
    "ParameterList": [
        ("random", lambda: nn.ParameterList([nn.Parameter(torch.randn(2, 3)), nn.Parameter(torch.zeros(3)),
                                             torch.rand(2)]), None),
    ],
    "ParameterDict": [("random", lambda: nn.ParameterDict({"w": nn.Parameter(torch.randn(2, 3)), "b": torch.ones(2)}), None)],
}

# Classes that own no parameter or buffer; each is constructed (with these args) and checked.
STATELESS: dict[str, tuple] = {
    "AdaptiveAvgPool1d": (2,), "AdaptiveAvgPool2d": (2,), "AdaptiveAvgPool3d": (2,),
    "AdaptiveMaxPool1d": (2,), "AdaptiveMaxPool2d": (2,), "AdaptiveMaxPool3d": (2,),
    "AlphaDropout": (), "AvgPool1d": (2,), "AvgPool2d": (2,), "AvgPool3d": (2,), "CELU": (), "CTCLoss": (),
    "ChannelShuffle": (2,), "CircularPad1d": (1,), "CircularPad2d": (1,), "CircularPad3d": (1,),
    "ConstantPad1d": (1, 0.0), "ConstantPad2d": (1, 0.0), "ConstantPad3d": (1, 0.0),
    "CosineEmbeddingLoss": (), "CosineSimilarity": (), "CrossMapLRN2d": (3,), "Dropout": (), "Dropout1d": (),
    "Dropout2d": (), "Dropout3d": (), "ELU": (), "FeatureAlphaDropout": (), "Flatten": (), "Fold": (4, 2),
    "GELU": (), "GLU": (), "GaussianNLLLoss": (), "Hardshrink": (), "Hardsigmoid": (), "Hardswish": (),
    "Hardtanh": (), "HingeEmbeddingLoss": (), "HuberLoss": (), "Identity": (), "KLDivLoss": (), "L1Loss": (),
    "LPPool1d": (2, 2), "LPPool2d": (2, 2), "LPPool3d": (2, 2), "LeakyReLU": (), "LocalResponseNorm": (2,),
    "LogSigmoid": (), "LogSoftmax": (), "MSELoss": (), "MarginRankingLoss": (), "MaxPool1d": (2,),
    "MaxPool2d": (2,), "MaxPool3d": (2,), "MaxUnpool1d": (2,), "MaxUnpool2d": (2,), "MaxUnpool3d": (2,),
    "Mish": (), "MultiLabelMarginLoss": (), "PairwiseDistance": (), "PixelShuffle": (2,), "PixelUnshuffle": (2,),
    "PoissonNLLLoss": (), "RReLU": (), "ReLU": (), "ReLU6": (), "ReflectionPad1d": (1,), "ReflectionPad2d": (1,),
    "ReflectionPad3d": (1,), "ReplicationPad1d": (1,), "ReplicationPad2d": (1,), "ReplicationPad3d": (1,),
    "SELU": (), "SiLU": (), "Sigmoid": (), "SmoothL1Loss": (), "SoftMarginLoss": (), "Softmax": (),
    "Softmax2d": (), "Softmin": (), "Softplus": (), "Softshrink": (), "Softsign": (), "Tanh": (),
    "Tanhshrink": (), "Threshold": (0.1, 20.0), "TripletMarginLoss": (), "TripletMarginWithDistanceLoss": (),
    "Unflatten": (1, (2, 2)), "Unfold": (2,), "Upsample": (None, 2), "UpsamplingBilinear2d": (None, 2),
    "UpsamplingNearest2d": (None, 2), "ZeroPad1d": (1,), "ZeroPad2d": (1,), "ZeroPad3d": (1,),
}

# Lazy modules: construction makes UninitializedParameter/Buffer; shapes come from a dry run.
# The supported path is fxinit.dry_run(model, input) on the traced model (tested below).
LAZY: dict[str, tuple[callable, tuple[int, ...]]] = {
    "LazyLinear": (lambda: nn.LazyLinear(3), (2, 4)),
    "LazyConv1d": (lambda: nn.LazyConv1d(4, 3), (1, 2, 6)),
    "LazyConv2d": (lambda: nn.LazyConv2d(4, 2), (1, 2, 4, 4)),
    "LazyConv3d": (lambda: nn.LazyConv3d(2, 2), (1, 2, 3, 3, 3)),
    "LazyConvTranspose1d": (lambda: nn.LazyConvTranspose1d(4, 3), (1, 2, 4)),
    "LazyConvTranspose2d": (lambda: nn.LazyConvTranspose2d(3, 2), (1, 2, 3, 3)),
    "LazyConvTranspose3d": (lambda: nn.LazyConvTranspose3d(2, 2), (1, 2, 2, 2, 2)),
    "LazyBatchNorm1d": (lambda: nn.LazyBatchNorm1d(), (3, 4)),
    "LazyBatchNorm2d": (lambda: nn.LazyBatchNorm2d(), (2, 3, 2, 2)),
    "LazyBatchNorm3d": (lambda: nn.LazyBatchNorm3d(), (2, 3, 2, 2, 2)),
    "LazyInstanceNorm1d": (lambda: nn.LazyInstanceNorm1d(affine=True, track_running_stats=True), (2, 3, 4)),
    "LazyInstanceNorm2d": (lambda: nn.LazyInstanceNorm2d(affine=True, track_running_stats=True), (2, 3, 2, 2)),
    "LazyInstanceNorm3d": (lambda: nn.LazyInstanceNorm3d(affine=True, track_running_stats=True), (2, 3, 2, 2, 2)),
}

# Classes with no test of their own, and why.
NOT_TESTED_DIRECTLY: dict[str, str] = {
    "Module": "the base class: every custom module in test_traps.py is one",
    "Container": "deprecated base class with no state of its own",
}


#: Classes newer than the oldest torch fxinit supports (2.11): their rows run where torch has them.
ADDED_IN = {"LinearCrossEntropyLoss": (2, 13)}
_TORCH = tuple(int(v) for v in torch.__version__.split("+")[0].split(".")[:2])
CASES = {name: cases for name, cases in CASES.items() if _TORCH >= ADDED_IN.get(name, (2, 11))}


def _public_module_classes() -> dict[str, type]:
    found: dict[str, type] = {}
    for info in pkgutil.walk_packages(nn.modules.__path__, nn.modules.__name__ + "."):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            mod = importlib.import_module(info.name)
        for name, obj in vars(mod).items():
            if (inspect.isclass(obj) and issubclass(obj, nn.Module) and not name.startswith("_")
                    and obj.__module__.startswith("torch.nn.modules")):
                found[obj.__name__] = obj
    return found


ALL_CLASSES = _public_module_classes()


def test_every_nn_module_class_is_classified() -> None:
    tables = {"CASES": set(CASES), "STATELESS": set(STATELESS), "LAZY": set(LAZY), "NOT_TESTED": set(NOT_TESTED_DIRECTLY)}
    missing = sorted(n for n in ALL_CLASSES if not any(n in t for t in tables.values()))
    assert not missing, f"torch.nn module classes with no entry in any table of {__file__}: {missing}"
    stale = sorted(n for t in tables.values() for n in t if n not in ALL_CLASSES)
    assert not stale, f"table entries that are not torch.nn module classes here: {stale}"
    for a in tables:
        for b in tables:
            if a < b:
                assert not (tables[a] & tables[b]), f"in both {a} and {b}: {tables[a] & tables[b]}"
    assert len(ALL_CLASSES) > 150  # the walk itself works


def test_table_factories_build_the_class_they_are_listed_under() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for cls_name, cases in CASES.items():
            for case_id, factory, _ in cases:
                m = factory()
                assert type(m) is ALL_CLASSES[cls_name], f"{cls_name}/{case_id} builds {type(m).__name__}"
                if not case_id.endswith("stateless"):
                    assert named_tensors(m), f"{cls_name}/{case_id} owns no parameters or buffers"


@pytest.mark.parametrize("cls_name", sorted(STATELESS))
def test_stateless_class_owns_nothing_and_traces(cls_name: str) -> None:
    cls = ALL_CLASSES[cls_name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        ref = cls(*STATELESS[cls_name])
        eager_rng = rng_state()
        assert not named_tensors(ref), f"{cls_name} owns tensors: move it to CASES with constructor arguments"
        torch.manual_seed(0)
        m = fxinit.trace_init(cls, *STATELESS[cls_name])
    assert type(m) is cls
    assert not named_tensors(m)
    assert torch.equal(rng_state(), eager_rng)
    fxinit.materialize(m)


_PARAMS = [pytest.param(factory, fwd, id=f"{cls_name}-{case_id}")
           for cls_name, cases in CASES.items() for case_id, factory, fwd in cases]


@pytest.mark.parametrize("factory,forward", _PARAMS)
def test_module_equals_eager(factory, forward) -> None:
    assert_same_as_eager(factory, forward=forward)


def test_rnn_flat_weights_are_the_materialized_parameters() -> None:
    torch.manual_seed(0)
    ref = nn.LSTM(3, 4, num_layers=2, bidirectional=True)
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.LSTM, 3, 4, num_layers=2, bidirectional=True)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)
    assert len(m._flat_weights) == len(m._flat_weights_names)
    for name, w in zip(m._flat_weights_names, m._flat_weights):
        assert w is getattr(m, name), name
    out, _ = m(_x(2, 1, 3))
    out_ref, _ = ref(_x(2, 1, 3))
    assert same_bits(out, out_ref)


def test_rnn_one_parameter_materialized_alone() -> None:
    """materialize(tensor) on one RNN weight (RNNs keep weak references to their weights)."""
    torch.manual_seed(0)
    ref = nn.GRU(3, 4, num_layers=2)
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.GRU, 3, 4, num_layers=2)
    w = m.weight_hh_l1
    fxinit.materialize(w)
    assert w is m.weight_hh_l1
    assert not fxinit.is_deferred(w)
    assert same_bits(w, ref.weight_hh_l1)
    assert fxinit.is_deferred(m.weight_ih_l0)
    fxinit.materialize(m)
    assert_modules_equal(m, ref)
    assert same_bits(m(_x(2, 1, 3))[0], ref(_x(2, 1, 3))[0])


# ----------------------------------------------------------------------------- lazy modules
@pytest.mark.parametrize("cls_name", sorted(LAZY))
def test_lazy_module_dry_run_equals_eager(cls_name: str) -> None:
    """Supported path: trace, ``fxinit.dry_run(m, x)`` (the eager dry run), materialize."""
    factory, shape = LAZY[cls_name]
    x = _x(*shape)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for seed in (0, 1):
            torch.manual_seed(seed)
            ref = factory()
            ref(x)
            eager_rng = rng_state()
            torch.manual_seed(seed)
            m = fxinit.trace_init(factory)
            fxinit.dry_run(m, x)
            assert torch.equal(rng_state(), eager_rng), "RNG after trace + dry_run differs from eager construct + dry run"
            torch.manual_seed(99)
            before = rng_state()
            fxinit.materialize(m)
            assert torch.equal(rng_state(), before)
            assert type(m) is type(ref)  # lazy modules turn into their non-lazy class
            assert_modules_equal(m, ref)
            torch.manual_seed(3)
            out = m(x)
            torch.manual_seed(3)
            assert same_bits(out, ref(x))


def test_lazy_module_without_dry_run_stays_lazy_like_eager() -> None:
    """Without a dry run the parameters are UninitializedParameters (as in eager); the first real
    forward then initializes them from the global generator exactly as it would eagerly."""
    torch.manual_seed(0)
    ref = nn.LazyLinear(3)
    torch.manual_seed(0)
    m = fxinit.trace_init(nn.LazyLinear, 3)
    assert isinstance(m.weight, nn.parameter.UninitializedParameter)
    fxinit.materialize(m)  # nothing to do: must not break the lazy module
    torch.manual_seed(5)
    out_ref = ref(_x(2, 4))
    torch.manual_seed(5)
    out = m(_x(2, 4))
    assert same_bits(out, out_ref)
    assert_modules_equal(m, ref)
