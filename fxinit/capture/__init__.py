"""Capture: run the user's constructor and record its init ops into an fx graph."""

from fxinit.capture.api import clear_meta_init_cache, deferred_init, dry_run, is_meta_init, meta_init, recording, trace_init
from fxinit.capture.deferred import DeferredTensor, is_deferred_tensor
from fxinit.capture import collectives as _collectives  # noqa: F401  (registers its is_meta answers)
from fxinit.capture.dtensor import install as _install_deferred_dtensors

_install_deferred_dtensors()

__all__ = [
    "DeferredTensor",
    "clear_meta_init_cache",
    "deferred_init",
    "dry_run",
    "is_deferred_tensor",
    "is_meta_init",
    "meta_init",
    "recording",
    "trace_init",
]
