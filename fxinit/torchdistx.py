"""A stand-in for torchdistX, opt-in: code written for torchdistX runs on fxinit unchanged.

torchdistX (``deferred_init``, ``fake``) no longer installs on current torch, and code
written for it still exists: FSDP1 itself imports ``torchdistx`` when it can and then builds
``FSDP(deferred_init(M), ...)`` units through ``deferred_init.materialize_module``. After

    import fxinit.torchdistx
    fxinit.torchdistx.install()

``import torchdistx``, ``from torchdistx import deferred_init, fake`` and FSDP1's own
torchdistX branch reach fxinit: ``deferred_init.deferred_init`` is :func:`fxinit.trace_init`,
``materialize_module`` / ``materialize_tensor`` / ``is_deferred`` are fxinit's, and a
"fake" tensor is a deferred one. Call ``install()`` before the code that imports torchdistX
(FSDP1 looks once, when ``torch.distributed.fsdp`` is first imported; ``install`` also tells an
FSDP1 imported earlier). Without ``install()`` nothing is named ``torchdistx``: a real
torchdistX, if one is installed, is left alone, and ``install()`` refuses to shadow it.

>>> import torch, fxinit.torchdistx
>>> fxinit.torchdistx.install()
>>> from torchdistx import deferred_init, fake
>>> m = deferred_init.deferred_init(torch.nn.Linear, 4, 4)
>>> fake.is_fake(m.weight), deferred_init.is_deferred(m)
(True, True)
>>> _ = deferred_init.materialize_module(m)
>>> fake.is_fake(m.weight)
False
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types
from typing import Any, Iterator

import torch

from fxinit.capture import deferred_init as _trace
from fxinit.capture import meta_init
from fxinit.capture.post_import import when_imported
from fxinit.materialize import is_deferred, materialize_module, materialize_tensor


def is_fake(tensor: torch.Tensor) -> bool:
    """torchdistX's ``fake.is_fake``: the tensor has no storage yet (a deferred tensor, or a
    DTensor whose local tensor is one)."""
    return is_deferred(tensor)


@contextlib.contextmanager
def fake_mode(*, fake_cuda: bool = False) -> Iterator[None]:
    """torchdistX's ``fake.fake_mode``: tensors made inside are deferred (``fxinit.meta_init``).
    ``fake_cuda`` is accepted for compatibility: fxinit records CUDA tensors on any machine."""
    with meta_init():
        yield


def meta_like(fake: torch.Tensor) -> torch.Tensor:
    """torchdistX's ``fake.meta_like``: a meta tensor of ``fake``'s shape, dtype and strides."""
    return torch.empty_strided(fake.size(), fake.stride(), dtype=fake.dtype, device="meta")


def _submodule(name: str, doc: str, **attrs: Any) -> types.ModuleType:
    module = types.ModuleType(f"torchdistx.{name}", doc)
    module.__dict__.update(attrs, fxinit_stand_in=True)  # fxinit.fsdp1 lets FSDP1's torchdistX branch run
    return module


deferred_init = _submodule(
    "deferred_init", "torchdistX's deferred_init API, answered by fxinit.",
    deferred_init=_trace, is_deferred=is_deferred, materialize_module=materialize_module,
    materialize_tensor=materialize_tensor)
fake = _submodule("fake", "torchdistX's fake-tensor API, answered by fxinit's deferred tensors.",
                  fake_mode=fake_mode, is_fake=is_fake, meta_like=meta_like)


def install() -> None:
    """Make ``import torchdistx`` (and FSDP1's torchdistX branch) reach fxinit."""
    existing = sys.modules.get("torchdistx")
    if existing is not None and existing is not sys.modules[__name__]:
        raise RuntimeError("a torchdistx module is imported already; fxinit.torchdistx.install() does not shadow it")
    if existing is None and importlib.util.find_spec("torchdistx") is not None:
        raise RuntimeError("torchdistX is installed; fxinit.torchdistx.install() does not shadow it "
                           "(uninstall it, or use it without fxinit)")
    package = sys.modules[__name__]
    sys.modules["torchdistx"] = package
    sys.modules["torchdistx.deferred_init"] = deferred_init
    sys.modules["torchdistx.fake"] = fake
    when_imported("torch.distributed.fsdp._init_utils", _tell_fsdp1)


def _tell_fsdp1(init_utils: types.ModuleType) -> None:
    """FSDP1 imported before ``install()`` found no torchdistX: tell it now."""
    init_utils.deferred_init, init_utils.fake = deferred_init, fake
    init_utils._TORCHDISTX_AVAIL = True
