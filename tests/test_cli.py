"""The fxinit command: trace -> show / explain / viz -> materialize to safetensors, with
exit codes and one-line errors."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fxinit.cli import EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, EXIT_USAGE, main
from tests.cli_models import Stack
from tests.conftest import same_bits

safetensors_torch = pytest.importorskip("safetensors.torch")
ROOT = Path(__file__).resolve().parent.parent


def _trace(tmp_path: Path, layers: int = 2, seed: int = 0) -> Path:
    out = tmp_path / f"stack{layers}.pt"
    assert main(["trace", "tests.cli_models:build", "-o", str(out), "--kwargs", json.dumps({"layers": layers}),
                 "--seed", str(seed)]) == EXIT_OK
    return out


def test_trace_show_materialize_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = _trace(tmp_path, seed=5)
    assert main(["show", str(graph)]) == EXIT_OK
    table = capsys.readouterr().out
    assert "layers.1.fc.weight" in table and "(uniform_ [kaiming_uniform_]: dead) -> normal_" in table
    assert "tied to embed.weight" in table and "tensors," in table

    weights = tmp_path / "w.safetensors"
    assert main(["materialize", str(graph), "-o", str(weights), "-q"]) == EXIT_OK
    got = safetensors_torch.load_file(weights)
    torch.manual_seed(5)
    eager = Stack(layers=2)
    ref = eager.state_dict()
    assert "head.weight" not in got  # a tie is stored once...
    from safetensors import safe_open

    with safe_open(str(weights), "pt") as f:
        assert json.loads(f.metadata()["fxinit.ties"]) == [["embed.weight", "head.weight"]]  # ...and recorded
    for name, value in got.items():
        assert same_bits(value, ref[name]), name
    assert set(got) == set(ref) - {"head.weight"}


def test_portable_materialize_from_the_command_line(tmp_path: Path) -> None:
    graph = _trace(tmp_path)
    a, b = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert main(["materialize", str(graph), "-o", str(a), "--rng", "portable", "-q"]) == EXIT_OK
    assert main(["materialize", str(graph), "-o", str(b), "--rng", "portable", "--only", "layers.1.*", "-q"]) == EXIT_OK
    whole, part = safetensors_torch.load_file(a), safetensors_torch.load_file(b)
    assert part and all(torch.equal(v, whole[k]) for k, v in part.items())
    compiled = tmp_path / "c.safetensors"  # kernels torch.compile generates: the same bits
    assert main(["materialize", str(graph), "-o", str(compiled), "--rng", "portable", "--compile", "-q"]) == EXIT_OK
    assert all(same_bits(v, whole[k]) for k, v in safetensors_torch.load_file(compiled).items())


def test_materialize_in_another_dtype(tmp_path: Path) -> None:
    graph = _trace(tmp_path, seed=3)
    out = tmp_path / "bf16.safetensors"
    assert main(["materialize", str(graph), "-o", str(out), "--dtype", "bfloat16", "-q"]) == EXIT_OK
    got = safetensors_torch.load_file(out)
    torch.manual_seed(3)
    ref = Stack(layers=2).to(torch.bfloat16).state_dict()
    assert got and all(v.dtype == torch.bfloat16 and same_bits(v, ref[k]) for k, v in got.items())


def test_show_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = _trace(tmp_path)
    capsys.readouterr()
    assert main(["show", str(graph), "--plan", "--only", "layers.1", "--dtype", "bfloat16"]) == EXIT_OK
    plan = capsys.readouterr().out
    assert plan.startswith("plan: ") and "output dtype bfloat16" in plan and "-> layers.1.fc.weight" in plan
    assert "dead write" in plan  # kaiming_uniform_'s draw, overwritten by normal_


def test_only_and_explain(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    graph = _trace(tmp_path)
    assert main(["show", str(graph), "--only", "layers.1"]) == EXIT_OK
    table = capsys.readouterr().out
    assert "layers.1.norm.bias" in table and "layers.0." not in table
    assert main(["show", str(graph), "--explain", "layers.0.fc.weight"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "DEAD: overwritten by step" in text and "torch.nn.init.kaiming_uniform_" in text
    assert "test_cli" not in text and "cli_models.py" in text  # the user's source line
    weights = tmp_path / "part.safetensors"
    assert main(["materialize", str(graph), "-o", str(weights), "--only", "layers.0.*", "-q"]) == EXIT_OK
    assert set(safetensors_torch.load_file(weights)) == {f"layers.0.{k}" for k in
                                                          ("fc.weight", "fc.bias", "norm.weight", "norm.bias")}


def test_trace_from_a_file_path(tmp_path: Path) -> None:
    out = tmp_path / "f.pt"
    target = f"{ROOT / 'tests' / 'cli_models.py'}:Stack"
    assert main(["trace", target, "-o", str(out), "--args", "[3]"]) == EXIT_OK
    import fxinit

    assert "layers.2.fc.weight" in fxinit.load_graph(out).outputs


def test_viz_collapses_repeated_layers_and_focuses(tmp_path: Path) -> None:
    graph = _trace(tmp_path, layers=5)
    full = tmp_path / "full.dot"
    assert main(["viz", str(graph), "-o", str(full)]) == EXIT_OK
    text = full.read_text()
    assert "x5: 5 numbered siblings share this recipe" in text
    assert "layers.0.fc.weight" in text and "layers.3.fc.weight" not in text
    flat = tmp_path / "flat.dot"
    assert main(["viz", str(graph), "-o", str(flat), "--no-collapse"]) == EXIT_OK
    assert "layers.3.fc.weight" in flat.read_text()
    two = tmp_path / "two.dot"  # collapsing starts at two copies
    assert main(["viz", str(_trace(tmp_path, layers=2)), "-o", str(two)]) == EXIT_OK
    assert "x2: 2 numbered siblings" in two.read_text() and "layers.1.fc.weight" not in two.read_text()
    from fxinit.viz import LEGEND

    drawn = [text for text in LEGEND.values() if text in flat.read_text()]
    assert "green: parameter / buffer" in drawn and "thick frame: numbered siblings drawn once" not in drawn
    assert "blue: constant" not in drawn or "fillcolor=\"#92c5de\"" in flat.read_text()
    focus = tmp_path / "focus.dot"
    assert main(["viz", str(graph), "-o", str(focus), "--only", "layers.2.fc.weight"]) == EXIT_OK
    assert "layers.2.fc.weight" in focus.read_text() and "embed.weight" not in focus.read_text()
    if shutil.which("dot"):
        svg = tmp_path / "d.svg"
        assert main(["viz", str(graph), "-o", str(svg)]) == EXIT_OK
        assert svg.read_text().lstrip().startswith(("<?xml", "<svg"))


def test_errors_are_one_line_with_meaningful_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["trace", "no_such_module:thing", "-o", str(tmp_path / "x.pt")]) == EXIT_USAGE
    assert main(["trace", "tests.cli_models:build", "-o", str(tmp_path / "x.pt"), "--kwargs", "{bad"]) == EXIT_USAGE
    graph = _trace(tmp_path)
    broken = tmp_path / "broken.pt"
    data = bytearray(graph.read_bytes())
    data[len(data) // 2] ^= 0x01
    broken.write_bytes(bytes(data))
    assert main(["show", str(broken)]) == EXIT_FAILED
    assert main(["show", str(graph), "--only", "nothing.here"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "checksum mismatch" in err and "hint:" in err and "Traceback" not in err
    with pytest.raises(SystemExit) as exc:
        main(["materialize"])
    assert exc.value.code == EXIT_USAGE


def test_errors_keep_the_source_line_and_unavailable_devices_fail_first(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert main(["trace", "tests.cli_refused:Reads", "-o", str(tmp_path / "r.pt")]) == EXIT_FAILED
    err = capsys.readouterr().err
    assert "source:" in err and "cli_refused.py" in err and "self.w.sum() > 0" in err and "Traceback" not in err
    graph = _trace(tmp_path)
    from fxinit.export import source as export_source

    def no_compute(*args: object, **kwargs: object) -> None:
        raise AssertionError("values were computed before the device was checked")

    monkeypatch.setattr(export_source.Source, "compute", no_compute)
    for fmt in ("safetensors", "hf"):
        out = tmp_path / ("w.safetensors" if fmt == "safetensors" else "ckpt")
        assert main(["materialize", str(graph), "-o", str(out), "--format", fmt, "--device", "cuda:7", "-q"]) \
            == EXIT_FAILED
        err = capsys.readouterr().err
        assert err.count("\n") <= 2 and "cuda:7" in err and "not available" in err, err


def test_interrupt_is_one_line_exit_130_and_says_how_to_resume(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    graph = _trace(tmp_path, layers=4)
    out = tmp_path / "ckpt"
    argv = ["materialize", str(graph), "-o", str(out), "--format", "hf", "--max-shard-size", "1KB", "-q"]
    from fxinit.export import hf

    write = hf._write_shard
    calls = []

    def interrupted_after_two(*args: object, **kwargs: object) -> tuple[int, int]:
        calls.append(1)
        if len(calls) > 2:
            raise KeyboardInterrupt
        return write(*args, **kwargs)

    monkeypatch.setattr(hf, "_write_shard", interrupted_after_two)
    assert main(argv) == EXIT_INTERRUPTED
    err = capsys.readouterr().err
    assert "Traceback" not in err and "interrupted" in err
    command = err.split("resume with: ")[1].strip()
    assert command.startswith("fxinit materialize") and command.endswith("--resume")
    monkeypatch.setattr(hf, "_write_shard", write)
    assert main(shlex.split(command)[1:]) == EXIT_OK
    assert "kept 2 files complete and verified" in capsys.readouterr().out


@pytest.mark.parametrize("command", [[], ["trace"], ["show"], ["viz"], ["materialize"]])
def test_help_everywhere(command: list[str]) -> None:
    script = Path(sys.executable).parent / "fxinit"  # the console script pip installed
    proc = subprocess.run([str(script), *command, "--help"], capture_output=True, text=True)
    assert proc.returncode == 0 and "usage: fxinit" in proc.stdout


def test_help_shows_pt_examples() -> None:
    from fxinit.cli import build_parser

    top = build_parser().format_help()
    assert "trace my_pkg.models:build -o init.pt" in top and "materialize init.pt -o weights.safetensors" in top
    assert ".fxg" not in top


def test_target_module_in_the_working_directory(tmp_path, monkeypatch, capsys) -> None:
    """``fxinit check mymodels:Net`` in the directory that holds mymodels.py, as a console
    script runs it (the working directory is not on sys.path by itself); --app-dir elsewhere."""
    (tmp_path / "fxinit_cwd_models.py").write_text(
        "import torch.nn as nn\n\ndef Net():\n    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "fxinit_cwd_models", raising=False)
    monkeypatch.chdir(tmp_path)
    assert main(["check", "fxinit_cwd_models:Net"]) == EXIT_OK
    assert "EQUAL" in capsys.readouterr().out

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p != str(tmp_path)])
    monkeypatch.delitem(sys.modules, "fxinit_cwd_models", raising=False)
    monkeypatch.chdir(elsewhere)
    assert main(["check", "fxinit_cwd_models:Net"]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert str(elsewhere) in err and "--app-dir" in err
    assert main(["check", "fxinit_cwd_models:Net", "--app-dir", str(tmp_path)]) == EXIT_OK
