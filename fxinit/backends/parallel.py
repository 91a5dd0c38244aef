"""Running a plan's independent groups: one after the other, or on threads.

Exact in any order and interleaving: groups share no value and no storage, and every
random op draws from its own snapshot or stream. Running a group to its end before the
next starts also bounds memory: a model allocates all its tensors before it initializes
any (``post_init``), and a layout step (a rank's shard copied out of a full tensor) comes
after all of that, so program order would hold every full tensor at once.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping

import torch
import torch.fx as fx

from fxinit.backends.heap import HeapWatch
from fxinit.backends.interpreter import Interpreter, Sampler
from fxinit.numerics import Settings, distinct_settings, settings_applied
from fxinit.ops import allocates
from fxinit.plan import Plan
from fxinit.rng.portable import serial_fills


#: Plans allocating less on the CPU run their groups on one thread. Handing hundreds of groups
#: of a few KiB each to threads cost more than they ran: a 32-layer Llama of hidden size 64
#: (595 nodes, 292 groups, 5 MiB) ran in 46 ms on 2 threads, 35 ms on one. Bytes on a GPU do
#: not count: its kernels run asynchronously whichever thread launches them, and threads only
#: contend for the GIL and the driver's launch lock (an 8B Llama in bfloat16 on an H100: 137 ms
#: on 16 threads, 40 ms on one, eager 39 ms).
SERIAL_BELOW_BYTES = 16 << 20


def run_plan(plan: Plan, constants: Mapping[str, torch.Tensor], sampler: Sampler, settings: Settings,
             workers: int | None = None) -> dict[fx.Node, Any]:
    """The kept values of ``plan``, its groups run on up to ``workers`` threads (default:
    torch's thread count; below ``SERIAL_BELOW_BYTES`` allocated on the CPU, one, in program order:
    the plan holds little at once whatever the order, and its groups need not be found). Slices whose
    ops were recorded under different settings (default dtype, ``fxinit.numerics``) run on one
    thread (the settings are process-global)."""
    sampler.prepare(plan.random_nodes)
    small = _allocated_on_cpu_below(plan, SERIAL_BELOW_BYTES)
    workers = workers or (1 if small else torch.get_num_threads())
    if (small and workers == 1) or len(plan.groups) < 2:  # one run in program order: little to give back
        return Interpreter(plan, constants, sampler, settings).run()
    distinct = distinct_settings(settings, plan.nodes)
    env: dict[fx.Node, Any] = {}
    heap = HeapWatch()  # freed temporaries do not stay resident
    if workers == 1 or len(distinct) > 1:
        interpreter = Interpreter(plan, constants, sampler, settings)  # one batch of fills spans groups
        for group in plan.groups:
            values = interpreter.run(group, finish=False)
            heap.kept(values.values(), _allocated(group, plan.unbacked))
            env.update(values)
        interpreter.finish()
        return env
    (settings,) = distinct
    every_core_busy = len(plan.groups) >= workers  # then a fill uses only its own thread

    def run(group: list[fx.Node]) -> dict[fx.Node, Any]:
        interpreter = Interpreter(plan, constants, sampler, settings)
        if every_core_busy:
            with serial_fills():
                values = interpreter.run(group)
        else:
            values = interpreter.run(group)
        heap.kept(values.values(), _allocated(group, plan.unbacked))
        return values

    with settings_applied(settings), ThreadPoolExecutor(min(workers, len(plan.groups)), "fxinit") as pool:
        for values in pool.map(run, plan.groups):
            env.update(values)
    return env


def _allocated_on_cpu_below(plan: Plan, limit: int) -> bool:
    """Whether running ``plan`` allocates less than ``limit`` bytes on the CPU. Without an output
    dtype, ``_allocated`` of its CPU nodes bounds that from above and is cheaper to sum
    (``Plan.bytes_allocated`` is the exact figure)."""
    if plan.output_dtype is None and _allocated([n for n in plan.nodes if plan.runs_on(n).type == "cpu"],
                                                plan.unbacked) < limit:
        return True
    return plan.bytes_allocated("cpu") < limit


def _allocated(group: list[fx.Node], unbacked: frozenset[fx.Node]) -> int:
    """Bytes the nodes of ``group`` allocate, at most (before in-place chains and reuse)."""
    return sum(n.meta["spec"].nbytes for n in group
               if allocates(n) and n.meta.get("spec") is not None and n not in unbacked)
