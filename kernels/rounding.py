"""Exact float encodings for the cache write and the output stores: fp32 -> e4m3fn and fp32 -> bf16, RNE.

Done with integer bit arithmetic instead of ``x.to(tl.float8e4nv)`` / ``x.to(tl.bfloat16)``:
the interpreter's casts mis-round (fp32 -> bf16 truncates; fp32 -> e4m3 drops a mantissa
carry into the next binade, so 1.95 encodes as 1.0, and truncates subnormals), and one
integer path gives the same bytes on CPU and GPU, equal to torch's ``.to()``. Decoding
uses the native bitcast + cast, which the interpreter gets right for every finite code.
"""
from __future__ import annotations

import triton
import triton.language as tl

#: mla_ref.fp8.FP8_AMAX_FLOOR (2**-100) and FP8_E4M3_MAX, as kernel constants (a jit
#: function may only read globals that are ``tl.constexpr``).
AMAX_FLOOR = tl.constexpr(2.0 ** -100)
E4M3_MAX = tl.constexpr(448.0)


@triton.jit
def e4m3_code(x):
    """fp32 tensor, already clamped to [-448, 448] -> int32 e4m3fn byte values (RNE).

    fp32 biased exponent e >= 121 is an e4m3 normal (2**-6 and up): keep the top 3
    mantissa bits with round-half-even on the 20 dropped bits; a carry rolls into the
    exponent field by itself, and re-biasing (127 -> 7) is subtracting 120 << 3.
    Below that the e4m3 value is subnormal, a multiple of 2**-9: round the full 24-bit
    significand right by (141 - e) bits; a result of 8 is exactly the smallest normal.
    """
    bits = x.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a = bits & 0x7FFFFFFF
    e = a >> 23
    normal = (a + 0x7FFFF + ((a >> 20) & 1)) >> 20
    normal = normal - (120 << 3)
    sig = (a & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
    shift = tl.minimum(141 - e, 31)
    shift = tl.maximum(shift, 1)
    half_m1 = (1 << (shift - 1)) - 1
    sub = (sig + half_m1 + ((sig >> shift) & 1)) >> shift
    code = tl.where(e >= 121, normal, sub)
    return code | (sign << 7)


@triton.jit
def bf16_rne(x):
    """fp32 tensor -> bf16 tensor, round-half-even (quiet NaNs stay NaN)."""
    bits = x.to(tl.int32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return (rounded & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def to_out(x, OUT_TY: tl.constexpr):
    """fp32 -> the output dtype with round-half-even, as torch's ``.to()`` does."""
    if OUT_TY == tl.bfloat16:
        # bf16_rne's body, inlined: this runs once per program and request, and under the
        # interpreter every nested jit call costs milliseconds of re-patching
        bits = x.to(tl.int32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return (rounded & 0xFFFF).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(OUT_TY)
