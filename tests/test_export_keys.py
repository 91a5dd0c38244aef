"""Every export holds exactly what ``model.state_dict()`` holds: its keys after state-dict
hooks, no non-persistent buffers, so ``load_state_dict(..., strict=True)`` takes it; the one
safetensors file is streamed (header first, bounded memory) and files follow the umask."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn as nn

import fxinit
from fxinit.cli import EXIT_OK, main
from tests.conftest import same_bits

safetensors_torch = pytest.importorskip("safetensors.torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")


class Fused(nn.Module):
    """A fused projection saved as three (torchtitan's FusedQKVLinear does this), a
    non-persistent cache and a persistent buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)
        self.register_buffer("cache", torch.arange(6.0), persistent=False)
        self.register_buffer("steps", torch.ones(3))
        self.register_state_dict_post_hook(self._split)
        self.register_load_state_dict_pre_hook(self._merge)

    @staticmethod
    def _split(module: nn.Module, state: dict, prefix: str, local_metadata: dict) -> None:
        for p in ("weight", "bias"):
            fused = state.pop(f"{prefix}qkv.{p}")
            for name, part in zip("qkv", fused.chunk(3)):
                state[f"{prefix}{name}.{p}"] = part.contiguous()

    @staticmethod
    def _merge(module: nn.Module, state: dict, prefix: str, *args: object) -> None:
        for p in ("weight", "bias"):
            keys = [f"{prefix}{name}.{p}" for name in "qkv"]
            if all(k in state for k in keys):
                state[f"{prefix}qkv.{p}"] = torch.cat([state.pop(k) for k in keys])


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = Fused()
        self.head = nn.Linear(8, 4)


def _eager_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return Model().state_dict()


def _traced() -> nn.Module:
    torch.manual_seed(0)
    return fxinit.trace_init(Model)


def _assert_loads_strictly(state: dict[str, torch.Tensor]) -> None:
    want = _eager_state()
    assert list(state) == list(want), "the keys and order of state_dict()"
    for k in want:
        assert same_bits(state[k], want[k]), k
    torch.manual_seed(1)
    fresh = Model()
    fresh.load_state_dict(state, strict=True)
    for k, v in fresh.state_dict().items():
        assert same_bits(v, want[k]), k


def test_single_file_holds_the_state_dict(tmp_path: Path) -> None:
    fxinit.save(_traced(), tmp_path / "w.safetensors", format="safetensors")
    _assert_loads_strictly(safetensors_torch.load_file(tmp_path / "w.safetensors"))


def test_hf_directory_holds_the_state_dict(tmp_path: Path) -> None:
    fxinit.save(_traced(), tmp_path / "ckpt", format="hf")
    _assert_loads_strictly(safetensors_torch.load_file(tmp_path / "ckpt" / "model.safetensors"))


def test_dcp_holds_the_state_dict(tmp_path: Path) -> None:
    fxinit.save(_traced(), tmp_path / "ckpt", format="dcp")
    torch.manual_seed(1)
    state = Model().state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path / "ckpt"))
    _assert_loads_strictly(state)


def test_graph_file_exports_hold_the_state_dict(tmp_path: Path) -> None:
    """Through an init-graph file and the command line: the graph's outputs are the
    state_dict's keys (then the non-persistent buffers, which exports leave out)."""
    graph = fxinit.init_graph(_traced())
    assert [k for k in graph.outputs if graph.info[k].persistent] == list(_eager_state())
    assert "block.cache" in graph.outputs and not graph.info["block.cache"].persistent
    graph.save(tmp_path / "init.pt")
    assert main(["materialize", str(tmp_path / "init.pt"), "-o", str(tmp_path / "w.safetensors"), "-q"]) == EXIT_OK
    _assert_loads_strictly(safetensors_torch.load_file(tmp_path / "w.safetensors"))


def test_single_file_is_streamed_in_bounded_memory(tmp_path: Path) -> None:
    """A tensor larger than ``memory`` is computed and written in pieces; the progress counts
    every byte of the file (header included); the file equals materialize's values."""
    class Big(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4096, 300))  # 4.9 MB
            self.b = nn.Parameter(torch.zeros(300))

    torch.manual_seed(0)
    traced = fxinit.trace_init(Big)
    done = fxinit.save(traced, tmp_path / "big.safetensors", format="safetensors", memory="1MiB", workers=1)
    assert done.bytes == os.path.getsize(tmp_path / "big.safetensors") and done.finished
    got = safetensors_torch.load_file(tmp_path / "big.safetensors")
    torch.manual_seed(0)
    want = Big()
    assert same_bits(got["w"], want.w) and same_bits(got["b"], want.b)
    assert [p.name for p in tmp_path.iterdir()] == ["big.safetensors"], "no temporary or record files left"


def test_files_follow_the_umask(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        fxinit.save(_traced(), tmp_path / "w.safetensors", format="safetensors")
        fxinit.save(_traced(), tmp_path / "ckpt", format="hf")
    finally:
        os.umask(old)
    assert (tmp_path / "w.safetensors").stat().st_mode & 0o777 == 0o664
    assert (tmp_path / "ckpt" / "model.safetensors").stat().st_mode & 0o777 == 0o664


def test_single_file_refuses_directory_options(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="part= and resume="):
        fxinit.save(_traced(), tmp_path / "w.safetensors", format="safetensors", resume=True)
