"""Saved init graphs: exact in a process without the model's code, and refused whenever
they are damaged, hostile or inconsistent (never a crash, never code execution)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch
import torch.nn as nn
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fxinit
from fxinit.artifact import MAX_CONFIG_DEPTH, SCHEMA_VERSION
from fxinit.graph import loads
from fxinit.errors import ArtifactError
from tests.artifact_helpers import (HEADER_LAYOUT_FILE, Small, dumps, header_layout, hostile, mutated, payload_of,
                                    record_data_at, small_graph, valid_bytes)
from tests.data.make_bad_graphs import REFUSALS
from tests.conftest import same_bits

ROOT = Path(__file__).resolve().parent.parent
BAD = Path(__file__).resolve().parent / "data" / "bad_graphs"


def _eager_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters(remove_duplicate=False)) | dict(model.named_buffers(remove_duplicate=False))


def test_round_trip_is_exact_and_keeps_everything(tmp_path: Path) -> None:
    g = small_graph()
    g.save(tmp_path / "g.pt")
    h = fxinit.load_graph(tmp_path / "g.pt")
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


class ValuesDecideShapes(nn.Module):
    """Ops the meta device cannot run: an index by a mask (e3nn's ``LowPassFilter``: ``x[x.abs() <= 1]``),
    a sampler torch gives no meta kernel (binomial), at an offset."""

    def __init__(self) -> None:
        super().__init__()
        x = torch.linspace(-2.0, 2.0, 9)
        self.register_buffer("kept", x[x.abs() <= 1])
        self.register_buffer("drawn", torch.binomial(torch.full((2, 3), 5.0), torch.full((2, 3), 0.5))[1])
        self.lin = nn.Linear(2, 2)


def test_ops_meta_cannot_run_are_checked_by_their_declared_layout(tmp_path: Path) -> None:
    """Saved graphs with them were refused at load (found by an e3nn sweep)."""
    torch.manual_seed(0)
    eager = _eager_tensors(ValuesDecideShapes())
    torch.manual_seed(0)
    fxinit.init_graph(fxinit.trace_init(ValuesDecideShapes)).save(tmp_path / "g.pt")
    values = fxinit.load_graph(tmp_path / "g.pt").materialize()
    assert values.keys() == eager.keys() and all(same_bits(values[k], eager[k]) for k in eager)


def test_round_trip_after_in_place_view_ops(tmp_path: Path) -> None:
    """``t_()`` and ``unsqueeze_()`` change a tensor's view: the saved graph declares the views
    the model ends with, and loading checks those declarations against what the ops compute."""
    from tests.test_traps import InplaceViewOps

    torch.manual_seed(0)
    fxinit.init_graph(fxinit.trace_init(InplaceViewOps)).save(tmp_path / "g.pt")
    values = fxinit.load_graph(tmp_path / "g.pt").materialize()
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
    fxinit.init_graph(fxinit.trace_init(transformers.LlamaForCausalLM, cfg)).save(tmp_path / "llama.pt")
    subprocess.run([sys.executable, "-c", _CHILD, str(tmp_path / "llama.pt"), str(tmp_path / "out.pt")],
                   check=True, cwd=tmp_path, env=os.environ | {"PYTHONPATH": str(ROOT)})  # this checkout's fxinit
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
    _refused(b"\x00" + data[1:], "not an fxinit init graph")
    _refused(data[: len(data) // 2], "damaged archive")
    _refused(data[:20], "damaged archive")
    flipped = bytearray(data)
    flipped[len(data) // 3] ^= 0x10
    _refused(bytes(flipped), "checksum mismatch")
    _refused(b"", "not an fxinit init graph")


def _zip_structure(data: bytes) -> list[int]:
    """Offsets of every byte of ``data`` that is zip structure (headers, data descriptors,
    central directory), not record data, plus the digest of the checksum record."""
    archive = zipfile.ZipFile(io.BytesIO(data))
    positions = list(range(archive.start_dir, len(data)))
    for info in archive.infolist():
        start = record_data_at(data, info)
        positions += range(info.header_offset, start)
        positions += range(start + info.compress_size, start + info.compress_size + 16)  # data descriptor
        if info.filename.endswith("/fxinit_sha256"):
            positions += range(start, start + info.compress_size)
    return sorted(set(positions))


def test_a_flipped_bit_anywhere_in_the_zip_structure_is_refused(tmp_path: Path) -> None:
    """The checksum covers the archive's headers, not only its records' data: a file that
    any byte differs in is refused, even where zip readers would not notice (timestamps,
    padding, the checksum record's own CRC)."""
    data = valid_bytes(tmp_path)
    positions = _zip_structure(data)
    assert len(positions) > 500
    for pos in positions:
        for bit in (0, 7):
            flipped = bytearray(data)
            flipped[pos] ^= 1 << bit
            with pytest.raises(ArtifactError):
                loads(bytes(flipped))


def test_torch_load_reads_a_saved_graph_without_fxinit(tmp_path: Path) -> None:
    """The file is a torch.save archive of the documented dict: plain torch reads it."""
    g = small_graph()
    g.hf_config = {"model_type": "small", "hidden_size": 4}
    g.save(tmp_path / "init.pt")
    child = (
        "import json, sys\n"
        "sys.modules['fxinit'] = None  # importing fxinit would fail\n"
        "import torch\n"
        "d = torch.load(sys.argv[1], weights_only=True)\n"
        "node = d['nodes'][0]\n"
        "print(json.dumps({'keys': sorted(d), 'format': d['format'], 'version': d['schema_version'],\n"
        "                  'node_keys': sorted(node), 'outputs': sorted(d['outputs']),\n"
        "                  'constants': {k: list(v.shape) for k, v in d['constants'].items()},\n"
        "                  'rng': sorted({str(v['state'].dtype) for v in d['rng'].values()}),\n"
        "                  'hf_config': d['hf_config']}))\n"
    )
    out = subprocess.run([sys.executable, "-c", child, str(tmp_path / "init.pt")], check=True, cwd=tmp_path,
                         capture_output=True, text=True).stdout
    shown = json.loads(out)
    assert shown["keys"] == sorted(["format", "schema_version", "torch_version", "default_dtype", "seed",
                                    "stream_names", "nodes", "outputs", "output_storage", "info", "ties",
                                    "constants", "rng", "hf_config", "random_kernels", "numerics"])
    assert shown["format"] == "fxinit-init-graph" and shown["version"] == SCHEMA_VERSION
    assert {"name", "op", "target", "args", "spec", "rng", "prov"} <= set(shown["node_keys"])
    assert shown["outputs"] == sorted(g.outputs) and shown["constants"] and shown["rng"] == ["torch.uint8"]
    assert shown["hf_config"] == g.hf_config


def test_a_graph_re_saved_by_torch_save_is_refused_with_a_way_out(tmp_path: Path) -> None:
    data = valid_bytes(tmp_path)
    torch.save(payload_of(data), tmp_path / "resaved.pt")
    with pytest.raises(ArtifactError, match="no fxinit_sha256 record") as exc:
        fxinit.load_graph(tmp_path / "resaved.pt")
    assert "InitGraph.save" in str(exc.value)


def test_files_in_the_header_layout_still_load(tmp_path: Path) -> None:
    """A file the previous release wrote (``FXINIT-GRAPH``, a sha256 line, a torch.save
    archive) loads, checksum verified, materializes exactly, and saves in the new layout."""
    data = HEADER_LAYOUT_FILE.read_bytes()
    assert data.startswith(b"FXINIT-GRAPH\nsha256:")
    g = fxinit.load_graph(HEADER_LAYOUT_FILE)
    assert g.hf_config is None
    if torch.__version__.split("+")[0] != "2.13.0":  # the file's torch: its init functions' bodies are unknown here
        with pytest.raises(fxinit.DeferredInitError, match="trunc_normal_ of this torch .* is not the one"):
            g.materialize()
        assert g.materialize(rng="portable").keys() == set(_eager_tensors(Small()))
        return
    torch.manual_seed(0)
    eager = _eager_tensors(Small())
    values = g.materialize()
    assert values.keys() == eager.keys()
    for k in eager:
        assert same_bits(values[k], eager[k]), k
    g.save(tmp_path / "init.pt")
    assert torch.load(tmp_path / "init.pt", weights_only=True)["schema_version"] == SCHEMA_VERSION
    resaved = fxinit.load_graph(tmp_path / "init.pt").materialize()
    assert all(same_bits(resaved[k], eager[k]) for k in eager)
    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0x01
    _refused(bytes(flipped), "checksum mismatch")
    old_payload = payload_of(data[data.index(b"\n", 13) + 1:])
    _refused(header_layout(old_payload | {"schema_version": SCHEMA_VERSION + 1}), "newer")


def test_the_transformers_config_travels_with_the_graph(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=64)
    g = fxinit.init_graph(fxinit.trace_init(transformers.LlamaForCausalLM, cfg))
    assert g.hf_config is not None
    g.save(tmp_path / "llama.pt")
    loaded = fxinit.load_graph(tmp_path / "llama.pt")
    assert loaded.hf_config == g.hf_config and loaded.hf_config is not g.hf_config
    assert loaded.hf_config["model_type"] == "llama" and loaded.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert json.loads(json.dumps(loaded.hf_config)) == loaded.hf_config
    assert torch.load(tmp_path / "llama.pt", weights_only=True)["hf_config"] == g.hf_config
    no_config = small_graph()
    no_config.save(tmp_path / "small.pt")
    assert fxinit.load_graph(tmp_path / "small.pt").hf_config is None


def _deep(depth: int) -> dict:
    config: dict = {"model_type": "x"}
    for _ in range(depth):
        config = {"x": config}
    return config


@pytest.mark.parametrize("config, match", [
    ({1: "x"}, "key of type int"),
    ({"x": (1, 2)}, r"hf_config\['x'\] is a tuple"),
    ({"x": torch.tensor(1.0)}, "is a Tensor"),
    ({"x": {"y": {1.5}}}, r"hf_config\['x'\]\['y'\] is a set"),
    (["model_type"], "is a list, not a dict"),
    (_deep(MAX_CONFIG_DEPTH + 1), "nested deeper than"),
])
def test_hf_config_must_be_plain_json_data(tmp_path: Path, config: object, match: str) -> None:
    """Refused when saving (so every saved file loads) and when loading (so a file cannot
    hand a checkpoint exporter anything but config.json data)."""
    g = small_graph()
    g.hf_config = config  # type: ignore[assignment]
    with pytest.raises(ArtifactError, match="cannot save this graph: .*" + match):
        g.save(tmp_path / "g.pt")
    assert not (tmp_path / "g.pt").exists()
    _refused(mutated(valid_bytes(tmp_path), lambda p: p.update(hf_config=config)), match)
    g.hf_config = _deep(MAX_CONFIG_DEPTH - 1)
    g.save(tmp_path / "g.pt")
    assert fxinit.load_graph(tmp_path / "g.pt").hf_config == g.hf_config


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
    files = {f.name for f in [*BAD.glob("*.pt"), *BAD.glob("*.fxg")]}
    assert files == set(REFUSALS), "run python tests/data/make_bad_graphs.py"
    for name, phrase in REFUSALS.items():
        with pytest.raises(ArtifactError, match=phrase):
            fxinit.load_graph(BAD / name)


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


def _bf16_graph(tmp_path: Path) -> bytes:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(5003, dtype=torch.bfloat16).normal_())  # the vectorized sampler
            self.b = nn.Parameter(torch.rand(7))

    torch.manual_seed(0)
    fxinit.init_graph(fxinit.trace_init(M)).save(tmp_path / "bf16.pt")
    return (tmp_path / "bf16.pt").read_bytes()


def test_a_graph_recorded_with_other_random_kernels_is_refused_in_exact_mode(tmp_path: Path) -> None:
    """torch's CPU bfloat16 and float16 samplers changed between 2.11, 2.12 and 2.13: a graph
    keeps the fingerprint of the kernels of each dtype its random ops drew in, and an exact
    replay under others is refused, naming the op; float32 ops and portable mode are not."""
    data = _bf16_graph(tmp_path)
    kernels = payload_of(data)["random_kernels"]
    assert set(kernels) == {"bfloat16", "float32"}
    assert loads(data).materialize()["w"].dtype == torch.bfloat16

    def from_other_torch(p: dict) -> None:
        p["random_kernels"]["bfloat16"] = "0" * 16  # what another torch's bfloat16 samplers drew
    other = loads(mutated(data, from_other_torch))
    with pytest.raises(fxinit.DeferredInitError, match=r"draws other torch.bfloat16 random numbers .*normal_"):
        other.materialize()
    assert other.materialize(["b"])["b"].dtype == torch.float32  # its float32 op drew as here
    assert other.materialize(rng="portable").keys() == {"w", "b"}
    resaved = tmp_path / "resaved.pt"
    other.save(resaved)  # the fingerprints it was recorded with, not this torch's
    assert payload_of(resaved.read_bytes())["random_kernels"]["bfloat16"] == "0" * 16


def test_a_graph_older_than_kernel_fingerprints_is_refused_under_another_torch_release(tmp_path: Path) -> None:
    data = _bf16_graph(tmp_path)

    def schema_5(release: str) -> Callable[[dict], None]:
        def edit(p: dict) -> None:
            p.update(schema_version=5, torch_version=release)
            del p["random_kernels"], p["numerics"]
        return edit
    here = torch.__version__.split("+")[0]
    assert loads(mutated(data, schema_5(here + "+cu130"))).materialize().keys() == {"w", "b"}
    other = "2.12.1" if here != "2.12.1" else "2.13.0"
    with pytest.raises(fxinit.DeferredInitError, match="draws other torch.bfloat16"):
        loads(mutated(data, schema_5(other))).materialize()
