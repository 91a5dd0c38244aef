"""graphviz drawings of init dependencies.

One box per op and one note per parameter/buffer, nested in clusters by module path;
random ops orange, constants blue, outputs green, dead writes grey and dashed; the legend
lists the kinds of marks the drawing has. Repeated layers (``layers.0`` … ``layers.79``,
two or more, with the same recipe) are drawn once with a count, so an 80-layer model reads
like a 1-layer one; ``names`` restricts the drawing to the ancestry of some tensors.
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from typing import Iterable

import torch.fx as fx

from fxinit.graph import InitGraph
from fxinit.ops import is_random, op_name
from fxinit.report import step

_PLUMBING = {"detach", "alias"}

RANDOM, CONSTANT, OUTPUT, DEAD_TEXT = "#f4a582", "#92c5de", "#d9f0d3", "grey50"
#: What each kind of mark means, in the legend's order; a drawing's legend lists the kinds it has.
LEGEND = {
    "random": "orange: random op",
    "constant": "blue: constant",
    "output": "green: parameter / buffer",
    "dead": "grey dashed: dead write (never run)",
    "opaque": "bold border: an init function replayed whole",
    "next_write": "dashed arrow: next write to the same storage",
    "collapsed": "thick frame: numbered siblings drawn once",
}


def legend(kinds: set[str]) -> str:
    """The legend line of a drawing that has ``kinds`` of marks (keys of ``LEGEND``)."""
    return "   ".join(text for kind, text in LEGEND.items() if kind in kinds)
_NUMBERED = re.compile(r"^(.*?)(?:^|\.)(\d+)(?=\.|$)")


def draw(graph: InitGraph, out: Path, names: Iterable[str] | None = None, collapse: bool = True) -> Path:
    """Render ``graph`` to ``out`` (format from its suffix: .svg, .png, .pdf, .dot) and
    return the path written. Without graphviz's ``dot`` program the ``.dot`` source is
    written next to ``out`` instead."""
    import graphviz

    wanted = list(graph.outputs) if names is None else list(names)
    nodes = graph.required_nodes(wanted, eliminate_dead=False)
    hidden, counts = _collapsed(graph, nodes, wanted) if collapse else (set(), {})
    dead = graph.dead_writes()
    font = {"fontname": "Helvetica", "fontsize": "10"}
    dot = graphviz.Digraph("init_deps", graph_attr={"rankdir": "LR", "labelloc": "t", "newrank": "true", **font},
                           node_attr={"shape": "box", "style": "rounded,filled", "fillcolor": "white", **font},
                           edge_attr={"color": "grey40"})
    clusters: dict[str, list[tuple[str, dict[str, str]]]] = defaultdict(list)
    last_write: dict[int, str] = {}
    alias_of: dict[fx.Node, fx.Node] = {}  # detach/alias nodes are drawn as their input
    for n in nodes:
        if op_name(n) in _PLUMBING and not n.meta.get("mutates") and isinstance(n.args[0], fx.Node):
            alias_of[n] = alias_of.get(n.args[0], n.args[0])
    shown = [n for n in nodes if n not in hidden and n not in alias_of]
    shown_names = {n.name for n in shown}

    def src(n: fx.Node) -> fx.Node:
        return alias_of.get(n, n)

    kinds = {"collapsed"} if counts else set()
    for node in shown:
        attrs = {"label": _label(node), "fillcolor": _fill(node)}
        kinds.add({RANDOM: "random", CONSTANT: "constant"}.get(attrs["fillcolor"], "op"))
        if node in dead:
            attrs.update(fontcolor=DEAD_TEXT, color=DEAD_TEXT, style="rounded,filled,dashed", fillcolor="white")
            kinds.add("dead")
        if node.meta.get("opaque"):
            attrs["penwidth"] = "2"
            kinds.add("opaque")
        clusters[node.meta.get("module") or ""].append((node.name, attrs))
        inputs = {src(i).name for i in node.all_input_nodes}
        for inp in sorted(inputs & shown_names):
            dot.edge(inp, node.name)
        for sid in node.meta.get("mutates", ()):
            prev = last_write.get(sid)
            if prev is not None and prev not in inputs:
                dot.edge(prev, node.name, style="dashed")
                kinds.add("next_write")
            last_write[sid] = node.name
    for group in _groups(graph, wanted):
        value = src(graph.outputs[group[0]])
        if value in hidden:
            continue
        spec, box = graph.spec(group[0]), "out_" + re.sub(r"\W", "_", group[0])
        label = "\n".join(group) + f"\n{tuple(spec.shape)} {str(spec.dtype).removeprefix('torch.')}"
        clusters[group[0].rpartition(".")[0]].append((box, {"label": label, "fillcolor": OUTPUT, "shape": "note"}))
        kinds.add("output")
        last = last_write.get(graph.output_storage[group[0]])
        if last in (None, value.name):
            dot.edge(value.name, box)
        else:  # the arrow comes from the last write; an invisible edge keeps the box by its value
            dot.edge(value.name, box, style="invis")
            dot.edge(last, box, constraint="false")
    dot.graph_attr["label"] = legend(kinds)
    _add_clusters(dot, clusters, counts)
    return _render(dot, out)


def _label(node: fx.Node) -> str:
    source = node.meta["prov"].source or ""
    where = source.split(": ")[0].rpartition("/")[2] if source and not source.startswith("<") else ""
    return step(node) + (f"\n{where}" if where else "")


def _fill(node: fx.Node) -> str:
    if is_random(node):
        return RANDOM
    if node.op == "get_attr":
        return CONSTANT
    return "white"


def _groups(graph: InitGraph, wanted: list[str]) -> list[list[str]]:
    tied = {n: g for g in graph.ties for n in g}
    seen: set[str] = set()
    out = []
    for n in wanted:
        group = [m for m in tied.get(n, [n]) if m in wanted or m == n]
        if group[0] not in seen:
            seen.update(group)
            out.append(group)
    return out


def _collapsed(graph: InitGraph, nodes: list[fx.Node], wanted: list[str]
               ) -> tuple[set[fx.Node], dict[str, int]]:
    """Nodes of repeated numbered siblings to leave out, and ``{kept path: count}``.

    Siblings ``p.0, p.1, ...`` are repeats when their ops and outputs match once the
    index is taken out; the first is drawn, labelled with the count.
    """
    by_instance: dict[tuple[str, int], list[fx.Node]] = defaultdict(list)
    for n in nodes:
        m = _NUMBERED.match(n.meta.get("module") or "")
        if m:
            by_instance[(m.group(1), int(m.group(2)))].append(n)
    outputs_of: dict[tuple[str, int], list[str]] = defaultdict(list)
    for name in wanted:
        m = _NUMBERED.match(name)
        if m:
            outputs_of[(m.group(1), int(m.group(2)))].append(name)

    dead = graph.dead_writes()

    def signature(key: tuple[str, int]) -> tuple:
        prefix = f"{key[0]}.{key[1]}" if key[0] else str(key[1])
        ops = tuple((op_name(n), (n.meta.get("module") or "").removeprefix(prefix), n in dead)
                    for n in by_instance[key])
        outs = tuple(sorted(o.removeprefix(prefix) for o in outputs_of[key]))
        return ops, outs

    families: dict[str, list[int]] = defaultdict(list)
    for parent, idx in by_instance:
        families[parent].append(idx)
    hidden: set[fx.Node] = set()
    counts: dict[str, int] = {}
    for parent, indices in families.items():
        if len(indices) < 2:
            continue
        indices.sort()
        first = indices[0]
        same = [i for i in indices[1:] if signature((parent, i)) == signature((parent, first))]
        if not same:
            continue
        for i in same:
            hidden.update(by_instance[(parent, i)])
        counts[f"{parent}.{first}" if parent else str(first)] = len(same) + 1
    return hidden, counts


def _add_clusters(dot, clusters: dict[str, list[tuple[str, dict[str, str]]]], counts: dict[str, int]) -> None:
    tree: dict[str, list] = {}  # every ancestor path is a cluster too: layers > layers.0 > layers.0.attn
    for path, items in clusters.items():
        parts = path.split(".") if path else []
        for i in range(1, len(parts)):
            tree.setdefault(".".join(parts[:i]), [])
        tree.setdefault(path, []).extend(items)
    tree.setdefault("", [])

    def add(parent, path: str) -> None:
        for name, attrs in tree[path]:
            parent.node(name, **attrs)
        for child in sorted(p for p in tree if p and p.rpartition(".")[0] == path):
            label = child
            if child in counts:
                label = f"{child}   x{counts[child]}: {counts[child]} numbered siblings share this recipe, drawn once"
            style = {"label": label, "style": "rounded", "color": "grey60",
                     "penwidth": "3" if child in counts else "1"}
            with parent.subgraph(name=f"cluster_{child}", graph_attr=style) as sub:
                add(sub, child)

    add(dot, "")


def _render(dot, out: Path) -> Path:
    import graphviz

    out.parent.mkdir(parents=True, exist_ok=True)
    fmt = out.suffix.lstrip(".") or "svg"
    source = out.with_suffix(".dot")
    if fmt == "dot":
        out.write_text(dot.source)
        return out
    try:
        out.write_bytes(dot.pipe(format=fmt))
        return out
    except (graphviz.ExecutableNotFound, graphviz.CalledProcessError) as exc:
        source.write_text(dot.source)
        print(f"graphviz's `dot` did not run ({type(exc).__name__}): wrote only the source {source}; "
              "`apt-get install graphviz` to get the drawing")
        return source
