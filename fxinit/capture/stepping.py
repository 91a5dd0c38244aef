"""Generator stepping: every random op gets a snapshot of the generator it draws from, and
the generator is left exactly where eager construction leaves it.

When an op's consumption is a known pure advance (``rng.draws``: calibrated per kind of
call), the generator skips ahead (``rng.mt19937.advance``; the default CPU generator lazily,
``capture.skips``); otherwise the op runs for real on scratch tensors.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from fxinit.capture.skips import LazyCpuGenerator
from fxinit.rng import Snapshot, mt19937
from fxinit.rng.draws import cpu_draws
from fxinit.rng.philox import CHAINS, PendingPhilox, queued_seed, reservation


class GeneratorStepper:
    """The snapshots of one trace's random ops, by key, and the generators' positions."""

    def __init__(self) -> None:
        self.snapshots: dict[str, Snapshot] = {}
        self.lazy_cpu = LazyCpuGenerator()  # the default CPU generator, skipped lazily inside capture
        self.random_ops = {"skipped": 0, "drawn": 0}  # how capture kept generators in step

    def snapshot(self, gen: torch.Generator) -> str:
        """Snapshot ``gen`` as it is now; its key in ``snapshots``."""
        key = f"rng{len(self.snapshots)}"
        if self._lazy(gen):
            self.snapshots[key] = self.lazy_cpu.position()
        else:
            self.snapshots[key] = self.lazy_cpu.true_snapshot(gen)
        return key

    def step_absent(self, func: Any, args: tuple, kwargs: dict, device: torch.device, filled: list[Any]) -> str:
        """Snapshot the default CUDA generator of ``device``, which this machine lacks, for
        random op ``func`` (``rng.philox``): the state is computed on the device later.
        Raises ``LookupError`` (with the reason) when that cannot be exact."""
        if device.type != "cuda":
            raise LookupError(f"fxinit follows the generators of absent devices only for CUDA, not {device.type}")
        out = next((t for f in filled for t in ((f,) if isinstance(f, torch.Tensor) else f)
                    if isinstance(t, torch.Tensor)), None)
        reserved = reservation(func, args, kwargs, out) if out is not None else None
        if reserved is None:
            raise LookupError(f"fxinit does not know how far {func} moves the CUDA generator")
        call, seed = queued_seed(device)
        dev = str(device)
        chain = CHAINS.get(dev)  # the process's generator: a later trace continues the chain
        if chain is not None and chain[0] is call and chain[1].seed == seed:
            snap = PendingPhilox(dev, seed, chain[1], chain[2])
        else:  # seeded since (or the first op): offset 0
            snap = PendingPhilox(dev, seed, None, None)
        CHAINS[dev] = (call, snap, reserved)
        key = f"rng{len(self.snapshots)}"
        self.snapshots[key] = snap
        self.random_ops["skipped"] += 1
        return key

    def _lazy(self, gen: torch.Generator) -> bool:
        return gen is torch.default_generator and self.lazy_cpu.active

    def step(self, func: Any, args: tuple, kwargs: dict, device: torch.device, gen: torch.Generator,
             filled: list[Any], draw_for_real: Callable[[], None]) -> str:
        """Snapshot ``gen`` for random op ``func`` (returns its key in ``snapshots``) and leave
        it where eager would: skip ahead when the op's consumption is a known pure advance,
        else ``draw_for_real()`` (which runs the op on scratch tensors)."""
        draws = None
        if device.type == "cpu" and len(filled) == 1 and isinstance(filled[0], torch.Tensor):
            draws = cpu_draws(func, args, kwargs, filled[0])
        if draws is None:
            key = self.snapshot(gen)
            self.random_ops["drawn"] += 1
            self.lazy_cpu.flush()
            draw_for_real()
            return key
        key = f"rng{len(self.snapshots)}"
        if self._lazy(gen):
            self.snapshots[key] = self.lazy_cpu.skip(draws)
        else:
            start = self.snapshots[key] = self.lazy_cpu.true_snapshot(gen)
            gen.set_state(mt19937.advance(start.state, draws))
        self.random_ops["skipped"] += 1
        return key
