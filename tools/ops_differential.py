"""Every operator of PyTorch's OpInfo database, inside a constructor: fxinit against eager.

    python tools/ops_differential.py                 # every op, 8 samples each (about a minute)
    python tools/ops_differential.py --ops fft.rfftn linalg.svd --samples 20

For each sample of each operator that runs on the CPU in float32 (PyTorch's own test inputs,
``torch.testing._internal.common_methods_invocations.op_db``), a module's constructor copies
the sample's tensors into tensors it makes (deferred under ``trace_init``) and keeps the
operator's outputs. Eager construction and ``fxinit.trace_init`` + ``materialize`` are compared:
shapes and dtypes, the strides the capture recorded and the strides materialize gave against
eager's (dimensions of size one aside), and the bits. The capture learns layouts from torch's
meta kernels; where they differ from the CPU kernel's (``linalg_eig``, ``_linalg_svd``'s ``Vh``,
the FFTs, batch norms' saved statistics), code that depends on a layout takes another path
while recording (found by this script and by a sweep of peft: ``capture/layouts.py``).

A ``DeferredInitError`` is a clear refusal: allowed for the operators in ``REFUSED`` only.
Exits 1 on any difference, crash or other refusal. Needs ``expecttest`` (PyTorch's test
helpers import it).
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
import warnings
from typing import Any

import torch
import torch.nn as nn

import fxinit
from fxinit.errors import DeferredInitError

#: refused by name, as docs/failure-modes.md says: sparse results (fxinit records strided tensors)
REFUSED = {"sparse.mm": "a sparse CSR result"}
#: eager construction itself gives other bits from one run to the next: values not compared
NONDETERMINISTIC = {"linalg.lstsq": "LAPACK's gelsy driver: the result depends on the input's memory alignment",
                    **{name: "uninitialized memory" for name in (
                        "empty", "empty_like", "empty_strided", "empty_permuted", "new_empty", "new_empty_strided")}}


class Sample(nn.Module):
    """Copies the sample's tensors into tensors made here, then keeps the operator's outputs."""

    def __init__(self, op: Any, sample: Any) -> None:
        super().__init__()

        def made_here(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.layout == torch.strided and x.device.type == "cpu":
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype).copy_(x)
            return x

        tree_map = torch.utils._pytree.tree_map
        with torch.no_grad():
            out = op(tree_map(made_here, sample.input), *tree_map(made_here, sample.args),
                     **tree_map(made_here, sample.kwargs))
        self.outs = [t for t in torch.utils._pytree.tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        self.recorded = [t.stride() for t in self.outs]


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype == torch.bool or a.numel() == 0:
        return torch.equal(a, b)
    flat = [torch.empty(t.numel(), dtype=t.dtype).copy_(t.reshape(-1)).view(torch.uint8) for t in (a, b)]
    return torch.equal(*flat)


def _strides(t: torch.Tensor, stride: tuple[int, ...]) -> list[int]:
    return [s for s, n in zip(stride, t.shape) if n > 1]


def check_sample(op: Any, sample: Any) -> str | None:
    """None where fxinit gives eager's outputs (or eager itself raises); else what differs."""
    try:
        torch.manual_seed(0)
        eager = Sample(op, sample)
        torch.manual_seed(0)
        again = Sample(op, sample)
    except Exception:  # noqa: BLE001 - not a valid eager program
        return None
    if any(t.layout != torch.strided for t in eager.outs):
        return None
    try:
        torch.manual_seed(0)
        traced = fxinit.trace_init(Sample, op, sample)
        recorded = list(traced.recorded)
        fxinit.materialize(traced)
    except DeferredInitError as exc:
        return None if op.name in REFUSED else f"refused: {str(exc).splitlines()[0]}"
    except Exception as exc:  # noqa: BLE001 - a crash is a finding
        return f"crashed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    for i, (e, t, e2) in enumerate(zip(eager.outs, traced.outs, again.outs)):
        if (e.shape, e.dtype) != (t.shape, t.dtype):
            return f"output {i}: {tuple(t.shape)} {t.dtype}, eager {tuple(e.shape)} {e.dtype}"
        if not (_strides(e, e.stride()) == _strides(e, recorded[i]) == _strides(t, t.stride())):
            return f"output {i}: strides recorded {recorded[i]}, materialized {t.stride()}, eager {e.stride()}"
        deterministic = op.name not in NONDETERMINISTIC and _bits_equal(e, e2)
        if deterministic and not _bits_equal(e, t):
            return f"output {i}: other bits"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", nargs="*", help="operator names (OpInfo's), all if left out")
    parser.add_argument("--samples", type=int, default=8, help="samples per operator")
    args = parser.parse_args(argv)
    warnings.simplefilter("ignore")
    from torch.testing._internal.common_methods_invocations import op_db

    torch.set_num_threads(1)
    start = time.perf_counter()
    counts: collections.Counter = collections.Counter()
    findings: list[str] = []
    for op in op_db:
        if args.ops and op.name not in args.ops or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        try:
            samples = list(op.sample_inputs("cpu", torch.float32, requires_grad=False))[:args.samples]
        except Exception:  # noqa: BLE001 - PyTorch's own sample generator
            continue
        for k, sample in enumerate(samples):
            finding = check_sample(op, sample)
            counts["samples"] += 1
            if finding is not None:
                findings.append(f"{op.name}{'.' + op.variant_test_name if op.variant_test_name else ''} "
                                f"sample {k}: {finding}")
    print(f"{counts['samples']} samples of {len(args.ops) if args.ops else 'every'} operator(s) in "
          f"{time.perf_counter() - start:.0f} s; {len(findings)} differ")
    for line in findings:
        print("  " + line)
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
