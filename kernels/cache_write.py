"""Cache-write kernel: latent + rope rows into the paged cache by slot mapping.

One program per block of up to 16 tokens. ``slot == -1`` (padding) and out-of-range slots write nothing:
the store is masked, so the cache bytes of such slots are untouched. FP8 caches quantise
on write into ``mla_ref.fp8``'s token layout with exactly the reference's arithmetic
(fp32 amax per group, IEEE division, clamp, round-half-even e4m3), so the bytes match.
fp8_e4m3 caches (``mla_ref.fp8_tensor``) take the same steps with the one per-tensor scale,
loaded from its device tensor when the kernel runs (a captured write follows the engine's
in-place scale updates): ``rne(clamp(x / k_scale, +-448))`` over latent and rope, NaN kept NaN.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .config import next_pow2
from .rounding import AMAX_FLOOR, E4M3_MAX, bf16_rne, e4m3_code

__all__ = ["launch_cache_write"]


@triton.jit
def _e4m3_saturated(x):
    """fp32 -> int32 e4m3fn codes as torch's ``x.clamp(-448, 448).to(float8_e4m3fn)``: saturated
    (e4m3fn has no infinity), round-half-even, NaN -> 0x7F."""
    is_nan = x != x
    # NaN is re-made after the clamp: the GPU's min/max return the non-NaN operand, where
    # torch's clamp keeps NaN
    x = tl.minimum(tl.maximum(tl.where(is_nan, 0.0, x), -E4M3_MAX), E4M3_MAX)
    return tl.where(is_nan, 0x7F, e4m3_code(x))


@triton.jit(do_not_specialize=("T", "n_slots"))  # tokens and cache slots follow the batch and the pool
def _cache_write_kernel(kv_ptr, lat_ptr, rope_ptr, slot_ptr, kscale_ptr, T, n_slots,
                        RANK: tl.constexpr, ROPE: tl.constexpr, GROUP: tl.constexpr,
                        TOKEN_STRIDE: tl.constexpr, FP8: tl.constexpr, E4M3: tl.constexpr, BLOCK_T: tl.constexpr):
    toks = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_range = toks < T
    slot = tl.load(slot_ptr + toks, mask=in_range, other=-1)
    ok = in_range & (slot >= 0) & (slot < n_slots)
    # a masked-off store never touches memory, but its address is still formed: keep it in range
    slot = tl.where(ok, slot, 0)
    offs_r = tl.arange(0, RANK)
    offs_p = tl.arange(0, ROPE)
    t64 = toks.to(tl.int64)
    lat = tl.load(lat_ptr + t64[:, None] * RANK + offs_r[None, :], mask=in_range[:, None], other=0.0)
    rope = tl.load(rope_ptr + t64[:, None] * ROPE + offs_p[None, :], mask=in_range[:, None], other=0.0)
    # skipped tokens may carry anything (NaN in padded rows): keep it out of the arithmetic
    lat = tl.where(ok[:, None], lat, 0.0)
    rope = tl.where(ok[:, None], rope, 0.0)
    base = kv_ptr + slot * TOKEN_STRIDE
    if FP8:
        NG: tl.constexpr = RANK // GROUP
        groups = tl.reshape(lat.to(tl.float32), (BLOCK_T, NG, GROUP))
        amax = tl.max(tl.abs(groups), axis=2)
        # div_rn: Triton's fp32 `/` is div.full (<= 2 ulp) on NVIDIA; the reference's is IEEE
        scale = tl.math.div_rn(tl.maximum(amax, AMAX_FLOOR), E4M3_MAX)
        vals = tl.math.div_rn(groups, scale[:, :, None])
        vals = tl.minimum(tl.maximum(vals, -E4M3_MAX), E4M3_MAX)
        codes = tl.reshape(e4m3_code(vals), (BLOCK_T, RANK)).to(tl.uint8)
        tl.store(base[:, None] + offs_r[None, :], codes, mask=ok[:, None])
        scale_ptr = (base + RANK).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptr[:, None] + tl.arange(0, NG)[None, :], scale, mask=ok[:, None])
        rope_out = (base + RANK + 4 * NG).to(tl.pointer_type(tl.bfloat16))
        tl.store(rope_out[:, None] + offs_p[None, :], bf16_rne(rope.to(tl.float32)), mask=ok[:, None])
    elif E4M3:
        # kv_ptr is the cache's byte view: codes are built as integers (rounding.e4m3_code)
        k_scale = tl.load(kscale_ptr)
        x = tl.math.div_rn(lat.to(tl.float32), k_scale)
        tl.store(base[:, None] + offs_r[None, :], _e4m3_saturated(x).to(tl.uint8), mask=ok[:, None])
        x = tl.math.div_rn(rope.to(tl.float32), k_scale)
        tl.store(base[:, None] + RANK + offs_p[None, :], _e4m3_saturated(x).to(tl.uint8), mask=ok[:, None])
    else:
        out_ty: tl.constexpr = kv_ptr.dtype.element_ty
        if out_ty == tl.bfloat16:
            lat_out = bf16_rne(lat.to(tl.float32))
            rope_val = bf16_rne(rope.to(tl.float32))
        else:
            lat_out = lat.to(out_ty)
            rope_val = rope.to(out_ty)
        tl.store(base[:, None] + offs_r[None, :], lat_out, mask=ok[:, None])
        tl.store(base[:, None] + RANK + offs_p[None, :], rope_val, mask=ok[:, None])


def launch_cache_write(kv_cache: torch.Tensor, latent: torch.Tensor, rope: torch.Tensor,
                       slot_mapping: torch.Tensor, *, rank: int, rope_dim: int, group: int,
                       k_scale: Optional[torch.Tensor] = None) -> None:
    """Launch the cache write (arguments already checked by ``ops.write_kv_cache``).

    Args:
        kv_cache: contiguous floating ``[num_blocks, page_size, 1, rank + rope_dim]`` (float8_e4m3fn
            included) or uint8 ``[num_blocks, page_size, fp8_bytes_per_token]``.
        latent: contiguous ``[T, rank]`` float; rope: contiguous ``[T, rope_dim]`` float.
        slot_mapping: contiguous int64 ``[T]``; -1 = skip.
        k_scale: fp32 ``[1]`` on the cache's device, for (and only for) a float8_e4m3fn cache.
    """
    T = slot_mapping.shape[0]
    if T == 0:
        return
    fp8 = kv_cache.dtype == torch.uint8
    e4m3 = kv_cache.dtype == torch.float8_e4m3fn
    n_slots = kv_cache.shape[0] * kv_cache.shape[1]
    token_stride = kv_cache.shape[-1]
    block_t = min(next_pow2(T), 16)
    # the e4m3 codes are stored as bytes: the same bits, and no fp8 store to lower
    dst = kv_cache.view(torch.uint8) if e4m3 else kv_cache
    _cache_write_kernel[(triton.cdiv(T, block_t),)](
        dst, latent, rope, slot_mapping, k_scale if e4m3 else slot_mapping, T, n_slots, RANK=rank, ROPE=rope_dim,
        GROUP=group, TOKEN_STRIDE=token_stride, FP8=fp8, E4M3=e4m3, BLOCK_T=block_t, num_warps=4)
