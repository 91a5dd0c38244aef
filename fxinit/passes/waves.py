"""Waves: the requested values cut into a few parts that are planned and run one after another.

A GPU runs the kernels it is given asynchronously. Planned whole, a model's slice is planned
before its first kernel is launched, and the GPU waits all that time: planning an 8B Llama's
822 nodes took about half of its materialize's host time on an H100 (cProfile). Cut into waves, the host plans a
wave while the GPU still fills the tensors of the one before it.

Each wave is sliced and planned on its own, as materializing a model's tensors in parts is
(a submodule, then another): every random op draws from its own snapshot or stream, so a
value does not depend on what else is computed with it. Values that share a storage stay in
one wave, so they share it afterwards as they did in eager. A node two waves need (a
temporary two tensors are copied from) runs in each. The largest tensors go first: the first
wave, planned while the device idles, is short to plan and long to run.

On the CPU, kernels run on the thread that launches them, so nothing overlaps and a slice is
planned whole.

>>> waves([(None, 7), (None, 8), (None, 7), (None, 9)], [64, 4096, 64, 16], min_count=1, min_bytes=1)
[[1], [0, 2], [3]]
"""

from __future__ import annotations

from typing import Sequence

from fxinit.passes.slicing import Target

#: Where the waves end, as fractions of the requested values: a short first wave (planned
#: while the device idles), each later one about as long to plan as the one before takes to run.
BOUNDS = (0.04, 0.12, 0.3, 1.0)
#: Fewer values, or fewer bytes, are planned whole: a wave's own costs (slicing, the plan's
#: fixed steps, an interpreter) outweigh the device time it hides. A 32-layer Llama of hidden
#: size 64 (291 tensors, 5 MiB) took 1.4 ms longer in waves on an H100, the 8B one (16 GB)
#: 2 ms less.
MIN_COUNT = 64
MIN_BYTES = 1 << 30


def waves(targets: Sequence[Target], nbytes: Sequence[int], min_count: int | None = None,
          min_bytes: int | None = None) -> list[list[int]]:
    """Indices into ``targets`` (``(value node, storage id)``) by wave, in the order to run
    them, the values sharing a storage in one wave; ``nbytes``: each target's size. One wave
    of every index when there are fewer than ``min_count`` (``MIN_COUNT``) targets or
    ``min_bytes`` (``MIN_BYTES``) bytes."""
    everything = [list(range(len(targets)))]
    if len(targets) < (MIN_COUNT if min_count is None else min_count) or \
            sum(nbytes) < (MIN_BYTES if min_bytes is None else min_bytes):
        return everything
    by_storage: dict[int, list[int]] = {}
    for i, (_, sid) in enumerate(targets):
        by_storage.setdefault(sid, []).append(i)
    storages = sorted(by_storage.values(), key=lambda idx: -max(nbytes[i] for i in idx))
    out: list[list[int]] = [[]]
    bound = iter(BOUNDS)
    limit = next(bound) * len(targets)
    for idx in storages:
        if len(out[-1]) and sum(map(len, out)) >= limit:
            out.append([])
            limit = next(bound, 1.0) * len(targets)
        out[-1] += idx
    return out
