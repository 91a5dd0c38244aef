"""tools/gpu_check.py, the GPU checks of the compiled-backends issue, run on the CPU so that
the script a lent GPU machine runs cannot rot: its ulp measure, its classification of
tensors by the random ops that wrote them, and a whole small run."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))

import gpu_check  # noqa: E402

import fxinit  # noqa: E402


def test_ulp_distance_counts_representable_values() -> None:
    one = torch.tensor([1.0, -2.0, 0.0, 3.0])
    up = torch.nextafter(one, torch.full_like(one, float("inf")))
    assert gpu_check.ulp_distance(one, one) == 0
    assert gpu_check.ulp_distance(one, up) == 1
    assert gpu_check.ulp_distance(one, torch.nextafter(up, torch.full_like(one, float("inf")))) == 2
    assert gpu_check.ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])) == 0
    tiny = torch.tensor([torch.finfo(torch.float32).tiny * 2 ** -23])  # the smallest subnormal
    assert gpu_check.ulp_distance(tiny, -tiny) == 2  # across zero
    assert gpu_check.ulp_distance(torch.tensor([float("nan")]), torch.tensor([1.0])) == -1
    b = torch.tensor([1.0, 0.5], dtype=torch.bfloat16)
    assert gpu_check.ulp_distance(b, b.view(torch.int16).add(3).view(torch.bfloat16)) == 3
    assert gpu_check.ulp_distance(torch.arange(3), torch.arange(3)) == 0


def test_tensors_are_classified_by_the_random_ops_that_run_for_them() -> None:
    m = fxinit.trace_init(lambda: torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Embedding(5, 4),
                                                       torch.nn.LayerNorm(4)))
    graph = fxinit.init_graph(m)
    families = {name: gpu_check._family(gpu_check.random_kinds(graph, name)) for name in graph.outputs}
    assert families == {"0.weight": "uniform", "0.bias": "uniform", "1.weight": "normal", "2.weight": "not random",
                        "2.bias": "not random"}


def test_whole_run_on_cpu(capsys) -> None:
    assert gpu_check.main(["--device", "cpu", "--small", "--dtypes", "bfloat16", "--corpus-every", "0",
                           "--sizes", "1,1000", "--no-compile-times"]) == 0
    out = capsys.readouterr().out
    assert "bitwise equal to eager" in out and "all within bounds" in out
    assert "first rows bitwise equal to the CPU's" in out and "portable inductor" in out
    assert all(f"{path:<11}" in out for path in ("torch ops", "triton", "inductor"))
    # the inits, 4 dtypes x 2 sizes of ops, 2 dtypes x 2 sizes of samplers
    assert "device contexts on cpu: 13 constructors" in out and "all equal to eager, bit for bit" in out
    assert "llama" in out and "uniform" in out and "normal" in out


def test_the_no_gpu_trace_of_the_contexts_section_records_every_constructor(tmp_path) -> None:
    """On CUDA, gpu_check traces its constructors in a process that sees no GPU and
    materializes the saved graphs on the GPU: here, that tracing half."""
    import subprocess

    import gpu_contexts

    if torch.cuda.is_available():
        return  # gpu_check runs it whole there
    code = gpu_contexts._TRACE_ELSEWHERE.format(tools=str(Path(gpu_contexts.__file__).parent), out=str(tmp_path))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and not run.stdout.strip(), run.stdout + run.stderr[-2000:]
    names = list(gpu_contexts.constructors(device_here=False))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{i}.pt" for i in range(len(names)))
    graph = fxinit.load_graph(tmp_path / "0.pt")  # "inits": LSTM, GRU, Embedding, eye(out=), legacy Tensor
    devices = {name: str(spec.device) for name, spec in graph.specs().items()} if hasattr(graph, "specs") else {}
    assert all(s.device in ("cuda:0", "cpu") for s in graph.snapshots.values())
    assert any(s.device == "cuda:0" for s in graph.snapshots.values()), devices


def test_compile_times_run_in_fresh_processes() -> None:
    """The bench's cold and warm compile times: two child processes sharing fresh caches."""
    import gpu_portable

    (row,) = gpu_portable.compile_times(torch.device("cpu"), ("None",))  # the C kernel: nothing to compile
    assert row == {"compile": "None", "cold_s": 0.0, "warm_s": 0.0, "kernels": 0}
