"""Init graphs in words: one-line recipes, the `fxinit show` table, and `explain`.

Everything here reads an InitGraph only (live or loaded from a file), so it works in a
process that has neither the model's code nor its libraries.
"""

from __future__ import annotations

import fnmatch
from typing import TYPE_CHECKING, Iterable

import torch.fx as fx

from fxinit.ops import is_random, op_name

if TYPE_CHECKING:  # annotations only: graph.py imports this module (InitGraph.explain)
    from fxinit.graph import InitGraph


def step(node: fx.Node) -> str:
    """``uniform_ [kaiming_uniform_]``: the node's op and the init function that issued it."""
    op = op_name(node)
    fn = (node.meta["prov"].init_fn or "").rsplit(".", 1)[-1]
    return f"{op} [{fn}]" if fn and fn != op else op


_PLUMBING = {"detach", "alias"}


def recipe(graph: InitGraph, name: str) -> str:
    """The ops the tensor's value needs, in program order; repeats shown as ``normal_ x3``,
    writes that dead-init elimination drops shown as ``(uniform_ [kaiming_uniform_]: dead)``."""
    tied = {n: g[0] for g in graph.ties for n in g[1:]}
    if name in tied:
        return f"tied to {tied[name]}"
    steps: list[list] = []
    dead = graph.dead_writes()
    for node in graph.required_nodes([name], eliminate_dead=False):
        if op_name(node) in _PLUMBING:
            continue
        label = f"({step(node)}: dead)" if node in dead else step(node)
        if steps and steps[-1][0] == label:
            steps[-1][1] += 1
        else:
            steps.append([label, 1])
    return " -> ".join(s if n == 1 else f"{s} x{n}" for s, n in steps)


def select(graph: InitGraph, only: str | None) -> list[str]:
    """Output names matching the glob ``only`` (all if None); a pattern with no ``*`` also
    matches everything below it (``model.layers.3`` selects that layer)."""
    return matching(list(graph.outputs), only)


def matching(names: Iterable[str], only: str | None) -> list[str]:
    """``names`` matching the glob ``only`` (all if None), or below the module prefix ``only``."""
    if not only:
        return list(names)
    return [n for n in names if fnmatch.fnmatchcase(n, only) or n.startswith(only.rstrip(".") + ".")]


def show_table(graph: InitGraph, names: Iterable[str] | None = None) -> str:
    """A table of tensors (name, shape, dtype, bytes, recipe) and totals."""
    wanted = list(graph.outputs) if names is None else list(names)
    rows = [("name", "shape", "dtype", "bytes", "init recipe: op [init function]")]
    tied = {n for g in graph.ties for n in g[1:]}
    total = 0
    for name in wanted:
        spec = graph.spec(name)
        if name not in tied:
            total += spec.nbytes
        rows.append((name, str(tuple(spec.shape)), str(spec.dtype).removeprefix("torch."), f"{spec.nbytes:,}",
                     recipe(graph, name)))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = [f"{r[0]:{w[0]}}  {r[1]:{w[1]}}  {r[2]:{w[2]}}  {r[3]:>{w[3]}}  {r[4]}" for r in rows]
    s = graph.stats(wanted)
    lines.append(f"{len(wanted)} tensors, {total:,} bytes ({total / 2**20:.1f} MiB; tied tensors counted once); "
                 f"{s['nodes']} ops to run ({s['dead_nodes']} dead ops skipped), {s['random_ops']} random")
    return "\n".join(lines)


def explain(graph: InitGraph, name: str) -> str:
    """How ``name`` is initialized, op by op: where each op came from (init function,
    module, source line), which are random, and which are dead and why."""
    if name not in graph.outputs:
        raise KeyError(f"{name!r} is not an output of this init graph")
    spec, info = graph.spec(name), graph.info[name]
    kind = "parameter" if info.is_parameter else ("buffer" if info.persistent else "non-persistent buffer")
    head = (f"{name}: {kind} {tuple(spec.shape)} {str(spec.dtype).removeprefix('torch.')} on {spec.device}"
            f"{', requires_grad' if info.requires_grad else ''}")
    group = next((g for g in graph.ties if name in g), None)
    if group:
        head += f"; the same tensor as {', '.join(n for n in group if n != name)}"
    nodes = graph.required_nodes([name], eliminate_dead=False)
    dead = graph.dead_writes()
    index = {n: i + 1 for i, n in enumerate(nodes)}
    lines = [head, f"its value comes from {len(nodes) - len(dead & set(nodes))} ops"
             + (f" ({len(dead & set(nodes))} more are dead and never run):" if dead & set(nodes) else ":")]
    for n in nodes:
        tags = []
        if is_random(n):
            tags.append("random")
        if n.meta.get("opaque"):
            tags.append("replayed as one call")
        if n in dead:
            killer = _overwritten_by(n, nodes)
            tags.append(f"DEAD: overwritten by step {index[killer]} before anything reads it" if killer
                        else "DEAD: overwritten before anything reads it")
        prov = n.meta["prov"]
        where = [f"by {prov.init_fn}" if prov.init_fn else None,
                 f"in {prov.init_method}" if prov.init_method else None,
                 f"module {n.meta['module'] or '<root>'}" if "module" in n.meta else None,
                 f"at {_short_path(prov.source)}" if prov.source else None]
        lines.append(f"  {index[n]:>2}. {_call(n)}" + (f"  [{'; '.join(tags)}]" if tags else ""))
        detail = ", ".join(w for w in where if w)
        if detail:
            lines.append(f"      {detail}")
    return "\n".join(lines)


def _short_path(source: str) -> str:
    """``transformers/models/llama/modeling_llama.py:159: ...`` instead of the full venv path."""
    for marker in ("site-packages/", "dist-packages/"):
        if marker in source:
            return source.split(marker, 1)[1]
    return source


def _overwritten_by(node: fx.Node, nodes: list[fx.Node]) -> fx.Node | None:
    mutated = set(node.meta.get("mutates", ()))
    after = nodes[nodes.index(node) + 1:]
    return next((n for n in after if mutated & set(n.meta.get("overwrites", ()))), None)


def _call(node: fx.Node) -> str:
    """``normal_(mean=0.0, std=0.02)``: the op with its non-tensor arguments."""
    def show(a: object) -> str | None:
        if isinstance(a, fx.Node):
            return None
        if isinstance(a, (list, tuple)) and any(isinstance(x, fx.Node) for x in a):
            return None
        return repr(a)

    if node.op == "get_attr":
        return f"constant {node.target}"
    args = node.args[1:] if node.meta.get("opaque") else node.args
    shown = [s for s in (show(a) for a in args) if s is not None]
    shown += [f"{k}={show(v)}" for k, v in node.kwargs.items() if v is not None and show(v) is not None]
    return f"{op_name(node)}({', '.join(shown)})"
