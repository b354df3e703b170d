"""Triton's CPU interpreter and bf16: detect the broken arithmetic once, per process.

Triton 3.9's interpreter computes bf16 arithmetic (and bf16 ``tl.dot``) on the raw 16-bit
patterns: ``[1.5, 2, -3, .25] * [2, .5, 1, 4]`` comes out as ``[0, 0, -3.7e19, 2]``. Our own
kernels work around it; anyone else's bf16 kernel would fail every case on CPU with errors
near 1e9, which says nothing about their backend. So on CPU, where the probe below fails,
third-party backends are fuzzed with fp16 only (``loading.effective_capabilities``).
"""
from __future__ import annotations

import functools
import os


def interpreting() -> bool:
    """Triton kernels in this process run through the interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@functools.lru_cache(maxsize=None)
def bf16_broken() -> bool:
    """True when Triton's interpreter mis-computes a bf16 product (the probe in the module
    docstring). Runs the probe with the interpreter on for the decoration only; False when
    Triton is missing (nothing to protect)."""
    try:
        import torch
        import triton
        import triton.language as tl
    except Exception:
        return False
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        @triton.jit
        def _mul(x_ptr, y_ptr, o_ptr, N: tl.constexpr):
            i = tl.arange(0, N)
            tl.store(o_ptr + i, tl.load(x_ptr + i) * tl.load(y_ptr + i))
    finally:
        if saved is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = saved
    x = torch.tensor([1.5, 2.0, -3.0, 0.25], dtype=torch.bfloat16)
    y = torch.tensor([2.0, 0.5, 1.0, 4.0], dtype=torch.bfloat16)
    o = torch.empty_like(x)
    try:
        _mul[(1,)](x, y, o, N=4)
    except Exception:
        return True  # an interpreter that cannot even run it cannot run a bf16 backend either
    return not torch.equal(o, x * y)
