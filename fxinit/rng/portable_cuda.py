"""The portable stream's uniform and normal fills as a CUDA kernel compiled by NVRTC.

``portable_cuda.cu`` computes what ``portable.c`` and fxinit's Triton kernel compute, bit for
bit, over the same table of fills (``portable.fill_table``). It is the CUDA path that needs no
Triton and no C++ compiler: NVRTC, the runtime compiler inside torch's CUDA libraries, builds it
for the GPU's architecture the first time a process needs it (with ``--fmad=false``: no
``a * b + c`` contracted), and the cubin is kept on disk (``native.cache_dir``), so a later
process only loads it. Compiling, loading and launching go through torch's own ctypes
bindings of NVRTC and the driver (``torch.cuda._utils``).

Before its first fill on a device, the kernel fills a sample (both kinds, float32 and
bfloat16, a fused cast, odd bounds, a start past 2**31) and compares it, bit for bit, with
the torch-op twin on the same device (``self_check``); a kernel that differs is never used
(``available`` says why). Its cubin is cached by source, architecture, options and NVRTC version. On a machine without a GPU the same source compiles as C and runs
its grid in a loop (``FXINIT_ON_CPU``): ``tests/test_portable_cuda.py`` checks its bits there.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import sys
import threading
from pathlib import Path
from typing import Callable

import torch

from fxinit.rng.native import cache_dir
from fxinit.rng.portable import Piece, fill_table, on_device, sample, table_pairs

SOURCE = Path(__file__).with_name("portable_cuda.cu")
KERNEL = "fxinit_portable_fill_table"
THREADS, PER_THREAD = 256, 4  # as portable_cuda.cu's
PAIRS = THREADS * PER_THREAD  # pairs per block
#: Elements of one row of a launch's table at most (its blocks on the grid's second axis).
ROW = 2 * PAIRS * 256
KINDS = ("uniform", "normal")
DTYPES = (torch.float32, torch.bfloat16)  # the kernel's dtype codes
OPTIONS = ("--fmad=false", "-std=c++17")

Launch = Callable[[torch.Tensor, int, int, int, int, int], None]  # table, rows, blocks, kind, dtype, out


def fill_many(kind: str, pieces: list[Piece], dtype: torch.dtype | None = None, launch: Launch | None = None) -> None:
    """Every ``(out, runs, stream, scale, shift)`` of ``pieces`` (``portable.fill_table``) in
    one launch: elements of a ``kind`` fill, each ``sample * scale + shift`` in float32 rounded
    to ``dtype`` (default: the outputs'), then to the outputs' dtype. The outputs share a dtype
    (float32 or bfloat16) and a CUDA device. ``launch``: what runs the grid (default: the
    kernel on the outputs' GPU, after its self-check there)."""
    table = fill_table(pieces, ROW)
    if len(table) == 0:
        return
    out = pieces[0][0]
    if out.dtype not in DTYPES or (dtype or out.dtype) not in DTYPES:
        raise ValueError(f"fxinit's CUDA kernel writes {', '.join(map(str, DTYPES))} tensors, not {out.dtype}")
    longest = table_pairs(table)
    if launch is None:
        why = available(out.device)
        if why is not None:
            raise RuntimeError(f"fxinit's CUDA kernel cannot fill {out.device} tensors here: {why}")
        launch = _launcher(out.device) if out.device.type == "cuda" else cpu_launcher()
    launch(on_device(table, out.device), len(table), (longest + PAIRS - 1) // PAIRS, KINDS.index(kind),
           DTYPES.index(dtype or out.dtype), DTYPES.index(out.dtype))


#: With this set to 1, the kernel fills CPU tensors too, compiled as C (``cpu_launcher``): the
#: pipeline's ``compile="nvrtc"`` checked without a GPU, as ``TRITON_INTERPRET=1`` does for Triton.
ON_CPU = "FXINIT_NVRTC_ON_CPU"


def available(device: torch.device) -> str | None:
    """Why fxinit's CUDA kernel cannot fill tensors on ``device`` here, or None if it can: a
    CUDA device, NVRTC, and the kernel's bits checked there (the first call on a device
    compiles or loads the kernel and checks it)."""
    if device.type == "cpu" and os.environ.get(ON_CPU) == "1":
        return _checked(-1)
    if device.type != "cuda":
        return f"it fills cuda tensors, not {device.type}"
    if not torch.cuda.is_available():
        return "CUDA is not available here"
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _checked(index)


@functools.lru_cache(maxsize=None)
def _checked(index: int) -> str | None:
    device = torch.device("cuda", index) if index >= 0 else torch.device("cpu")
    try:
        launch = _launcher(device) if index >= 0 else cpu_launcher()
        differ = self_check(device, launch)
    except Exception as exc:  # noqa: BLE001 - no NVRTC, an architecture it does not know: not here
        return f"{type(exc).__name__}: {exc}"
    return None if not differ else f"its values differ from the torch-op twin's on this GPU: {differ}"


def self_check(device: torch.device | str, launch: Launch) -> list[str]:
    """The cases (both kinds; float32, bfloat16, a float32 fill cast to bfloat16; odd bounds,
    one element, a start past 2**31) where ``launch``'s values on ``device`` differ from the
    torch-op twin's there (``portable.sample``), bit for bit."""
    differ = []
    cases = ((0, 4099, 5), (7, 8, 4111), (2**31 + 3, 2**31 + 1027, 4200))  # (lo, hi, at) into one tensor
    stream = 0x5DEECE66D
    for kind, params in (("uniform", {"low": -0.25, "high": 0.75}), ("normal", {"mean": 0.1, "std": 0.02})):
        scale, shift = (params["high"] - params["low"], params["low"]) if kind == "uniform" else (
            params["std"], params["mean"])
        for fill, out_dtype in ((torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                (torch.float32, torch.bfloat16)):
            stream += 977
            out = torch.full((5300,), float("nan"), dtype=out_dtype, device=device)
            fill_many(kind, [(out, cases, stream, scale, shift)], fill, launch)
            for lo, hi, at in cases:
                want = sample(kind, stream, lo, hi - lo, fill, device, **params).to(out_dtype)
                got = out[at:at + hi - lo]
                if not torch.equal(got.view(torch.int16 if got.element_size() == 2 else torch.int32),
                                   want.view(torch.int16 if want.element_size() == 2 else torch.int32)):
                    differ.append(f"{kind} {fill} -> {out_dtype} elements {lo}..{hi}")
    return differ


_LOCK = threading.Lock()


@functools.lru_cache(maxsize=None)
def _launcher(device: torch.device) -> Launch:
    """The kernel loaded on ``device`` (compiled by NVRTC, or its cubin read from the cache)."""
    from torch.cuda._utils import _cuda_load_module

    with _LOCK, torch.cuda.device(device):
        props = torch.cuda.get_device_properties(device)
        arch = f"{props.major}{props.minor}"
        source = SOURCE.read_bytes()
        tag = hashlib.sha256(source + arch.encode() + " ".join(OPTIONS).encode() + _nvrtc_version().encode()
                             ).hexdigest()[:16]
        path = cache_dir() / f"portable_cuda-sm{arch}-{tag}.cubin"
        if path.exists():
            cubin = path.read_bytes()
        else:
            cubin = compiled(arch)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".{os.getpid()}.tmp")
            tmp.write_bytes(cubin)
            os.replace(tmp, path)  # atomic: concurrent builders agree on the result
        kernel = _cuda_load_module(cubin, [KERNEL])[KERNEL]

    def launch(table: torch.Tensor, rows: int, blocks: int, kind: int, dtype: int, out: int) -> None:
        with torch.cuda.device(device):
            kernel(grid=(rows, blocks, 1), block=(THREADS, 1, 1), args=[table, kind, dtype, out],
                   stream=torch.cuda.current_stream(device))

    return launch


def compiled(arch: str, ptx: bool = False) -> bytes:
    """``portable_cuda.cu`` compiled by NVRTC for ``sm_<arch>``: a cubin, or with ``ptx`` its PTX
    (for ``compute_<arch>``), which tests read for the instructions it uses. NVRTC needs no GPU."""
    nvrtc = _nvrtc()

    def check(result: int) -> None:
        if result != 0:
            raise RuntimeError(f"NVRTC failed with error {result} (nvrtcResult)")

    program = ctypes.c_void_p()
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(program), SOURCE.read_bytes(), b"portable_cuda.cu", 0, None, None))
    try:
        target = f"--gpu-architecture={'compute' if ptx else 'sm'}_{arch}"
        options = [target.encode(), *(o.encode() for o in OPTIONS)]
        result = nvrtc.nvrtcCompileProgram(program, len(options), (ctypes.c_char_p * len(options))(*options))
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(program, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(program, log)
            raise RuntimeError(f"NVRTC could not compile portable_cuda.cu: {log.value.decode(errors='replace')}")
        size = ctypes.c_size_t()
        check((nvrtc.nvrtcGetPTXSize if ptx else nvrtc.nvrtcGetCUBINSize)(program, ctypes.byref(size)))
        out = ctypes.create_string_buffer(size.value)
        check((nvrtc.nvrtcGetPTX if ptx else nvrtc.nvrtcGetCUBIN)(program, out))
        return out.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(program))


def _nvrtc_version() -> str:
    """NVRTC's version, part of the cubin cache's key."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


@functools.lru_cache(maxsize=1)
def _nvrtc() -> ctypes.CDLL:
    """NVRTC as torch finds it (``torch.cuda._utils``), else the ``libnvrtc`` of the ``nvidia``
    packages a pip install of torch brings (found beside torch, as torch's own libraries find
    it, when nothing has loaded it into the process yet)."""
    try:
        from torch.cuda._utils import _get_gpu_rtc_library

        lib = _get_gpu_rtc_library()
    except Exception:  # noqa: BLE001 - not there, not loadable by its name: look beside torch
        lib = None
    if lib is None:
        major = str(torch.version.cuda or "").split(".")[0]
        found = sorted(_beside_torch("libnvrtc.so*"), key=lambda p: f".so.{major}" not in p.name)
        for path in found:
            try:
                lib = ctypes.CDLL(str(path))
                break
            except OSError:
                continue
        else:
            raise OSError("NVRTC (libnvrtc) was not found beside torch")
    _load_builtins(lib)
    return lib


def _beside_torch(pattern: str) -> list[Path]:
    """The libraries of the ``nvidia`` pip packages named by ``pattern`` (not the ``.alt`` ones)."""
    return sorted({p for root in map(Path, sys.path) if root.is_dir() for p in root.glob(f"nvidia/*/lib/{pattern}")
                   if ".alt." not in p.name and ("builtins" in pattern) == ("builtins" in p.name)})


def _load_builtins(lib: ctypes.CDLL) -> None:
    """Load NVRTC's builtins library of the same version from its pip package, where one is:
    NVRTC opens it by name at its first compile, and the dynamic loader does not look in the
    package's folder (torch 2.11's CUDA 13 wheels: "failed to open libnvrtc-builtins.so.13.0")."""
    major, minor = ctypes.c_int(), ctypes.c_int()
    if lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)) != 0:
        return
    for path in _beside_torch(f"libnvrtc-builtins.so.{major.value}.{minor.value}"):
        try:
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            return
        except OSError:
            continue


@functools.lru_cache(maxsize=1)
def cpu_launcher() -> Launch:
    """The kernel's source compiled as C for this CPU (``FXINIT_ON_CPU``): its grid run block by
    block and thread by thread on CPU tensors, for checking its bits without a GPU."""
    from fxinit.rng.native import FLAGS, build

    lib = ctypes.CDLL(str(build(SOURCE, (*FLAGS, "-x", "c", "-DFXINIT_ON_CPU"))))
    run = lib.fxinit_portable_fill_table_on_cpu
    run.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    run.restype = None

    def launch(table: torch.Tensor, rows: int, blocks: int, kind: int, dtype: int, out: int) -> None:
        run(table.data_ptr(), rows, blocks, kind, dtype, out)

    return launch

