"""A constructor that fxinit refuses (docs/cli.md, `fxinit check`): it needs values."""
import torch
import torch.nn as nn


class NeedsValues(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        w = torch.randn(4096, 4096)  # 64 MiB: too large to compute while recording
        self.w = nn.Parameter(w)
        self.register_buffer('positive', (w > 0).nonzero()[:4])
