"""Fixtures shared by the kernel tests."""
from __future__ import annotations

import pytest


@pytest.fixture
def e4m3_nan(monkeypatch):
    """Give the interpreter e4m3fn's NaN codes: Triton's interpreter converts bytes
    0x7F / 0xFF of ``float8e4nv`` to +-480 (seen on triton 3.9), where the GPU gives NaN, so
    a NaN-poisoned FP8 *code* in the cache is harmless on the CPU and a missing mask on the
    codes goes unseen. This wraps the interpreter's fp8 conversion to make those bytes NaN."""
    import numpy as np
    import triton.language as tl
    try:
        from triton.runtime import interpreter as interp
        cls = type(interp.interpreter_builder)
        original = cls.create_fp_to_fp
    except Exception:  # pragma: no cover - another interpreter layout
        pytest.skip("this Triton's interpreter has no create_fp_to_fp to patch")
    nan_bits = {tl.float32: (np.uint32, 0x7FC00000), tl.bfloat16: (np.uint16, 0x7FC0),
                tl.float16: (np.uint16, 0x7E00)}

    def fp_to_fp(self, src, dst_type, rounding_mode):
        res = original(self, src, dst_type, rounding_mode)
        dst = dst_type.scalar
        if src.dtype.scalar == tl.float8e4nv and dst in nan_bits:
            as_int, bits = nan_bits[dst]
            nan = (src.data & np.uint8(0x7F)) == np.uint8(0x7F)
            data = res.data.copy()
            data.view(as_int)[nan] = as_int(bits)
            res = type(res)(data, res.dtype)
        return res

    monkeypatch.setattr(cls, "create_fp_to_fp", fp_to_fp)
