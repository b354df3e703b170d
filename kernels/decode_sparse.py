"""Sparse top-k MLA decode kernel (DeepSeek-V3.2 style): attention over selected cache slots.

The unit of work is one *row* = one (request, query token) pair: in sparse decode every
MTP token has its own index list, so, unlike the dense kernel, the tokens of a request
share no KV tile and each row is planned on its own. Row ``r`` reads
``row_len[r]`` entries of the flat int32 ``indices`` array starting at ``row_start[r]``;
an entry is a global cache slot (``block * page_size + offset``, i.e. the row index of the
cache seen as ``[num_blocks * page_size, token]``), ``-1`` (or any value outside the
cache) = invalid, masked.

Grid ``(num_parts, ceil(h / BLOCK_M))`` fixed by static config, exactly like the dense
split-KV kernel: the planner (``kernels.planner``, unchanged) partitions the rows' tiles
(``ceil(row_len / BLOCK_N)`` each) into ``num_parts`` equal ranges, and the pieces of a
row crossed by a cut are merged by the dense path's combine kernel, run on the
``[rows, 1, h, rank]`` view of the output. A program handles BLOCK_M heads of one row at a
time; all of them share every loaded latent KV tile.

FP8 caches are dequantised in registers as in ``decode_split`` (e4m3 bytes times the
group's fp32 scale; rope read as bf16); per-tensor fp8_e4m3 caches (``E4M3``) take the
16-bit loads, each value converted to fp32 and multiplied by the one scale, loaded from its
device pointer at every launch.

Stores: an unsplit row writes ``out`` (q dtype) and its lse (natural log) into
``lse_rows [rows, h]``; a split row writes fp32 partials (base-2 lse) for the combine.
Rows with no valid entry end with out 0 / lse -inf (``l == 0`` guarded, never 0/0). A row
with no key tile at all (``row_len == 0``) is skipped by the parts it lies in: its
``num_splits`` is 0, so the combine writes its 0 / -inf.
"""
from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from .hopper.pdl import grid_wait, launch_options, pdl_on
from .rounding import to_out

__all__ = ["launch_decode_sparse"]

_LOG2E = 1.4426950408889634


@triton.jit(do_not_specialize=("partial_cap", "N_SLOTS"))  # why: config.UNSPECIALIZED_DECODE_INTEGERS
def _decode_sparse_kernel(q_ptr, kv_ptr, idx_ptr, rstart_ptr, rlen_ptr, part_ptr, nsplit_ptr, off_ptr,
                          out_ptr, lse_ptr, po_ptr, plse_ptr, kscale_ptr,
                          partial_cap, qk_scale, H, N_SLOTS,
                          RANK: tl.constexpr, ROPE: tl.constexpr, GROUP: tl.constexpr,
                          TOKEN_STRIDE: tl.constexpr, FP8: tl.constexpr, E4M3: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                          PDL: tl.constexpr = False):
    if PDL:  # before any read of the plan (kernels/hopper/pdl.py)
        grid_wait()
    pid_p = tl.program_id(0)
    pid_m = tl.program_id(1)
    D: tl.constexpr = RANK + ROPE
    LN2: tl.constexpr = 0.6931471805599453
    NG: tl.constexpr = RANK // GROUP

    r_first = tl.load(part_ptr + pid_p * 3 + 0)
    t_first = tl.load(part_ptr + pid_p * 3 + 1)
    j_first = tl.load(part_ptr + pid_p * 3 + 2)
    r_end = tl.load(part_ptr + (pid_p + 1) * 3 + 0)
    t_end = tl.load(part_ptr + (pid_p + 1) * 3 + 1)
    r_last = tl.where(t_end > 0, r_end, r_end - 1)
    if E4M3:  # read at every launch, never baked in: a replayed graph follows the engine's updates
        k_scale = tl.load(kscale_ptr)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < H
    offs_r = tl.arange(0, RANK)
    offs_p = tl.arange(0, ROPE)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, NG)

    for r in range(r_first, r_last + 1):
        r64 = tl.cast(r, tl.int64)
        n_idx = tl.maximum(tl.load(rlen_ptr + r), 0)
        n_tiles = (n_idx + BLOCK_N - 1) // BLOCK_N
        t0 = tl.where(r == r_first, t_first, 0)
        t1 = tl.where(r == r_end, t_end, n_tiles)
        # A row without keys in this part (an empty top-k: padding tokens and requests)
        # stores nothing -- the combine writes its 0 / -inf -- so its work is skipped.
        if t1 > t0:
            piece = tl.where(r == r_first, j_first, 0)
            nsplit = tl.load(nsplit_ptr + r)
            p_row = tl.load(off_ptr + r) + piece
            start = tl.load(rstart_ptr + r).to(tl.int64)

            q_row = q_ptr + r64 * (H * D) + offs_m * D
            q_lat = tl.load(q_row[:, None] + offs_r[None, :], mask=row_ok[:, None], other=0.0)
            q_rope = tl.load(q_row[:, None] + RANK + offs_p[None, :], mask=row_ok[:, None], other=0.0)
            if DOT_F32:
                q_lat = q_lat.to(tl.float32)
                q_rope = q_rope.to(tl.float32)

            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            acc = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
            for tile in range(t0, t1):
                offs_n = tile * BLOCK_N + offs_nb
                in_row = offs_n < n_idx
                # -- the top-k selection: entries past the row's count are never read
                slot = tl.load(idx_ptr + start + offs_n, mask=in_row, other=-1)
                kv_ok = in_row & (slot >= 0) & (slot < N_SLOTS)
                kv_row = kv_ptr + tl.where(kv_ok, slot, 0).to(tl.int64) * TOKEN_STRIDE
                if FP8:
                    codes = tl.load(kv_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0)
                    vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                    scale_row = (kv_row + RANK).to(tl.pointer_type(tl.float32))
                    sc = tl.load(scale_row[:, None] + offs_g[None, :], mask=kv_ok[:, None], other=0.0)
                    k_lat = tl.reshape(tl.reshape(vals, (BLOCK_N, NG, GROUP)) * sc[:, :, None], (BLOCK_N, RANK))
                    k_rope = tl.load((kv_row + RANK + 4 * NG).to(tl.pointer_type(tl.bfloat16))[:, None]
                                     + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
                else:
                    k_lat = tl.load(kv_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0.0)
                    k_rope = tl.load(kv_row[:, None] + RANK + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
                    if E4M3:  # e4m3 -> fp32 (exact) times the scale: the reference's fp32 product
                        k_lat = k_lat.to(tl.float32) * k_scale
                        k_rope = k_rope.to(tl.float32) * k_scale
                k_lat = k_lat.to(q_lat.dtype)
                k_rope = k_rope.to(q_rope.dtype)
                if DOT_F32:
                    s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
                    s += tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")
                else:
                    s = tl.dot(q_lat, tl.trans(k_lat))
                    s += tl.dot(q_rope, tl.trans(k_rope))
                # tl.where, not an additive bias: a NaN score (poisoned padding q) must vanish too
                s = tl.where(kv_ok[None, :], s * qk_scale, float("-inf"))
                m_new = tl.maximum(m_i, tl.max(s, axis=1))
                m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
                alpha = tl.exp2(m_i - m_ref)
                p = tl.exp2(s - m_ref[:, None])
                l_i = l_i * alpha + tl.sum(p, axis=1)
                if DOT_F32:
                    pv = tl.dot(p, k_lat, input_precision="ieee")
                else:
                    pv = tl.dot(p.to(k_lat.dtype), k_lat)
                acc = acc * alpha[:, None] + pv
                m_i = m_new

            has_keys = l_i > 0.0
            o = acc / tl.where(has_keys, l_i, 1.0)[:, None]
            lse2 = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
            # the row's one piece goes straight to the output; a piece of a split row to the
            # partial buffer (never past it, whatever the plan says)
            if nsplit == 1:
                tl.store(out_ptr + r64 * (H * RANK) + offs_m[:, None] * RANK + offs_r[None, :],
                         to_out(o, out_ptr.dtype.element_ty), mask=row_ok[:, None])
                tl.store(lse_ptr + r64 * H + offs_m, lse2 * LN2, mask=row_ok)
            elif (nsplit > 1) & (p_row < partial_cap):
                p64 = p_row.to(tl.int64)
                tl.store(po_ptr + p64 * (H * RANK) + offs_m[:, None] * RANK + offs_r[None, :], o,
                         mask=row_ok[:, None])
                tl.store(plse_ptr + p64 * H + offs_m, lse2, mask=row_ok)


def launch_decode_sparse(q, kv_cache, indices, row_start, row_len, part_info, num_splits, split_offsets,
                         out, lse_rows, partial_o, partial_lse, *, softmax_scale: float, rank: int, rope_dim: int,
                         fp8_group: int, block_m: int, block_n: int, num_warps: int, num_stages: int,
                         dot_f32: bool, k_scale: Optional[torch.Tensor] = None) -> None:
    """Launch the sparse decode (arguments checked by ``ops.decode_sparse``).

    Shapes (``R = B * s_q`` rows): q ``[B, s_q, h, rank + rope]``; indices int32 ``[N]``;
    row_start / row_len int32 ``[R]``; part_info int32 ``[num_parts + 1, 3]``;
    num_splits / split_offsets int32 ``[R]``; out ``[B, s_q, h, rank]``; lse_rows fp32
    ``[R, h]``; partial_o fp32 ``[cap, h, rank]``; partial_lse fp32 ``[cap, h]``; k_scale fp32
    ``[1]`` for (and only for) a float8_e4m3fn cache.
    """
    h = q.shape[2]
    num_parts = part_info.shape[0] - 1
    fp8 = kv_cache.dtype == torch.uint8
    e4m3 = kv_cache.dtype == torch.float8_e4m3fn
    if e4m3 and k_scale is None:
        raise ValueError("an fp8_e4m3 cache needs k_scale (fp32 [1] on its device)")
    n_slots = kv_cache.shape[0] * kv_cache.shape[1]
    grid = (num_parts, triton.cdiv(h, block_m))
    pdl = pdl_on(q)
    _decode_sparse_kernel[grid](
        q, kv_cache, indices, row_start, row_len, part_info, num_splits, split_offsets,
        out, lse_rows, partial_o, partial_lse, k_scale if e4m3 else lse_rows,
        partial_o.shape[0], float(softmax_scale) * _LOG2E, h, n_slots,
        RANK=rank, ROPE=rope_dim, GROUP=fp8_group, TOKEN_STRIDE=kv_cache.shape[-1], FP8=fp8, E4M3=e4m3,
        BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=dot_f32, PDL=pdl, num_warps=num_warps, num_stages=num_stages,
        **launch_options(pdl))
