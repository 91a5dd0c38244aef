"""Model constructors that the CLI tests trace by name (``tests.cli_models:build``)."""

from __future__ import annotations

import torch.nn as nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)
        nn.init.normal_(self.fc.weight, std=0.02)  # the kaiming draw before it is dead
        self.norm = nn.LayerNorm(dim)


class Stack(nn.Module):
    def __init__(self, layers: int = 2, dim: int = 8, vocab: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight


def build(layers: int = 2, dim: int = 8) -> nn.Module:
    return Stack(layers=layers, dim=dim)
