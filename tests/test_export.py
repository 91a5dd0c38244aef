"""Checkpoints written in bounded memory (``fxinit.save``, ``fxinit materialize --format hf|dcp``):
values equal eager construction (``from_pretrained``, ``dcp.load``), tensors computed in
pieces equal whole ones, files complete or absent, ``resume`` keeps verified files only,
parts combine, and disk errors are one line with a hint."""

from __future__ import annotations

import errno
import json
import os
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

import fxinit
from fxinit.cli import EXIT_FAILED, EXIT_OK, main
from fxinit.export.files import SinkFile
from fxinit.export.produce import Producer
from fxinit.export.source import Piece, Source
from tests.conftest import TORCH_RELEASE, same_bits

safetensors_torch = pytest.importorskip("safetensors.torch")
transformers = pytest.importorskip("transformers")
dcp = pytest.importorskip("torch.distributed.checkpoint")

LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256)


def _llama(seed: int = 0, traced: bool = True, **overrides: object) -> nn.Module:
    cfg = transformers.AutoConfig.for_model("llama", **{**LLAMA, **overrides})
    torch.manual_seed(seed)
    build = transformers.AutoModelForCausalLM.from_config
    return fxinit.trace_init(build, cfg) if traced else build(cfg)


class Odd(nn.Module):
    """Layouts and inits that pieces must get right: a normal_ fill whose length is not a
    multiple of 16 (the sampler's block), an Embedding with a zeroed padding row, a
    transposed parameter, a trunc_normal_ (its rejections replayed per row piece), an
    integer buffer, and a fill of several cache-sized chunks with a tail block."""

    def __init__(self) -> None:
        super().__init__()
        self.odd = nn.Parameter(torch.empty(37, 11).normal_(0, 0.5))
        self.embed = nn.Embedding(301, 7, padding_idx=150)
        self.lin = nn.Linear(13, 203)
        self.tw = nn.Parameter(torch.empty(9, 150).uniform_().t())
        self.trunc = nn.Parameter(nn.init.trunc_normal_(torch.empty(120, 10)))
        self.register_buffer("steps", torch.arange(500).view(100, 5))
        self.big = nn.Parameter(torch.empty(1031, 193).normal_())  # pieces of several 64K-element chunks
        self.scale = nn.Parameter(torch.tensor(0.5))
        self.register_buffer("mask", torch.rand(6, 7) > 0.5)


def _assert_dcp_equal(directory: Path, ref: dict[str, torch.Tensor]) -> set[str]:
    """``dcp.load`` of ``directory`` into zeros of ``ref``'s shapes gives ``ref``, for the
    tensors the checkpoint holds (returned; all of them are in ``ref``)."""
    stored = set(dcp.FileSystemReader(directory).read_metadata().state_dict_metadata)
    assert stored <= set(ref)
    ref = {k: v for k, v in ref.items() if k in stored}
    state = {k: torch.zeros_like(v) for k, v in ref.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: loading in one process"
        dcp.load(state, checkpoint_id=directory)
    for name, value in ref.items():
        assert same_bits(state[name], value), name
    return stored


def _files(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(safetensors_torch.load_file(f))
    return out


@pytest.mark.parametrize("rng", ["exact", "portable"])
def test_rows_of_an_output_equal_the_rows_of_the_whole(rng: str) -> None:
    torch.manual_seed(3)
    graph = fxinit.init_graph(fxinit.trace_init(Odd))
    whole = graph.materialize(rng=rng)
    for name in graph.outputs:
        if not whole[name].dim():
            continue
        n = whole[name].shape[0]
        for start, stop in ((0, 1), (0, n), (n // 3, n // 3 + 2), (n - 1, n), (5, n - 4), (17, 33), (n - 700, n)):
            if not 0 <= start < stop <= n:
                continue
            part = graph.materialize([name], rng=rng, rows={name: (start, stop)})[name]
            assert same_bits(part, whole[name][start:stop]), (name, start, stop)
    cast = graph.materialize(["lin.weight"], rng=rng, dtype=torch.bfloat16, rows={"lin.weight": (40, 90)})
    assert same_bits(cast["lin.weight"], whole["lin.weight"][40:90].to(torch.bfloat16))


def test_rows_fill_only_what_they_need() -> None:
    torch.manual_seed(0)
    graph = fxinit.init_graph(fxinit.trace_init(Odd))
    source = Source.of(graph)
    # a fill restricted to the rows asked for: pieces; trunc_normal_ too (exact: its normal_
    # draws, and rejection rounds replayed for the rows' own elements)
    assert len(source.pieces("lin.weight", None, "exact", 1024)) > 1
    assert len(source.pieces("embed.weight", None, "exact", 1024)) > 1
    # (torch 2.11's trunc_normal_ is recorded whole, ``capture.init_shims``: one piece)
    assert (len(source.pieces("trunc", None, "exact", 1024)) > 1) == (TORCH_RELEASE >= (2, 12))
    assert len(source.pieces("tw", None, "exact", 1024)) == 1  # rows of a transposed tensor span all of it
    pieces = source.pieces("lin.weight", None, "exact", 1024)
    assert [(p.start, p.stop) for p in pieces][0] == (0, 1024 // (13 * 4))
    assert pieces[-1].stop == 203 and sum(p.nbytes for p in pieces) == 203 * 13 * 4


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_every_layout_and_dtype_round_trips(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fmt: str) -> None:
    monkeypatch.setattr("fxinit.export.run.Export.piece_bytes", property(lambda self: 4096))
    torch.manual_seed(5)
    graph = fxinit.init_graph(fxinit.trace_init(Odd))
    ref = graph.materialize()
    fxinit.save(graph, tmp_path / "ckpt", format=fmt, max_shard_size="300KB")
    got = _files(tmp_path / "ckpt") if fmt == "hf" else None
    if got is None:
        assert _assert_dcp_equal(tmp_path / "ckpt", ref) == set(graph.outputs)
    else:
        assert set(got) == set(graph.outputs)
        for name, value in got.items():
            assert same_bits(value, ref[name]), name


def test_hf_checkpoint_loads_with_from_pretrained_equal_to_eager(tmp_path: Path) -> None:
    model = _llama(seed=4, tie_word_embeddings=True)
    done = fxinit.save(model, tmp_path / "ckpt", max_shard_size="60KB")
    assert done.finished and len(done.files) > 2 and not done.skipped
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    n = len(done.files)
    assert names == [".fxinit", "config.json", *(f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)),
                     "model.safetensors.index.json"]
    index = json.loads((tmp_path / "ckpt" / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # a tie stored once, under its first name
    eager = _llama(seed=4, traced=False, tie_word_embeddings=True)
    assert index["metadata"]["total_parameters"] == eager.num_parameters()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    ref, got = eager.state_dict(), loaded.state_dict()
    assert set(ref) == set(got)
    for name in ref:
        assert same_bits(got[name], ref[name]), name
    assert json.loads((tmp_path / "ckpt" / "config.json").read_text())["dtype"] == "float32"


def test_one_file_checkpoint_and_a_partly_materialized_model(tmp_path: Path) -> None:
    model = _llama(seed=2)
    fxinit.materialize(model.model.layers[1])  # real tensors are written as they are
    done = fxinit.save(model, tmp_path / "ckpt", dtype=torch.bfloat16)
    assert done.files == ["model.safetensors"] and not (tmp_path / "ckpt" / "model.safetensors.index.json").exists()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")
    assert loaded.dtype == torch.bfloat16
    ref = _llama(seed=2, traced=False).to(torch.bfloat16).state_dict()
    for name, value in loaded.state_dict().items():
        assert same_bits(value, ref[name]), name


@pytest.mark.parametrize("rng,dtype", [("exact", None), ("portable", None), ("exact", torch.bfloat16)])
def test_tensors_written_in_pieces_equal_materialize(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, rng: str,
                                                     dtype: torch.dtype | None) -> None:
    monkeypatch.setattr("fxinit.export.run.Export.piece_bytes", property(lambda self: 20_000))
    graph = fxinit.init_graph(_llama(vocab_size=1000))
    source = Source.of(graph)
    assert len(source.pieces("model.embed_tokens.weight", dtype, rng, 20_000)) > 5
    ref = graph.materialize(rng=rng, dtype=dtype)
    done = fxinit.save(graph, tmp_path / "hf", rng=rng, dtype=dtype, max_shard_size="200KB")
    got = _files(tmp_path / "hf")
    assert set(got) == set(source.names) and done.finished
    for name, value in got.items():
        assert same_bits(value, ref[name]), name
    fxinit.save(graph, tmp_path / "dcp", format="dcp", rng=rng, dtype=dtype)
    assert _assert_dcp_equal(tmp_path / "dcp", ref) == set(source.names)


def test_dcp_checkpoint_loads_with_dcp_load(tmp_path: Path) -> None:
    model = _llama(seed=1, tie_word_embeddings=True)
    done = fxinit.save(model, tmp_path / "step-0", format="dcp", max_shard_size="100KB")
    assert done.finished and len(done.files) > 2
    assert (tmp_path / "step-0" / ".metadata").is_file()
    eager = _llama(seed=1, traced=False, tie_word_embeddings=True)
    assert _assert_dcp_equal(tmp_path / "step-0", eager.state_dict()) == set(eager.state_dict())


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_resume_keeps_verified_files_and_rewrites_the_rest(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           fmt: str) -> None:
    graph = fxinit.init_graph(_llama(seed=6))
    out = tmp_path / "ckpt"
    full = fxinit.save(graph, tmp_path / "clean", format=fmt, max_shard_size="60KB")
    real_write = SinkFile.write
    calls = {"n": 0}

    def dying_write(self: SinkFile, data: object) -> int:
        calls["n"] += ".json" not in self.path.name
        if calls["n"] > 12:
            raise KeyboardInterrupt  # a run stopped in the middle of a file
        return real_write(self, data)

    monkeypatch.setattr(SinkFile, "write", dying_write)
    with pytest.raises(KeyboardInterrupt):
        fxinit.save(graph, out, format=fmt, max_shard_size="60KB")
    monkeypatch.setattr(SinkFile, "write", real_write)
    complete = sorted(p.name for p in out.iterdir() if p.name in full.files)
    assert complete and len(complete) < len(full.files)
    assert not any(".incomplete" in p.name for p in out.iterdir())
    assert not (out / ".metadata").exists() and not (out / "model.safetensors.index.json").exists()
    # a damaged file is not verified: written again
    damaged = out / complete[0]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    again = fxinit.save(graph, out, format=fmt, max_shard_size="60KB", resume=True)
    assert sorted(again.skipped) == complete[1:]
    assert sorted(again.files) == sorted(set(full.files) - set(complete[1:]))
    assert again.finished
    for name in full.files + (["model.safetensors.index.json"] if fmt == "hf" else []):
        assert (out / name).read_bytes() == (tmp_path / "clean" / name).read_bytes(), name
    if fmt == "dcp":  # .metadata holds a save id of its own: load it instead
        assert _assert_dcp_equal(out, graph.materialize()) == set(Source.of(graph).names)


def test_resume_refuses_a_directory_of_another_plan(tmp_path: Path) -> None:
    graph = fxinit.init_graph(_llama())
    fxinit.save(graph, tmp_path / "ckpt")
    with pytest.raises(fxinit.ExportError, match="another plan"):
        fxinit.save(graph, tmp_path / "ckpt", rng="portable", resume=True)
    done = fxinit.save(graph, tmp_path / "ckpt", rng="portable")  # without --resume: replaced
    assert done.finished
    assert fxinit.save(graph, tmp_path / "ckpt", rng="portable", resume=True).skipped == ["model.safetensors"]


@pytest.mark.parametrize("fmt", ["hf", "dcp"])
def test_parts_make_one_checkpoint(tmp_path: Path, fmt: str) -> None:
    graph = fxinit.init_graph(_llama(seed=8))
    whole = fxinit.save(graph, tmp_path / "whole", format=fmt, max_shard_size="40KB")
    written = []
    for k in (1, 2, 3):
        part = fxinit.save(graph, tmp_path / "parts", format=fmt, max_shard_size="40KB", part=f"{k}/3")
        assert part.finished == (k == 3)
        written += part.files
    assert sorted(written) == sorted(whole.files)
    for name in whole.files + (["model.safetensors.index.json", "config.json"] if fmt == "hf" else []):
        assert (tmp_path / "parts" / name).read_bytes() == (tmp_path / "whole" / name).read_bytes(), name
    if fmt == "dcp":
        assert _assert_dcp_equal(tmp_path / "parts", graph.materialize()) == set(Source.of(graph).names)


def test_only_writes_a_checkpoint_of_the_matching_tensors(tmp_path: Path) -> None:
    graph = fxinit.init_graph(_llama())
    fxinit.save(graph, tmp_path / "stage", only="model.layers.1")
    got = _files(tmp_path / "stage")
    assert got and all(n.startswith("model.layers.1.") for n in got)
    ref = graph.materialize(list(got))
    assert all(same_bits(v, ref[k]) for k, v in got.items())
    with pytest.raises(fxinit.DeferredInitError, match="matches no tensor"):
        fxinit.save(graph, tmp_path / "none", only="nothing.*")


def test_full_disk_is_one_line_and_leaves_nothing_that_looks_complete(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "g.pt"
    fxinit.init_graph(_llama()).save(path)
    real_write = os.write
    budget = {"left": 150_000}

    def full_disk_write(fd: int, data: object) -> int:
        n = len(memoryview(data).cast("B"))  # type: ignore[arg-type]
        if n > budget["left"]:
            raise OSError(errno.ENOSPC, "No space left on device")
        budget["left"] -= n
        return real_write(fd, data)

    monkeypatch.setattr("fxinit.export.files.os.write", full_disk_write)
    out = tmp_path / "ckpt"
    assert main(["materialize", str(path), "-o", str(out), "--format", "hf", "--max-shard-size", "60KB",
                 "-q"]) == EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0].startswith("fxinit materialize: error: no space left on the device writing ")
    assert err[1].strip().startswith("hint: free space") and len(err) == 2
    left = sorted(p.name for p in out.iterdir())
    assert not any(".incomplete" in n for n in left) and "model.safetensors.index.json" not in left
    for name in left:
        if name.endswith(".safetensors"):
            safetensors_torch.load_file(out / name)  # what is there under a final name is complete


def test_not_enough_space_is_refused_before_writing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "g.pt"
    fxinit.init_graph(_llama()).save(path)
    monkeypatch.setattr("fxinit.export.files.shutil.disk_usage", lambda p: SimpleNamespace(free=1000))
    assert main(["materialize", str(path), "-o", str(tmp_path / "ckpt"), "--format", "dcp", "-q"]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "not enough disk space" in err and "hint:" in err
    assert not list((tmp_path / "ckpt").glob("*distcp*"))


def test_unwritable_directory_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "g.pt"
    fxinit.init_graph(_llama()).save(path)
    assert main(["materialize", str(path), "-o", str(path / "sub"), "--format", "hf", "-q"]) == EXIT_FAILED
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"fxinit materialize: error: cannot write {path / 'sub'}: not a directory",
                   "  hint: choose a directory you can write with -o"]


def test_command_line_export_and_resume(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "g.pt"
    graph = fxinit.init_graph(_llama(seed=3))
    graph.save(path)
    out = tmp_path / "ckpt"
    assert main(["materialize", str(path), "-o", str(out), "--format", "hf", "--max-shard-size", "100KB",
                 "--rng", "portable", "--dtype", "bfloat16", "-q"]) == EXIT_OK
    assert capsys.readouterr().out.startswith("wrote ")
    ref = graph.materialize(rng="portable", dtype=torch.bfloat16)
    assert all(same_bits(v, ref[k]) for k, v in _files(out).items())
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)  # config.json came with the graph file
    assert loaded.dtype == torch.bfloat16
    assert all(same_bits(v, ref[k]) for k, v in loaded.state_dict().items())
    assert main(["materialize", str(path), "-o", str(out), "--format", "hf", "--max-shard-size", "100KB",
                 "--rng", "portable", "--dtype", "bfloat16", "--resume", "-q"]) == EXIT_OK
    assert "; kept 3 files complete and verified: model-00001-of-00003" in capsys.readouterr().out
    assert main(["materialize", str(path), "-o", str(out / "x.safetensors"), "--resume"]) == 2


def test_producer_bounds_the_bytes_in_flight() -> None:
    pieces = [Piece(f"t{k}", 0, 1, True, 100) for k in range(40)]
    computed, taken, most = [0], [0], [0]

    def compute(batch: tuple[Piece, ...]) -> list[torch.Tensor]:
        computed[0] += len(batch)
        most[0] = max(most[0], computed[0] - taken[0])
        return [torch.zeros(1) for _ in batch]

    order = []
    for piece, _ in Producer(compute, [(p,) for p in pieces], budget=350, workers=2):
        order.append(piece)
        taken[0] += 1
    assert order == pieces
    assert most[0] <= 4  # at most budget / 100 + the one being taken
