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
import re
import shutil
import subprocess
import sys
import tempfile
from functools import lru_cache
from pathlib import Path

_SOURCE = Path(__file__).with_name("mt19937.c")
PORTABLE_SOURCE = Path(__file__).with_name("portable.c")
# no contraction into fused multiply-adds: the portable samplers must round each float
# operation on its own, as torch ops do; errno-free math lets sqrt vectorize (it stays
# correctly rounded)
FLAGS = ("-O3", "-shared", "-fPIC", "-ffp-contract=off", "-fno-math-errno")


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
    lib.fxinit_mt_state_advance.argtypes = [ctypes.c_void_p, ctypes.c_uint64]
    lib.fxinit_mt_state_advance.restype = ctypes.c_uint64
    lib.fxinit_mt_charpoly_matches.argtypes = []
    lib.fxinit_mt_charpoly_matches.restype = ctypes.c_int
    return lib


@lru_cache(maxsize=None)
def portable_library() -> ctypes.CDLL | None:
    """The loaded portable-stream samplers, or None where they cannot be built here."""
    lib = _load(PORTABLE_SOURCE)
    if lib is None:
        return None
    lib.fxinit_portable_unit53.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64]
    lib.fxinit_portable_unit53.restype = None
    lib.fxinit_portable_fill.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64,
                                         ctypes.c_uint64, ctypes.c_double, ctypes.c_double]
    lib.fxinit_portable_fill.restype = None
    lib.fxinit_portable_fill_batch.argtypes = [ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p]
    lib.fxinit_portable_fill_batch.restype = None
    return lib


def _load(source: Path) -> ctypes.CDLL | None:
    if os.environ.get("FXINIT_NO_NATIVE") == "1":
        return None
    for flags in (FLAGS, (*FLAGS, NO_CLONES)):  # compilers that cannot clone for newer CPUs
        try:
            return ctypes.CDLL(str(build(source, flags)))
        except (OSError, subprocess.SubprocessError):
            continue
    return None


NO_CLONES = "-DFXINIT_NO_CLONES"  # one plain version of each kernel, no AVX2/AVX-512 clones


def build(source_path: Path, flags: tuple[str, ...] = FLAGS) -> Path:
    """The shared library of ``source_path`` built with ``flags``, from the cache if there."""
    source = source_path.read_bytes()
    for header in re.findall(rb'#include "([^"]+)"', source):  # headers beside it: part of what is built
        source += source_path.with_name(header.decode()).read_bytes()
    tag = hashlib.sha256(source + sys.platform.encode() + " ".join(flags).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source_path.stem}-{tag}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise OSError("no C compiler")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        subprocess.run([compiler, *flags, str(source_path), "-o", str(out), "-lm"],
                       check=True, capture_output=True, timeout=120)
        os.replace(out, target)  # atomic: concurrent builders agree on the result
    return target
