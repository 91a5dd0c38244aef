"""Dead-init elimination: writes that a later write replaces before anyone reads them.

transformers draws every Linear weight with ``kaiming_uniform_`` in ``reset_parameters``
and then overwrites it with ``normal_`` in ``_init_weights``; users re-init after
construction. The first write is dead: executing it cannot change any value.

A node is an *overwrite* of a storage (``meta["overwrites"]``, decided at capture) when
it writes every byte of it and its result does not depend on the old contents
(``uniform_``, ``normal_``, ``fill_``, ``copy_`` from elsewhere, ``trunc_normal_``...).
A write is dead when each storage it writes is overwritten before the next read of that
storage, and nothing uses its value otherwise.

Skipping a dead *random* op stays exact because every random op starts from its own
generator snapshot: later ops do not depend on the dead one having run.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Sequence

import torch.fx as fx

from fxinit.ops import is_view, reads_no_data


def dead_writes(nodes: Sequence[fx.Node]) -> set[fx.Node]:
    """The nodes of ``nodes`` (program order) whose writes are all overwritten unread."""
    pending: dict[int, list[fx.Node]] = defaultdict(list)  # storage -> writes not yet read
    dead_on: dict[fx.Node, set[int]] = defaultdict(set)
    for n in nodes:
        overwrites = set(n.meta.get("overwrites", ()))
        for sid in () if is_view(n) or reads_no_data(n) else n.meta.get("reads", ()):  # (a view reads no data)
            if sid not in overwrites:
                pending.pop(sid, None)  # read: those writes are live
        for sid in overwrites:
            for w in pending.pop(sid, ()):
                dead_on[w].add(sid)
        for sid in n.meta.get("mutates", ()):
            pending[sid].append(n)
    return {w for w, sids in dead_on.items() if sids >= set(w.meta.get("mutates", ())) and not w.users}
