"""fxinit.check and `fxinit check`: a user's model built eagerly and with fxinit, compared bit
for bit, with a report that says equal, what differs first and where it came from, or why
fxinit refused."""

from __future__ import annotations

import importlib
import itertools
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn as nn

import fxinit
from fxinit.check import CheckReport, compare_builds, compare_tensors, reachable_tensors
from fxinit.cli import EXIT_FAILED, EXIT_OK, EXIT_USAGE, main
from tests.cli_models import Stack, build

check_module = importlib.import_module("fxinit.check")  # `fxinit.check` is the function

TINY_LLAMA = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128}


def skewed_trace_init(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make check's fxinit build start from another seed than its eager build: a wrong fxinit."""
    real = check_module.trace_init

    def trace_from_another_seed(fn: Any, *args: Any, **kwargs: Any) -> nn.Module:
        torch.manual_seed(torch.initial_seed() + 1)
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(check_module, "trace_init", trace_from_another_seed)


_builds = itertools.count()


class Counted(nn.Module):
    """Not deterministic: every construction stores a new number (like reading the time)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("serial", torch.tensor([next(_builds)]))


class NeedsValues(nn.Module):
    """Refused: ``nonzero`` needs the values of a random tensor too large to compute while tracing."""

    def __init__(self) -> None:
        super().__init__()
        w = torch.randn(2048, 2049)
        self.register_buffer("positive", (w > 0).nonzero()[:4])


# ---------------------------------------------------------------------------- equal
def test_linear_is_equal_and_the_global_rng_is_left_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    report = fxinit.check(nn.Linear, 4, 3, seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    assert isinstance(report, CheckReport) and report.ok
    assert (report.status, report.tensors_checked, report.divergent) == ("equal", 2, 0)
    assert report.first_divergent is None and report.rng_after_equal is True and report.hint is None
    assert str(report).startswith("fxinit check torch.nn.modules.linear:Linear (seed 7): EQUAL: 2 tensors bit for bit")
    assert "check" in fxinit.__all__


class _ExtraStateNone(nn.Linear):
    def get_extra_state(self) -> None:  # megatron-core's parallel linears: None in every state_dict
        return None

    def set_extra_state(self, state: Any) -> None:
        pass


def test_a_state_dict_entry_that_is_not_a_tensor_is_compared_not_a_crash() -> None:
    """Found by a sweep of megatron-core: ``check`` crashed on the ``_extra_state: None``
    entries of its layers' ``state_dict``. Such an entry is compared as an object."""
    report = fxinit.check(lambda: nn.Sequential(_ExtraStateNone(3, 3), _ExtraStateNone(3, 2)))
    assert report.ok and report.tensors_checked == 6, report
    from fxinit.check import compare_builds
    assert [(d.name, d.what) for d in compare_builds({"x": {"amax": 1.0}}, {"x": {"amax": 2.0}})] == [("x", "values")]
    assert [(d.name, d.what) for d in compare_builds({"x": None}, {"x": torch.zeros(1)})] == [("x", "type")]


def test_rng_after_can_be_left_unchecked() -> None:
    report = fxinit.check(build, layers=1, rng_after=False)
    assert report.ok and report.rng_after_equal is None and report.tensors_checked == 6


def test_tiny_llama_from_config_is_equal() -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.for_model(**TINY_LLAMA)
    report = fxinit.check(transformers.AutoModelForCausalLM.from_config, cfg, seed=3)
    assert report.ok, str(report)
    names = reachable_tensors(transformers.AutoModelForCausalLM.from_config(cfg))
    assert "model.rotary_emb.inv_freq" in names  # non-persistent buffers are compared too
    assert report.tensors_checked == len(names)


# ---------------------------------------------------------------------------- different
def test_a_wrong_fxinit_is_reported_with_the_op_and_its_source_line(monkeypatch: pytest.MonkeyPatch) -> None:
    skewed_trace_init(monkeypatch)
    report = fxinit.check(build, layers=2)
    assert report.status == "different" and not report.ok
    d = report.first_divergent
    assert d is not None and (d.name, d.what) == ("embed.weight", "values")
    assert d.differing == d.numel == 128 and d.max_abs_diff is not None and d.max_abs_diff > 0
    assert report.source is not None and report.source.startswith("normal_: by torch.nn.init.normal_")
    assert "cli_models.py:19: self.embed = nn.Embedding(vocab, dim)" in report.source
    assert report.provenance is not None and report.provenance.startswith("embed.weight: parameter (16, 8) float32")
    assert report.rng_after_equal is False and report.eager_deterministic is True
    assert report.hint is not None and "bug in fxinit" in report.hint and "docs/failure-modes.md" in report.hint
    text = str(report)
    assert "DIFFERENT" in text and "first divergent: embed.weight: values: 128 of 128 elements differ" in text
    assert "the global RNG is NOT where eager construction leaves it" in text


def test_one_flipped_bit_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    def materialize_then_flip(model: nn.Module) -> nn.Module:
        fxinit.materialize(model)
        with torch.no_grad():
            model.layers[1].fc.weight.view(-1).view(torch.int32)[5] ^= 1
        return model

    monkeypatch.setattr(check_module, "materialize", materialize_then_flip)
    report = fxinit.check(build, layers=2)
    d = report.first_divergent
    assert report.status == "different" and report.divergent == 1 and report.rng_after_equal is True
    assert d is not None and (d.name, d.differing, d.numel) == ("layers.1.fc.weight", 1, 64)
    assert report.source is not None and "cli_models.py:12: nn.init.normal_" in report.source  # after kaiming


def test_a_constructor_that_is_not_deterministic() -> None:
    report = fxinit.check(Counted)
    d = report.first_divergent
    assert report.status == "different" and d is not None
    assert (d.name, d.what, d.differing, d.max_abs_diff) == ("serial", "values", 1, 1.0)
    assert report.eager_deterministic is False
    assert report.hint is not None and "two eager builds with the same seed differ" in report.hint
    assert "eager construction is NOT deterministic" in str(report)


class SharesMemory(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cache", torch.randn(2, 3))
        self.register_buffer("cos", self.cache[0])
        self.register_buffer("tail", torch.randn(10)[:8])


@pytest.mark.parametrize("undo", ["sharing", "storage size"])
def test_memory_shared_otherwise_than_eager_is_found(monkeypatch: pytest.MonkeyPatch, undo: str) -> None:
    """Which names share memory (a write to one shows in the others) and how big each storage
    is are eager's too (a deep copy of a view had made it compact, unseen by ``check``)."""
    def materialize_then_undo(model: nn.Module) -> nn.Module:
        fxinit.materialize(model)
        name = "cos" if undo == "sharing" else "tail"
        model.register_buffer(name, getattr(model, name).clone())
        return model

    monkeypatch.setattr(check_module, "materialize", materialize_then_undo)
    report = fxinit.check(SharesMemory)
    d = report.first_divergent
    assert report.status == "different" and d is not None and d.what == "storage"
    assert d.name == ("cache" if undo == "sharing" else "tail")
    want = "shared with no other name in fxinit's build, with cos in eager's" if undo == "sharing" else \
        "a storage of 32 bytes here, 40 in eager construction"
    assert want in d.detail, d.detail


class Unwritten(nn.Module):
    """DoRA's ``magnitude`` before ``initialize_dora_magnitude``: ``torch.empty``, never written."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.magnitude = nn.Parameter(torch.empty(16))


def test_a_tensor_no_op_writes_is_named_as_uninitialized(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two builds' uninitialized memory may differ or not: the report says which tensors hold
    it, rather than blaming the time or fxinit (found by a torchtune sweep)."""
    def materialize_then_scribble(model: nn.Module) -> nn.Module:  # as other memory would
        fxinit.materialize(model)
        with torch.no_grad():
            model.magnitude.view(torch.int32).copy_(torch.arange(16, dtype=torch.int32) + 7)
        return model

    builds = []
    build_eager = check_module._build_eager

    def eager_then_scribble(*args: Any) -> Any:  # the second eager build's memory held other bytes
        model, rng = build_eager(*args)
        builds.append(model)
        if len(builds) == 2:
            with torch.no_grad():
                model.magnitude.view(torch.int32).copy_(torch.arange(16, dtype=torch.int32) * 3)
        return model, rng

    monkeypatch.setattr(check_module, "materialize", materialize_then_scribble)
    monkeypatch.setattr(check_module, "_build_eager", eager_then_scribble)
    report = fxinit.check(Unwritten)
    assert report.status == "different" and report.uninitialized == ["magnitude"] and len(builds) == 2
    assert report.hint is not None and report.hint.startswith("magnitude: allocated (torch.empty & co.) and never")
    assert "bug in fxinit" not in report.hint
    # the memory no op writes is left out of the determinism probe (found by a fair-esm sweep)
    assert report.eager_deterministic is True
    assert "bit for bit the first, but for the tensors no op writes" in str(report)


# ---------------------------------------------------------------------------- refused
def test_a_refused_constructor() -> None:
    torch.manual_seed(5)
    before = torch.get_rng_state()
    report = fxinit.check(NeedsValues)
    assert torch.equal(torch.get_rng_state(), before)
    assert report.status == "refused" and report.first_divergent is None and report.tensors_checked == 0
    assert report.message is not None and "aten.nonzero.default" in report.message
    assert report.hint is not None and "docs/failure-modes.md" in report.hint
    text = str(report)
    assert "REFUSED" in text and "test_check.py" in text and text.count("hint:") == 1


# ---------------------------------------------------------------------------- the comparison
def test_bits_not_values_are_compared() -> None:
    nan = torch.tensor([float("nan"), 1.0])
    assert compare_tensors("x", nan, nan.clone()) is None  # NaN where eager has the same NaN: equal
    other_payload = nan.clone()
    other_payload.view(torch.int32)[0] ^= 1  # still a NaN, another payload
    d = compare_tensors("x", other_payload, nan)
    assert d is not None and d.differing == 1 and d.max_abs_diff != d.max_abs_diff  # only NaNs differ: nan
    d = compare_tensors("z", torch.tensor([-0.0, 2.0]), torch.tensor([0.0, 2.0]))
    assert d is not None and d.differing == 1 and d.max_abs_diff == 0 and "signed zeros" in d.detail
    half = torch.tensor([1.0, 2.0, 3.0], dtype=torch.bfloat16)
    d = compare_tensors("h", half + torch.tensor([0.0, 0.0, 1.0], dtype=torch.bfloat16), half)
    assert d is not None and (d.differing, d.max_abs_diff) == (1, 1.0)
    c = torch.tensor([1 + 2j, 3 - 1j])
    d = compare_tensors("c", c.conj().resolve_conj(), c)
    assert d is not None and d.differing == 2
    d = compare_tensors("b", torch.tensor([True, False]), torch.tensor([True, True]))
    assert d is not None and d.differing == 1 and d.max_abs_diff is None
    assert compare_tensors("t", torch.arange(6).view(2, 3).t(), torch.arange(6).view(2, 3).t()) is None


def test_metadata_differences() -> None:
    w = torch.zeros(2, 3)
    cases = [(nn.Parameter(w.clone()), w, "type"), (w.view(3, 2), w, "shape"), (w.double(), w, "dtype"),
             (w.clone().requires_grad_(), w, "requires_grad"), (w.t().contiguous().t(), w, "stride"),
             (w.to("meta"), w, "meta")]
    for got, want, what in cases:
        d = compare_tensors("w", got, want)
        assert d is not None and d.what == what, (what, d)
    torch.manual_seed(0)
    deferred = fxinit.trace_init(nn.Linear, 2, 2)
    d = compare_tensors("weight", deferred.weight, nn.Linear(2, 2).weight)
    assert d is not None and d.what == "deferred"


def test_every_reachable_tensor_is_named() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(2, 2)
            self.register_buffer("table", torch.ones(2), persistent=False)
            self.mask = torch.ones(2, dtype=torch.bool)
            self.cache = [torch.zeros(1), "not a tensor"]
            self.tables = {"sin": torch.zeros(3)}

    names = list(reachable_tensors(Holder()))
    assert names == ["fc.weight", "fc.bias", "table", "mask", "cache[0]", "tables['sin']"]


def test_ties_missing_and_extra_names() -> None:
    torch.manual_seed(0)
    eager = reachable_tensors(Stack())
    torch.manual_seed(0)
    untied = Stack()
    untied.head.weight = nn.Parameter(untied.embed.weight.detach().clone())
    found = compare_builds(reachable_tensors(untied), eager)
    assert [(d.name, d.what) for d in found] == [("embed.weight", "tie"), ("head.weight", "tie")]
    fewer = dict(eager)
    extra = fewer.pop("head.weight")
    fewer["new"] = extra
    assert [(d.name, d.what) for d in compare_builds(fewer, eager)] == [
        ("embed.weight", "tie"), ("head.weight", "missing"), ("new", "extra")]


# ---------------------------------------------------------------------------- the command
def test_check_command(tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["check", "tests.cli_models:build", "--kwargs", json.dumps({"layers": 3}), "--seed", "4"]) == EXIT_OK
    out = capsys.readouterr().out
    assert out.startswith("fxinit check tests.cli_models:build (seed 4): EQUAL: 14 tensors bit for bit")

    models = tmp_path / "my_models.py"
    models.write_text("import torch\nimport torch.nn as nn\n\n\n"
                      "class NeedsValues(nn.Module):\n"
                      "    def __init__(self):\n"
                      "        super().__init__()\n"
                      "        w = torch.randn(2048, 2049)\n"
                      "        self.register_buffer('positive', (w > 0).nonzero()[:4])\n\n\n"
                      "def not_a_model():\n"
                      "    return 3\n")
    assert main(["check", f"{models}:NeedsValues"]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "REFUSED" in out and "my_models.py:9" in out and "hint:" in out

    assert main(["check", f"{models}:not_a_model"]) == EXIT_USAGE
    assert main(["check", "tests.cli_models:build", "--args", "{bad"]) == EXIT_USAGE
    assert "not an nn.Module" in capsys.readouterr().err

    skewed_trace_init(monkeypatch)
    assert main(["check", f"{Path(__file__).parent / 'cli_models.py'}:Stack", "--args", "[1]"]) == EXIT_FAILED
    out = capsys.readouterr().out
    assert "DIFFERENT" in out and "first divergent: embed.weight" in out and "cli_models.py:19" in out


def test_check_command_with_an_hf_config(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("transformers")
    assert main(["check", "transformers:AutoModelForCausalLM.from_config",
                 "--hf-config", json.dumps(TINY_LLAMA)]) == EXIT_OK
    assert "EQUAL" in capsys.readouterr().out


def test_check_help() -> None:
    script = Path(sys.executable).parent / "fxinit"  # the console script pip installed
    proc = subprocess.run([str(script), "check", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: fxinit check" in proc.stdout and "--hf-config" in proc.stdout
    from fxinit.cli import build_parser

    top = build_parser().format_help()
    assert "fxinit check my_pkg.models:build" in top and "check that fxinit builds a model" in top


def test_lazy_modules_are_compared_not_a_crash() -> None:
    """Found by a sweep of torchaudio (``PitchShift`` holds an ``UninitializedParameter``):
    ``check`` read the shape of eager's uninitialized parameter and raised torch's error. Both
    builds hold one: equal; one built otherwise is a difference by name."""
    assert fxinit.check(lambda: nn.Sequential(nn.LazyConv1d(4, 3), nn.Linear(2, 2))).ok
    lazy, real = nn.LazyLinear(4), nn.Parameter(torch.zeros(4, 3))
    assert compare_tensors("w", lazy.weight, nn.LazyLinear(4).weight) is None
    assert compare_tensors("w", real, lazy.weight).what == "type"


class _HoldsAZeroTensor(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("z", torch.ops.aten._efficientzerotensor.default([3]))


def test_a_zero_tensor_is_compared_not_a_crash() -> None:
    """Found by a review: ``check`` asked a zero tensor's storage for its address (torch's
    "invalid python storage"); such a tensor has no memory to share."""
    report = fxinit.check(_HoldsAZeroTensor)
    assert report.ok and report.tensors_checked == 1, report
