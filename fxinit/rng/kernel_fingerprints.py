"""Fingerprints of torch's CPU random kernels, per dtype: which numbers this torch draws.

An exact replay calls the installed torch's random kernels (or fxinit's own copies, which
check themselves against them). Its values are eager's only if those kernels draw what the
ones that ran at capture drew, and torch changes them between releases: its bfloat16 and
float16 ``normal_`` and ``uniform_`` differ between 2.11 and 2.12 at every size, and between
2.12 and 2.13 on the vectorized path (measured; float32 and float64 did not change). A saved
init graph keeps the fingerprint of each dtype its CPU random ops draw in, and an exact
replay under another fingerprint is refused (``execute.refuse_changed_kernels``).

>>> import torch
>>> from fxinit.rng.kernel_fingerprints import fingerprint
>>> len(fingerprint(torch.bfloat16))
16
"""

from __future__ import annotations

import functools
import hashlib

import torch

#: Sizes either side of torch's thresholds: the scalar path, one vector of 16, the vectorized
#: path and its tail, and a size split over threads.
_SIZES = (7, 16, 17, 100, 5003, 70_001)


@functools.lru_cache(maxsize=None)
def fingerprint(dtype: torch.dtype) -> str:
    """A hash of what torch's CPU samplers draw in ``dtype`` from fixed generator states
    (every sampler a tensor of that dtype has), on this torch and this CPU."""
    h = hashlib.sha256()
    g = torch.Generator().manual_seed(20261128)
    floating = dtype.is_floating_point or dtype.is_complex
    for n in _SIZES:
        t = torch.empty(n, dtype=dtype)
        draws = ([lambda: t.normal_(0.5, 2.0, generator=g), lambda: t.uniform_(-1.5, 2.0, generator=g),
                  lambda: t.exponential_(1.5, generator=g), lambda: t.cauchy_(generator=g),
                  lambda: t.log_normal_(generator=g), lambda: t.geometric_(0.3, generator=g),
                  lambda: t.bernoulli_(0.3, generator=g), lambda: t.random_(0, 100, generator=g)]
                 if floating and not dtype.is_complex else
                 [lambda: t.normal_(generator=g)] if dtype.is_complex else
                 [lambda: t.random_(0, 2 if dtype == torch.bool else 100, generator=g),
                  lambda: t.bernoulli_(0.3, generator=g)])
        for draw in draws:
            try:
                draw()
            except (RuntimeError, NotImplementedError):  # a sampler this dtype has not
                h.update(b"-")
                continue
            h.update(t.view(-1).view(torch.uint8).numpy().tobytes() if t.element_size() else b"")
    return h.hexdigest()[:16]
