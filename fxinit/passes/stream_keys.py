"""Portable stream keys: a name for every random op of a graph, independent of any slice.

Portable mode draws random op ``key``'s values from the counter-based stream
``rng.portable.stream_key(seed, key)``. Keys are made from the whole captured graph, so
a subset, another order or another process gives every op the same key.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping, Sequence

import torch.fx as fx

from fxinit.ops import is_random


def stream_keys(nodes: Sequence[fx.Node], storage_names: Mapping[int, str]) -> dict[fx.Node, str]:
    """``{random node: key}``: ``"<name of the tensor it writes>/<k>"`` for the k-th random op
    writing that tensor's storage, else ``"<module path>:<op>/<k>"`` for temporaries."""
    counters: dict[str, int] = defaultdict(int)
    keys: dict[fx.Node, str] = {}
    for n in nodes:
        if not is_random(n):
            continue
        written = [storage_names[s] for s in n.meta.get("mutates", ()) if s in storage_names]
        if written:
            base = min(written)
        else:
            op = getattr(getattr(n.target, "overloadpacket", n.target), "__name__", "op")
            base = f"{n.meta.get('module') or ''}:{n.meta.get('opaque') or op}"
        keys[n] = f"{base}/{counters[base]}"
        counters[base] += 1
    return keys
