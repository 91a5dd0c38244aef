"""Saved init graphs: exact in a process without the model's code, and refused whenever
they are damaged, hostile or inconsistent (never a crash, never code execution)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxinit
from fxinit.artifact import SCHEMA_VERSION, loads
from fxinit.errors import ArtifactError
from tests.artifact_helpers import Small, dumps, hostile, mutated, payload_of, small_graph, valid_bytes
from tests.conftest import same_bits

ROOT = Path(__file__).resolve().parent.parent
BAD = Path(__file__).resolve().parent / "data" / "bad_graphs"


def _eager_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def test_round_trip_is_exact_and_keeps_everything(tmp_path: Path) -> None:
    g = small_graph()
    g.save(tmp_path / "g.fxg")
    h = fxinit.load_graph(tmp_path / "g.fxg")
    assert h.outputs.keys() == g.outputs.keys() and h.ties == g.ties and h.info == g.info
    assert h.stats() == g.stats()
    assert [n.meta["prov"] for n in h.nodes] == [n.meta["prov"] for n in g.nodes]
    assert h.dead_writes() and {n.name for n in h.dead_writes()} == {n.name for n in g.dead_writes()}
    torch.manual_seed(0)
    eager = _eager_tensors(Small())
    values = h.materialize()
    assert values.keys() == eager.keys()
    for k in eager:
        assert same_bits(values[k], eager[k]), k
    assert values["head.weight"] is values["emb.weight"]


def test_round_trip_after_in_place_view_ops(tmp_path: Path) -> None:
    """``t_()`` and ``unsqueeze_()`` change a tensor's view: the saved graph declares the views
    the model ends with, and loading checks those declarations against what the ops compute."""
    from tests.test_traps import InplaceViewOps

    torch.manual_seed(0)
    fxinit.init_graph(fxinit.trace_init(InplaceViewOps)).save(tmp_path / "g.fxg")
    values = fxinit.load_graph(tmp_path / "g.fxg").materialize()
    torch.manual_seed(0)
    eager = _eager_tensors(InplaceViewOps())
    assert values.keys() == eager.keys()
    for k in eager:
        assert values[k].stride() == eager[k].stride() and same_bits(values[k], eager[k]), k


_CHILD = r"""
import sys
sys.modules["transformers"] = None          # the model's library is not importable here
sys.path = [p for p in sys.path if "tests" not in p]
import torch, fxinit
g = fxinit.load_graph(sys.argv[1])
torch.save(g.materialize(), sys.argv[2])
"""


def test_materializes_in_a_process_without_the_model_code(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    torch.manual_seed(3)
    fxinit.init_graph(fxinit.trace_init(transformers.LlamaForCausalLM, cfg)).save(tmp_path / "llama.fxg")
    subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "llama.fxg"), str(tmp_path / "out.pt")],
                   check=True, cwd=tmp_path)
    got = torch.load(tmp_path / "out.pt", weights_only=True)
    torch.manual_seed(3)
    eager = _eager_tensors(transformers.LlamaForCausalLM(cfg))
    assert got.keys() == eager.keys()
    for k in eager:
        assert same_bits(got[k], eager[k]), k


def _refused(data: bytes, match: str = "") -> None:
    with pytest.raises(ArtifactError, match=match):
        loads(data)


def test_damaged_files_are_refused(tmp_path: Path) -> None:
    data = valid_bytes(tmp_path)
    _refused(b"PK\x03\x04" + data[4:], "bad magic")
    _refused(data[: len(data) // 2], "checksum")
    _refused(data[:20], "header")
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0x10
    _refused(bytes(flipped), "checksum")
    _refused(b"", "bad magic")


def test_newer_schema_and_foreign_ops_are_refused(tmp_path: Path) -> None:
    data = valid_bytes(tmp_path)
    _refused(mutated(data, lambda p: p.update(schema_version=SCHEMA_VERSION + 1)), "newer")

    def retarget(target: str):
        def edit(p: dict) -> None:
            p["nodes"][-1]["target"] = target
        return edit

    _refused(mutated(data, retarget("os.system")), "not allowed")
    _refused(mutated(data, retarget("aten.from_file.default")), "not allowed")
    _refused(mutated(data, retarget("aten.no_such_op.default")), "unknown op")

    def opaque_name(p: dict) -> None:
        node = next(n for n in p["nodes"] if n["target"] == "fxinit.ops.call_init_function")
        node["args"]["tuple"][0] = "os.system"
    _refused(mutated(data, opaque_name), "init function")


def test_inconsistent_graphs_are_refused(tmp_path: Path) -> None:
    data = valid_bytes(tmp_path)

    def bad_shape(p: dict) -> None:
        node = next(n for n in p["nodes"] if n["spec"] is not None and n["target"].startswith("aten.empty"))
        node["spec"][0] = [s + 1 for s in node["spec"][0]]
    _refused(mutated(data, bad_shape), "declares")

    def no_rng(p: dict) -> None:
        next(n for n in p["nodes"] if n["rng"])["rng"] = None
    _refused(mutated(data, no_rng), "no generator snapshot")

    def forward_ref(p: dict) -> None:
        p["nodes"][1]["args"] = {"tuple": [{"node": p["nodes"][-1]["name"]}]}
    _refused(mutated(data, forward_ref), "unknown or later node")

    _refused(mutated(data, lambda p: p["rng"].update({k: {"device": "cpu", "state": torch.zeros(3, dtype=torch.uint8)}
                                                      for k in p["rng"]})), "wrong size")
    _refused(mutated(data, lambda p: p["outputs"].update({"x": "nope"})), "output")
    _refused(dumps([1, 2, 3]), "not a dict")


def test_pickled_code_never_runs(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    _refused(hostile(str(marker)), "unreadable payload")
    assert not marker.exists()


def test_a_huge_declared_allocation_is_refused_before_running(tmp_path: Path) -> None:
    g = small_graph()
    with pytest.raises(fxinit.DeferredInitError, match="allocates"):
        g.materialize(max_bytes=16)


def test_bad_file_corpus_is_refused() -> None:
    files = sorted(BAD.glob("*.fxg"))
    assert len(files) >= 10
    for f in files:
        with pytest.raises(ArtifactError):
            fxinit.load_graph(f)


_VALID: dict[str, bytes] = {}


def _valid() -> bytes:
    if "data" not in _VALID:
        import tempfile

        with tempfile.TemporaryDirectory() as d:
            _VALID["data"] = valid_bytes(Path(d))
    return _VALID["data"]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_raw_bytes(data: st.DataObject) -> None:
    """Bit flips, truncations, insertions anywhere in a valid file: refused cleanly."""
    raw = bytearray(_valid())
    for _ in range(data.draw(st.integers(1, 4))):
        kind = data.draw(st.sampled_from(["flip", "truncate", "insert", "overwrite"]))
        pos = data.draw(st.integers(0, max(len(raw) - 1, 0)))
        if kind == "flip" and raw:
            raw[pos] ^= 1 << data.draw(st.integers(0, 7))
        elif kind == "truncate":
            del raw[pos:]
        elif kind == "insert":
            raw[pos:pos] = data.draw(st.binary(min_size=1, max_size=16))
        else:
            chunk = data.draw(st.binary(min_size=1, max_size=16))
            raw[pos:pos + len(chunk)] = chunk
    if bytes(raw) == _valid():
        return
    with pytest.raises(ArtifactError):
        loads(bytes(raw))


_JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=8,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_fuzz_signed_payloads(data: st.DataObject) -> None:
    """Correctly signed files whose content is edited: a valid graph or ArtifactError, nothing else."""
    p = payload_of(_valid())
    for _ in range(data.draw(st.integers(1, 3))):
        where = data.draw(st.sampled_from(["top", "node", "arg"]))
        junk = data.draw(_JUNK)
        if where == "top":
            p[data.draw(st.sampled_from(sorted(p)))] = junk
        elif where == "node" and p.get("nodes") and isinstance(p["nodes"], list):
            node = p["nodes"][data.draw(st.integers(0, len(p["nodes"]) - 1))]
            if isinstance(node, dict) and node:
                node[data.draw(st.sampled_from(sorted(node)))] = junk
        elif p.get("nodes") and isinstance(p["nodes"], list):
            node = p["nodes"][data.draw(st.integers(0, len(p["nodes"]) - 1))]
            if isinstance(node, dict):
                node["args"] = {"tuple": [junk]}
    try:
        graph = loads(dumps(p))
    except ArtifactError:
        return
    try:  # accepted: it runs, or refuses with fxinit's error (never another exception)
        graph.materialize(max_bytes=1 << 24)
    except fxinit.DeferredInitError:
        pass
