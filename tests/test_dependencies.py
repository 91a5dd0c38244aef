"""InitGraph.to_networkx: networkx's ancestors of a tensor are the slice fxinit runs for it."""

from __future__ import annotations

import doctest

import networkx as nx
import torch
import torch.nn as nn

import fxinit
import fxinit.dependencies


class Edited(nn.Module):
    """In-place edits through views, a tie, a buffer computed from a parameter, a dead init."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight
        self.proj = nn.Linear(4, 4)
        nn.init.zeros_(self.proj.weight)  # kaiming_uniform_ before it is dead
        with torch.no_grad():
            self.proj.weight[0].add_(1.0)
            self.proj.weight.mul_(2.0)
        self.register_buffer("scale", self.proj.bias.detach().abs() + 1)


def _graphs():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, tie_word_embeddings=True)
    for build in (lambda: fxinit.trace_init(Edited), lambda: fxinit.trace_init(LlamaForCausalLM, cfg)):
        torch.manual_seed(0)
        yield fxinit.init_graph(build())


def test_ancestors_are_the_slice() -> None:
    for graph in _graphs():
        g = graph.to_networkx()
        assert nx.is_directed_acyclic_graph(g)
        for name in graph.outputs:
            ops = {n for n in nx.ancestors(g, name) if g.nodes[n]["kind"] == "op"}
            assert ops == {n.name for n in graph.required_nodes([name], eliminate_dead=False)}, name
        assert {n for n, dead in g.nodes(data="dead") if dead} == {n.name for n in graph.dead_writes()}
        assert {n for n, kind in g.nodes(data="kind") if kind == "tensor"} == set(graph.outputs)


def test_attributes_say_what_each_node_is() -> None:
    graph = next(_graphs())
    g = graph.to_networkx()
    assert g.nodes["embed.weight"]["shape"] == (10, 4) and g.nodes["embed.weight"]["dtype"] == torch.float32
    random = {n for n, r in g.nodes(data="random") if r}
    assert random == {n.name for n in graph.nodes if n.meta.get("generators")}
    # the tie: both names come from the same ops
    assert nx.ancestors(g, "embed.weight") == nx.ancestors(g, "head.weight")
    # the buffer reads proj.bias's storage: its history is among the buffer's ancestors
    assert nx.ancestors(g, "proj.bias") <= nx.ancestors(g, "scale")
    assert all(kind in ("input", "storage", "output") for _, _, kind in g.edges(data="kind"))


def test_docstring_examples_run() -> None:
    failed, attempted = doctest.testmod(fxinit.dependencies, optionflags=doctest.ELLIPSIS)
    assert attempted >= 2 and failed == 0
