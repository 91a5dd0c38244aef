"""The Triton kernel of ``rng.portable_triton`` (a plain function: ``portable_triton`` jits it,
or hands it to Triton's interpreter). Importing this module imports Triton.

Each line mirrors ``portable.c`` (``neg2log24``, ``cos_sin_2pi24``, ``bf16_rne``); the
constants are the same float32 values, written as hex.
"""

import triton.language as tl

GOLDEN, M1, M2 = tl.constexpr(0x9E3779B97F4A7C15), tl.constexpr(0xBF58476D1CE4E5B9), tl.constexpr(0x94D049BB133111EB)
_f = float.fromhex
L0, L1, L2, L3, L4, L5, L6, L7, L8 = (tl.constexpr(_f(h)) for h in (
    "0x1.204376p-4", "-0x1.d7a370p-4", "0x1.de4a34p-4", "-0x1.fcba9ep-4", "0x1.23d37ep-3", "-0x1.555ca0p-3",
    "0x1.999d58p-3", "-0x1.fffff8p-3", "0x1.555554p-2"))
LN2_HI, LN2_LO = tl.constexpr(_f("0x1.63p-1")), tl.constexpr(-_f("0x1.bd0106p-13"))
C0, C1, C2 = tl.constexpr(_f("0x1.a01a02p-16")), tl.constexpr(_f("-0x1.6c16c2p-10")), tl.constexpr(_f("0x1.555556p-5"))
S0, S1, S2, S3 = (tl.constexpr(_f(h)) for h in ("0x1.71de3ap-19", "-0x1.a01a02p-13", "0x1.111112p-7",
                                               "-0x1.555556p-3"))
TWO_PI_2_24, UNIT = tl.constexpr(_f("0x1.921fb6p-22")), tl.constexpr(_f("0x1p-24"))

def fill(out_ptr, table_ptr, n: tl.int64, start: tl.int64, stream: tl.int64, scale: tl.float32, shift: tl.float32,
         KIND: tl.constexpr, DTYPE: tl.constexpr, OUT: tl.constexpr, BLOCK: tl.constexpr, TABLE: tl.constexpr):
    """Elements ``start .. start + n`` of the stream into ``out[0 ..]``, block ``program_id(0)``
    of ``BLOCK`` pairs; with ``TABLE``, row ``program_id(0)`` of ``table_ptr`` (int64 rows
    ``address, lo, hi, stream, scale, shift``: elements ``lo .. hi`` of that stream into the
    tensor of ``out_ptr``'s type at ``address``, ``scale`` and ``shift`` the bits of float32s),
    block ``program_id(1)``."""
    if TABLE:
        row = table_ptr + 6 * tl.program_id(0).to(tl.int64)
        base = tl.load(row).to(out_ptr.dtype)
        lo = tl.load(row + 1)
        hi = tl.load(row + 2)
        stream = tl.load(row + 3)
        scale = tl.load(row + 4).to(tl.int32).to(tl.float32, bitcast=True)
        shift = tl.load(row + 5).to(tl.int32).to(tl.float32, bitcast=True)
        block = tl.program_id(1).to(tl.int64)
    else:
        base = out_ptr
        block = tl.program_id(0).to(tl.int64)
        # through uint64: Triton's interpreter types a Python int in [2^31, 2^32) as uint32 and
        # sign-extends it to int64 (on the GPU the annotations make these int64 already)
        lo = start.to(tl.uint64).to(tl.int64, bitcast=True)
        hi = lo + n.to(tl.uint64).to(tl.int64, bitcast=True)
    pair = (lo >> 1) + block * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    z = (pair + 1).to(tl.uint64, bitcast=True) * GOLDEN + stream.to(tl.uint64)
    z = (z ^ (z >> 30)) * M1
    z = (z ^ (z >> 27)) * M2
    w = z ^ (z >> 31)
    even = ((w & 0xFFFFFFFF) >> 8).to(tl.int32)  # bits 8..31: the even element's unit
    odd = (w >> 40).to(tl.int32)  # bits 40..63: the odd element's
    if KIND == 0:
        a = even.to(tl.float32) * UNIT
        b = odd.to(tl.float32) * UNIT
    else:
        # radius sqrt(-2 log(1 - u)) from the odd unit: portable.c's neg2log24
        ix = ((1 << 24) - odd).to(tl.float32).to(tl.int32, bitcast=True) - 0x4B3504F3
        k = (ix >> 23).to(tl.float32)
        t = ((ix & 0x7FFFFF) + 0x3F3504F3).to(tl.float32, bitcast=True) - 1.0
        zz = t * t
        z2 = zz * zz
        p = (((t * L0 + L1) * zz + (t * L2 + L3)) * z2 + ((t * L4 + L5) * zz + (t * L6 + L7))) * t + L8
        y = p * t * zz
        y = y + k * LN2_LO
        y = y + zz * -0.5
        y = t + y
        y = y + k * LN2_HI
        r = tl.sqrt_rn(y * -2.0)
        # cos and sin of 2 pi u from the even unit: portable.c's cos_sin_2pi24
        tt = (even + (1 << 21)) & 0xFFFFFF
        q = tt >> 22
        x = ((tt & 0x3FFFFF) - (1 << 21)).to(tl.float32) * TWO_PI_2_24
        zz = x * x
        z2 = zz * zz
        c = ((zz * C0 + C1) * z2 + (zz * C2 + -0.5)) * zz + 1.0
        s = ((zz * S0 + S1) * z2 + (zz * S2 + S3)) * zz * x + x
        cb = c.to(tl.int32, bitcast=True)
        sb = s.to(tl.int32, bitcast=True)
        swap = (cb ^ sb) & (0 - (q & 1))
        a = r * (cb ^ swap ^ (((q + 1) & 2) << 30)).to(tl.float32, bitcast=True)
        b = r * (sb ^ swap ^ ((q & 2) << 30)).to(tl.float32, bitcast=True)
    a = a * scale + shift
    b = b * scale + shift
    value = tl.reshape(tl.join(a, b), [2 * BLOCK])
    # rounded to the fill's dtype, then to the output's (a fused cast), each to nearest even
    if DTYPE == tl.bfloat16:  # on the bits, as portable.c's bf16_rne (no NaN can occur)
        u = value.to(tl.uint32, bitcast=True)
        value = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif DTYPE == tl.float16:
        value = value.to(tl.float16, fp_downcast_rounding="rtne")
    if OUT != DTYPE:
        value = value.to(tl.float32)  # exact
        if OUT == tl.bfloat16:
            u = value.to(tl.uint32, bitcast=True)
            value = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        elif OUT == tl.float16:
            value = value.to(tl.float16, fp_downcast_rounding="rtne")
    element = tl.reshape(tl.join(2 * pair, 2 * pair + 1), [2 * BLOCK])  # interleaved, as the values
    tl.store(base + (element - lo), value, mask=(element >= lo) & (element < hi))

