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
from fxinit import viz
from fxinit.report import show_table


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


# ----------------------------------------------------------------------------- show and draw
def show(graph: fxinit.InitGraph) -> None:
    for line in show_table(graph).splitlines():
        print(f"   {line}")
    print(f"   {graph}")


def draw(graph: fxinit.InitGraph, out: Path) -> Path:
    """The graphviz source and, when graphviz's ``dot`` is installed, the SVG."""
    viz.draw(graph, out / "init_deps.dot")
    return viz.draw(graph, out / "init_deps.svg")


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
