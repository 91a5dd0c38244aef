"""fxinit in one minute: ``python -m fxinit.demo [--out DIR] [--seed N]``.

Traces a tiny Llama-like model (plain torch.nn, defined below) with ``fxinit.trace_init``,
shows every tensor with the init recipe recorded for it, draws the init graph, materializes
the model layer by layer in reverse, and checks it bit for bit against eager construction.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn as nn

import fxinit


# ----------------------------------------------------------------------------- the model
class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), Attention(dim)
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim, hidden)


class TinyLlama(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, hidden: int = 64, layers: int = 2) -> None:
        super().__init__()
        head_dim = dim // heads
        self.embed = nn.Embedding(vocab, dim)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)  # RoPE: computed, not drawn
        self.layers = nn.ModuleList(Block(dim, hidden) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.embed.weight  # tied
        self.apply(self._init_weights)  # like transformers' post_init(): every weight is drawn twice

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)


# ----------------------------------------------------------------------------- show
def step(node: torch.fx.Node) -> str:
    """``uniform_ [kaiming_uniform_]``: the node's op and the init function that issued it."""
    if node.op == "get_attr":
        op = "constant"
    elif node.meta.get("opaque"):
        op = node.meta["opaque"].rsplit(".", 1)[-1]
    else:
        op = getattr(getattr(node.target, "overloadpacket", node.target), "__name__", str(node.target))
    fn = (node.meta["prov"].init_fn or "").rsplit(".", 1)[-1]
    return f"{op} [{fn}]" if fn and fn != op else op


def recipe(graph: fxinit.InitGraph, name: str) -> str:
    """The ops the tensor's value needs, in program order; repeats shown as ``normal_ x3``,
    writes that dead-init elimination drops shown as ``(uniform_ [kaiming_uniform_]: dead)``."""
    steps: list[list] = []
    dead = graph.dead_writes()
    for node in graph.required_nodes([name], eliminate_dead=False):
        label = f"({step(node)}: dead)" if node in dead else step(node)
        if step(node) in ("detach", "alias"):
            continue
        if steps and steps[-1][0] == label:
            steps[-1][1] += 1
        else:
            steps.append([label, 1])
    return " -> ".join(s if n == 1 else f"{s} x{n}" for s, n in steps)


def show(graph: fxinit.InitGraph) -> None:
    tied = {n: g[0] for g in graph.ties for n in g[1:]}
    rows = [("name", "shape", "dtype", "bytes", "init recipe: op [init function]")]
    for name in graph.outputs:
        spec = graph.spec(name)
        rows.append((name, str(tuple(spec.shape)), str(spec.dtype).removeprefix("torch."), str(spec.nbytes),
                     f"tied to {tied[name]}" if name in tied else recipe(graph, name)))
    w = [max(len(r[i]) for r in rows) for i in range(4)]
    for r in rows:
        print(f"   {r[0]:{w[0]}}  {r[1]:{w[1]}}  {r[2]:{w[2]}}  {r[3]:>{w[3]}}  {r[4]}")
    print(f"   {graph}")


# ----------------------------------------------------------------------------- draw
RANDOM, CONSTANT, TENSOR = "#f4a582", "#92c5de", "#d9f0d3"


def draw(graph: fxinit.InitGraph, out: Path) -> Path:
    """One node per op and per output tensor, clustered by ``node.meta["module"]``; returns the file written."""
    import graphviz

    legend = ("fxinit init graph - orange: random op, blue: constant, green: parameter/buffer, "
              "grey text: dead write (never run), dashed: next write")
    font = {"fontname": "Helvetica", "fontsize": "10"}
    dot = graphviz.Digraph("init_deps", graph_attr={"rankdir": "LR", "label": legend, "labelloc": "t", **font},
                           node_attr={"shape": "box", "style": "rounded,filled", "fillcolor": "white", **font})
    clusters: dict[str, list[tuple[str, dict[str, str]]]] = {}
    last_write: dict[int, str] = {}
    dead = graph.dead_writes()
    for node in graph.nodes:
        where = (node.meta["prov"].source or "<").split(": ")[0].rpartition("/")[2]  # "model.py:58"
        attrs = {"label": step(node) + ("" if where.startswith("<") else f"\n{where}"),
                 "fillcolor": RANDOM if node.meta.get("rng") else CONSTANT if node.op == "get_attr" else "white"}
        if node in dead:
            attrs.update(fontcolor="grey50", style="rounded,filled,dashed")
        clusters.setdefault(node.meta.get("module") or "", []).append((node.name, attrs))
        for inp in node.all_input_nodes:
            dot.edge(inp.name, node.name)
        for sid in node.meta.get("mutates", ()):
            if sid in last_write and last_write[sid] not in {i.name for i in node.all_input_nodes}:
                dot.edge(last_write[sid], node.name, style="dashed")
            last_write[sid] = node.name
    for group in graph.ties + [[n] for n in graph.outputs if not any(n in g for g in graph.ties)]:
        spec, box = graph.spec(group[0]), "out_" + group[0]
        label = "\n".join(group) + f"\n{tuple(spec.shape)} {str(spec.dtype).removeprefix('torch.')}"
        clusters.setdefault(group[0].rpartition(".")[0], []).append((box, {"label": label, "fillcolor": TENSOR,
                                                                          "shape": "note"}))
        value, last = graph.outputs[group[0]].name, last_write.get(graph.output_storage[group[0]])
        if last in (None, value):
            dot.edge(value, box)
        else:  # the arrow comes from the last write; an invisible edge keeps the box by its value
            dot.edge(value, box, style="invis")
            dot.edge(last, box, constraint="false")

    tree: dict[str, list] = {}  # every ancestor path is a cluster too: layers > layers.0 > layers.0.attn
    for path, items in clusters.items():
        parts = path.split(".")
        for i in range(1, len(parts)):
            tree.setdefault(".".join(parts[:i]), [])
        tree.setdefault(path, []).extend(items)

    def add(parent: graphviz.Digraph, path: str) -> None:
        for name, attrs in tree[path]:
            parent.node(name, **attrs)
        for child in [p for p in tree if p and p.rpartition(".")[0] == path]:
            style = {"label": child, "style": "rounded", "color": "grey60"}
            with parent.subgraph(name=f"cluster_{child}", graph_attr=style) as sub:
                add(sub, child)

    tree.setdefault("", [])
    add(dot, "")
    out.mkdir(parents=True, exist_ok=True)
    (out / "init_deps.dot").write_text(dot.source)
    try:
        (out / "init_deps.svg").write_bytes(dot.pipe(format="svg"))
        return out / "init_deps.svg"
    except (graphviz.ExecutableNotFound, graphviz.CalledProcessError) as exc:
        print(f"   graphviz's `dot` did not run ({type(exc).__name__}): wrote only the source; "
              "`apt-get install graphviz` to get the SVG")
        return out / "init_deps.dot"


# ----------------------------------------------------------------------------- main
def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
        a.detach().contiguous().view(torch.uint8), b.detach().contiguous().view(torch.uint8))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fxinit.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="fxinit-demo", help="where the drawing goes (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    torch.manual_seed(args.seed)
    model = fxinit.trace_init(TinyLlama)  # nothing allocated: every parameter and buffer is deferred
    rng_after_trace = torch.get_rng_state()
    graph = fxinit.init_graph(model)
    print(f"1. traced TinyLlama (seed {args.seed}); no storage yet, e.g. embed.weight = {model.embed.weight}")
    show(graph)
    print(f"2. drew the init graph: {draw(graph, Path(args.out))}")

    print("3. materializing, last layer first:")
    rng_untouched = True
    parts = [(f"layers.{i}", model.layers[i]) for i in reversed(range(len(model.layers)))] + [("rest", model)]
    for name, part in parts:
        before = torch.get_rng_state()
        fxinit.materialize(part)
        rng_untouched &= torch.equal(before, torch.get_rng_state())
        print(f"   {name:8s} done; model still partly deferred: {fxinit.is_deferred(model)}")

    torch.manual_seed(args.seed)
    eager = TinyLlama()
    rng_same = torch.equal(rng_after_trace, torch.get_rng_state())
    ours, ref = ({**dict(m.named_parameters()), **dict(m.named_buffers())} for m in (model, eager))
    equal = [n for n in ref if n in ours and same_bits(ours[n], ref[n])]
    tied = model.lm_head.weight is model.embed.weight
    ok = len(equal) == len(ref) == len(ours) and rng_same and rng_untouched and tied
    print(f"4. against eager construction (seed {args.seed}): {len(equal)}/{len(ref)} tensors bit-for-bit equal, "
          f"head still tied: {tied}, trace left the RNG where eager does: {rng_same}, "
          f"materialize left it alone: {rng_untouched}")
    print("RESULT: bit-for-bit equal to eager construction" if ok else "RESULT: MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
