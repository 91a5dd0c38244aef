"""Compiled kernels (MT19937 skipping, portable-stream samplers), built on first use with
the system C compiler.

A plain shared library loaded with ctypes: no Python headers are needed, only ``cc``.
It is cached under ``$FXINIT_CACHE_DIR`` (default ``~/.cache/fxinit``) by source hash.
Where no compiler works, or ``FXINIT_NO_NATIVE=1``, callers fall back to numpy, which
gives the same states, only slower.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

_SOURCE = Path(__file__).with_name("mt19937.c")
_PORTABLE_SOURCE = Path(__file__).with_name("portable.c")
_FLAGS = ("-O3", "-shared", "-fPIC")


def cache_dir() -> Path:
    root = os.environ.get("FXINIT_CACHE_DIR") or Path.home() / ".cache" / "fxinit"
    return Path(root)


@lru_cache(maxsize=None)
def library() -> ctypes.CDLL | None:
    """The loaded MT19937 kernel, or None where it cannot be built here."""
    lib = _load(_SOURCE)
    if lib is None:
        return None
    lib.fxinit_mt_twist.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.fxinit_mt_twist.restype = None
    lib.fxinit_mt_xpow.argtypes = [ctypes.c_uint64, ctypes.c_void_p]
    lib.fxinit_mt_xpow.restype = ctypes.c_int
    lib.fxinit_mt_jump.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
    lib.fxinit_mt_jump.restype = None
    return lib


@lru_cache(maxsize=None)
def portable_library() -> ctypes.CDLL | None:
    """The loaded portable-stream samplers, or None where they cannot be built here."""
    lib = _load(_PORTABLE_SOURCE)
    if lib is None:
        return None
    lib.fxinit_portable_unit24.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64,
                                           ctypes.c_int]
    lib.fxinit_portable_unit24.restype = None
    lib.fxinit_portable_unit53.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64]
    lib.fxinit_portable_unit53.restype = None
    lib.fxinit_portable_unit24x2.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                                             ctypes.c_uint64]
    lib.fxinit_portable_unit24x2.restype = None
    return lib


def _load(source: Path) -> ctypes.CDLL | None:
    if os.environ.get("FXINIT_NO_NATIVE") == "1":
        return None
    try:
        return ctypes.CDLL(str(_build(source)))
    except (OSError, subprocess.SubprocessError):
        return None


def _build(source_path: Path) -> Path:
    source = source_path.read_bytes()
    tag = hashlib.sha256(source + sys.platform.encode() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source_path.stem}-{tag}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *_FLAGS, str(source_path), "-o", str(out), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: concurrent builders agree on the result
    return target
