"""A constructor fxinit refuses, traced by name in the CLI tests (``tests.cli_refused:Reads``)."""

from __future__ import annotations

import torch
import torch.nn as nn


class Reads(nn.Module):
    """It reads a value too large to compute while recording."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(2048, 2048))
        if self.w.sum() > 0:  # the line the error names
            self.w.data.mul_(2)
