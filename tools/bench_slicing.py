"""Slicing and partitioning the 405B Llama's init graph: fxinit's walks against networkx.

    python tools/bench_slicing.py [--repeat 20]

fxinit slices with ``passes.slicing.Slicer`` (the writers of every storage indexed once per
graph state, then a walk) and partitions with a union-find (``passes.partition``). The
networkx versions computed here give the same nodes: a dependency ``DiGraph`` in which each
write of a storage also gets a *port* node that points to the write and to the previous
port of that storage (so removing dead writes with ``restricted_view`` keeps the chain of
earlier writes), sliced by ``bfs_layers`` from the targets; and ``connected_components`` of
nodes and storages. Each figure is the median of ``--repeat`` runs, in milliseconds.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import networkx as nx  # noqa: E402
import torch  # noqa: E402
import torch.fx as fx  # noqa: E402

import fxinit  # noqa: E402
from fxinit.passes.partition import independent_groups  # noqa: E402
from fxinit.passes.slicing import Slicer, metadata_only  # noqa: E402


def _ms(fn: Callable[[], Any], repeat: int) -> tuple[float, Any]:
    times, out = [], None
    for _ in range(repeat):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3, out


def dependency_graph(nodes: list[fx.Node]) -> tuple[nx.DiGraph, dict[int, Any], list[tuple]]:
    """Edges from a node to what it needs; per-storage write ports chain the writes."""
    g, last, metadata_edges = nx.DiGraph(), {}, []
    for n in nodes:
        g.add_node(n)
        only_specs = metadata_only(n)
        for i in n.all_input_nodes:
            g.add_edge(n, i)
            if only_specs:
                metadata_edges.append((n, i))
        for sid in (*n.meta.get("reads", ()), *n.meta.get("mutates", ())):
            if sid in last:
                g.add_edge(n, last[sid])
        for sid in n.meta.get("mutates", ()):
            port = (n, sid)
            g.add_edge(port, n)
            if sid in last:
                g.add_edge(port, last[sid])
            last[sid] = port
    return g, last, metadata_edges


def nx_slice(g: nx.DiGraph, last: dict[int, Any], metadata_edges: list[tuple], dead: set[fx.Node],
             targets: list[tuple[fx.Node, int]]) -> list[fx.Node]:
    view = nx.restricted_view(g, dead, metadata_edges)
    seeds = list(dict.fromkeys([t for t, _ in targets] + [last[s] for _, s in targets if s in last]))
    found = (n for layer in nx.bfs_layers(view, seeds) for n in layer)
    return sorted((n for n in found if isinstance(n, fx.Node)), key=lambda n: n.meta["pos"])


def nx_groups(nodes: list[fx.Node]) -> list[list[fx.Node]]:
    g, members = nx.Graph(), set(nodes)
    g.add_nodes_from(nodes)
    for n in nodes:
        g.add_edges_from((n, i) for i in n.all_input_nodes if i in members)
        g.add_edges_from((n, ("storage", s)) for s in (*n.meta.get("reads", ()), *n.meta.get("mutates", ())))
    return [sorted((x for x in c if isinstance(x, fx.Node)), key=lambda n: n.meta["pos"])
            for c in nx.connected_components(g)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=20)
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=16384, intermediate_size=53248, num_hidden_layers=126, num_attention_heads=128,
                      num_key_value_heads=8, vocab_size=128256)
    torch.manual_seed(0)
    graph = fxinit.init_graph(fxinit.trace_init(LlamaForCausalLM, cfg))
    nodes, dead = graph.nodes, graph.dead_writes()
    every = [(graph.outputs[n], graph.output_storage[n]) for n in graph.outputs]
    layer = [(graph.outputs[n], graph.output_storage[n]) for n in graph.outputs if n.startswith("model.layers.7.")]
    print(f"the 405B Llama's init graph: {len(nodes)} nodes; milliseconds, median of {args.repeat}")
    build, slicer = _ms(lambda: Slicer(nodes, dead), args.repeat)
    nx_build, (g, last, metadata_edges) = _ms(lambda: dependency_graph(nodes), args.repeat)
    print(f"  index the graph            fxinit {build:8.2f}   networkx {nx_build:8.2f}")
    for label, targets in (("slice every output", every), ("slice one layer", layer)):
        ours, got = _ms(lambda: slicer.required(targets, to_run=True)[0], args.repeat)
        theirs, same = _ms(lambda: nx_slice(g, last, metadata_edges, dead, targets), args.repeat)
        assert got == same, label
        print(f"  {label:<26} fxinit {ours:8.2f}   networkx {theirs:8.2f}   ({len(got)} nodes)")
    run = slicer.required(every, to_run=True)[0]
    ours, groups = _ms(lambda: independent_groups(run), args.repeat)
    theirs, nx_found = _ms(lambda: nx_groups(run), args.repeat)
    assert sorted(map(tuple, groups), key=lambda c: c[0].meta["pos"]) == \
        sorted((tuple(c) for c in nx_found if c), key=lambda c: c[0].meta["pos"])
    print(f"  independent groups         fxinit {ours:8.2f}   networkx {theirs:8.2f}   ({len(groups)} groups)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
