"""Init dependencies as a networkx graph, for analysis with networkx's algorithms.

``InitGraph.to_networkx()`` returns a ``networkx.DiGraph`` whose nodes are the init graph's
op nodes (by name) and its parameter/buffer names, with an edge from everything a node needs
to the node: its inputs, and the earlier writes of every storage it reads or writes (the
graph is imperative: ``normal_(w)`` after ``empty(...)`` needs the ``empty``, and a read of
``w`` after ``mul_(w, 2)`` needs both). So ``networkx.ancestors(g, "lm_head.weight")`` is
everything that tensor's value comes from — what ``InitGraph.required_nodes(...,
eliminate_dead=False)`` slices — and the algorithms of networkx answer the other questions
one has about a model's init:

>>> import networkx as nx, torch, fxinit
>>> _ = torch.manual_seed(0)
>>> g = fxinit.init_graph(fxinit.trace_init(torch.nn.Linear, 4, 3)).to_networkx()
>>> [(n, g.nodes[n]["op"]) for n in nx.topological_sort(g.subgraph(nx.ancestors(g, "bias")))]
[('empty_memory_format_1', 'empty'), ('uniform__default_1', 'uniform_')]
>>> [n for n in g if g.nodes[n]["random"] and not nx.has_path(g, n, "weight")]  # random ops the weight does not need
['uniform__default_1']

Node attributes: ``kind`` (``"op"`` or ``"tensor"``), ``op`` (``normal_``, ``empty``, …),
``random``, ``dead`` (a write overwritten before anything reads it: never run), ``module``,
``source`` (file:line of the model code), ``shape`` and ``dtype`` (of the value a node
creates; None for in-place ops). Edge attribute ``kind``:
``"input"`` (an argument), ``"storage"`` (an earlier write of a storage the node reads or
writes) or ``"output"`` (to a tensor name from the node holding its value, or from the last
write of its storage).

fxinit itself slices and partitions with hand-written walks, measured faster than networkx on
the 405B Llama's graph (``python tools/bench_slicing.py``); this view is for users' analysis.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, AbstractSet, Mapping, Sequence

import torch.fx as fx

from fxinit.ops import is_random, op_name

if TYPE_CHECKING:
    import networkx as nx


def dependency_graph(nodes: Sequence[fx.Node], outputs: Mapping[str, fx.Node],
                     output_storage: Mapping[str, int], dead: AbstractSet[fx.Node]) -> "nx.DiGraph":
    """The dependency ``DiGraph`` of an init graph's op ``nodes`` (program order) and its
    ``outputs`` (see the module doc); ``dead``: the writes ``passes.dead_init`` found dead."""
    import networkx as nx

    g = nx.DiGraph()
    last: dict[int, str] = {}  # storage id -> the last node that wrote it
    for n in nodes:
        spec = n.meta.get("spec")
        prov = n.meta.get("prov")
        g.add_node(n.name, kind="op", op=op_name(n) if n.op == "call_function" else n.op, random=is_random(n),
                   dead=n in dead, module=n.meta.get("module") or "", source=getattr(prov, "source", None) or "",
                   shape=tuple(spec.shape) if spec is not None else None,
                   dtype=spec.dtype if spec is not None else None)
        for i in n.all_input_nodes:
            g.add_edge(i.name, n.name, kind="input")
        for sid in (*n.meta.get("reads", ()), *n.meta.get("mutates", ())):
            if sid in last and last[sid] != n.name and not g.has_edge(last[sid], n.name):
                g.add_edge(last[sid], n.name, kind="storage")
        for sid in n.meta.get("mutates", ()):
            last[sid] = n.name
    for name, value in outputs.items():
        spec = value.meta["spec"]
        g.add_node(name, kind="tensor", op=None, random=False, dead=False, module=name.rpartition(".")[0],
                   source="", shape=tuple(spec.shape), dtype=spec.dtype)
        g.add_edge(value.name, name, kind="output")
        writer = last.get(output_storage[name])
        if writer is not None and writer != value.name:
            g.add_edge(writer, name, kind="output")
    return g

