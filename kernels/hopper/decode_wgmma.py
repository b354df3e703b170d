"""Hopper split-KV decode at 64-row blocks of a 16-bit cache, written in Gluon (GPU only).

Contract, plan and stores of the Triton decode (``kernels/decode_split.py``): grid ``(num_parts,
m_blocks)``, one program per (part, row block), parts from the planner; a request that is not
split stores ``out`` / ``lse``, a split one its fp32 partial. Shapes: rank 512 + rope 64, 64 query
rows a block (``s_q * h`` rows, token-major; padding rows masked), 64-key tiles, 8 warps; a bf16 or
fp16 cache ``[num_blocks, page, 1, 576]`` with q of its dtype.

Per tile (``S`` scaled by ``softmax_scale * log2(e)``)::

    S   = where(visible, Q_lat K_lat^T + Q_rope K_rope^T, -inf)
    m'  = max(m, rowmax S);  P = exp2(S - m');  alpha = exp2(m - m')
    l   = l alpha + rowsum P;  acc = acc alpha + P K_lat;  m = m'

Triton's ``tl.dot`` computes the ``Q K^T`` tile in *both* warpgroups here (a dot whose result
reaches another dot gets every warp along M) and waits for each dot; Gluon states the layouts,
buffers and waits, so:

- both dots are laid out ``[4, 2]``: for ``S`` (64 rows x 64 keys) each warpgroup computes 32
  keys, for ``acc += P V`` (64 x 512) 256 columns; each warpgroup's half of P goes to a shared
  ``[64, 64]`` buffer and after a barrier the PV dot reads all of it; the softmax's row max and
  sum span both warpgroups (``gluon_parts.rows_tile_step``);
- key tiles are copied ``cp.async`` into a ring of two shared buffers (one tile in flight while
  one is used), a key's row found through the block table -- a tile's page read a tile ahead
  when a page holds whole tiles (``gluon_parts.tile_page``); keys past ``seq_len`` are masked
  copies, which land as zeros (a NaN-poisoned stale slot never reaches ``P @ V``);
- the PV dot is issued asynchronously and waited for at the top of the next tile, after the
  next tile's copy has been issued.

Shared memory: q 72 KiB, P 8 KiB, two 72 KiB tiles: 224.5 KiB of the H100's 227.

The route table (``kernels/routes.py``) sends 16-bit 64-row launches to the ping-pong kernel
(``decode_wgmma_pp``) and this one runs those it refuses: fewer than two row blocks or 16
(request, row block) pairs. The measurements behind it are in ``docs/kernel-performance.md``.
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, warpgroup_mma_init,
                                                                  warpgroup_mma_wait)
except Exception:  # pragma: no cover - a Triton without Gluon: the Triton kernel only
    gluon = None

from .gluon_parts import (copy_q_rows, key_rows, program_rows, request_span, row_copy_layout, rows_tile_step,
                          store_rows_result, tile_page, wait_prior_grid, wgmma_layout)
from .pdl import pdl_on
from ..config import UNSPECIALIZED_DECODE_INTEGERS

__all__ = ["launch_decode_wgmma"]


if gluon is not None:

    @gluon.jit
    def _issue_tile(k_lat_buf, k_rope_buf, kv_ptr, bt_row, tile, seq_len, page0, PAGE: gl.constexpr,
                    RANK: gl.constexpr, ROPE: gl.constexpr, TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr,
                    LAT_L: gl.constexpr, ROPE_L: gl.constexpr):
        # Copy one tile's keys (latent and rope) into shared memory (cp.async). Keys past seq_len
        # (and a whole tile past the request, issued to keep the group count uniform) are masked:
        # cp.async writes zeros for them, so a NaN-poisoned stale slot never reaches a dot. The
        # keys' rows: in page ``page0`` (``tile_page``, loaded a tile ahead) when a page holds
        # whole tiles.
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, LAT_L))
        kv_ok = offs_n < seq_len
        row = key_rows(kv_ptr, bt_row, offs_n, kv_ok, page0, PAGE, BLOCK_N, TOKEN_STRIDE)
        cols = gl.arange(0, RANK, layout=gl.SliceLayout(0, LAT_L))
        async_copy.async_copy_global_to_shared(k_lat_buf, row[:, None] + cols[None, :],
                                               mask=kv_ok[:, None] & (cols[None, :] < RANK))
        offs_nr = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
        ok_r = offs_nr < seq_len
        row_r = key_rows(kv_ptr, bt_row, offs_nr, ok_r, page0, PAGE, BLOCK_N, TOKEN_STRIDE)
        cols_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        rope_ptr = row_r + RANK
        async_copy.async_copy_global_to_shared(k_rope_buf, rope_ptr[:, None] + cols_r[None, :],
                                               mask=ok_r[:, None] & (cols_r[None, :] < ROPE))

    @gluon.jit(do_not_specialize=UNSPECIALIZED_DECODE_INTEGERS)
    def _decode_wgmma_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr,
                             out_ptr, lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H,
                             PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr,
                             TOKEN_STRIDE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                             PDL: gl.constexpr):
        gl.static_assert(BLOCK_M == 64)
        gl.static_assert(gl.num_warps() == 8)
        wait_prior_grid(PDL)  # before any read of the plan (kernels/hopper/pdl.py)
        DT: gl.constexpr = q_ptr.dtype.element_ty
        D: gl.constexpr = RANK + ROPE
        # [4, 2]: the four warps of a warpgroup split the 64 rows, the two warpgroups the N axis
        S_L: gl.constexpr = wgmma_layout([4, 2], BLOCK_N // 2)
        ACC_L: gl.constexpr = wgmma_layout([4, 2], RANK // 2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        ROW_A: gl.constexpr = gl.SliceLayout(1, ACC_L)
        COL_A: gl.constexpr = gl.SliceLayout(0, ACC_L)
        # copies: 16-byte vectors along a row (8 16-bit values)
        Q_L: gl.constexpr = row_copy_layout(8, 32, 8)
        LAT_L: gl.constexpr = Q_L
        ROPE_L: gl.constexpr = row_copy_layout(8, 8, 8)
        LAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, RANK], DT)
        ROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], DT)
        QLAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, RANK], DT)
        QROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, ROPE], DT)
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], DT)

        q_lat_s = gl.allocate_shared_memory(DT, [BLOCK_M, RANK], QLAT_SH)
        q_rope_s = gl.allocate_shared_memory(DT, [BLOCK_M, ROPE], QROPE_SH)
        k_rope_s = gl.allocate_shared_memory(DT, [2, BLOCK_N, ROPE], ROPE_SH)
        p_s = gl.allocate_shared_memory(DT, [BLOCK_M, BLOCK_N], P_SH)
        k_lat_s = gl.allocate_shared_memory(DT, [2, BLOCK_N, RANK], LAT_SH)

        ROWS = SQ * H
        # the part, and the rows and keys in the dot layouts (masks)
        b_first, t_first, j_first, b_end, t_end, b_last, row0, ctx_w, m_s, n_s = program_rows(
            part_ptr, ctxw_ptr, BLOCK_M, BLOCK_N, S_L)
        row_ok_s = m_s < ROWS
        tok_s = m_s // H

        for b in range(b_first, b_last + 1):
            b64 = b.to(gl.int64)
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            if t1 > t0:
                bt_row = bt_ptr + b64 * bt_stride
                ctx = gl.load(ctx_ptr + b64 * ctx_w + tok_s, mask=row_ok_s & (tok_s < ctx_w), other=0)
                # every warp is done with the shared buffers of the previous request
                gl.thread_barrier()
                # q (padding rows: zeros) and tile t0: copy group 0
                copy_q_rows(q_ptr + b64 * (ROWS * D), row0, ROWS, q_lat_s, q_rope_s, RANK, ROPE, Q_L,
                            ROPE_L)
                _issue_tile(k_lat_s.index(0), k_rope_s.index(0), kv_ptr, bt_row, t0, seq_len,
                            tile_page(bt_row, t0, t1, PAGE, BLOCK_N), PAGE, RANK, ROPE, TOKEN_STRIDE, BLOCK_N,
                            LAT_L, ROPE_L)
                async_copy.commit_group()

                m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
                l_i = gl.full([BLOCK_M], 0.0, gl.float32, ROW_S)
                # carried through the loop as an in-flight wgmma accumulator
                acc = warpgroup_mma_init(gl.full([BLOCK_M, RANK], 0.0, gl.float32, ACC_L))
                pg_next = tile_page(bt_row, t0 + 1, t1, PAGE, BLOCK_N)
                for tile in range(t0, t1):
                    buf = (tile - t0) % 2
                    # the PV dot of the previous tile (which read the other buffer and P) is done
                    # in this warpgroup; the barrier makes it done in both before they are reused
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    gl.thread_barrier()
                    _issue_tile(k_lat_s.index(1 - buf), k_rope_s.index(1 - buf), kv_ptr, bt_row, tile + 1,
                                gl.where(tile + 1 < t1, seq_len, 0), pg_next, PAGE, RANK, ROPE, TOKEN_STRIDE,
                                BLOCK_N, LAT_L, ROPE_L)
                    async_copy.commit_group()
                    # the page of the tile after, for the next trip's copies
                    pg_next = tile_page(bt_row, tile + 2, t1, PAGE, BLOCK_N)
                    # this tile's group (all but the one just issued) has landed, for every thread,
                    # and is visible to the tensor cores' (async proxy) reads
                    async_copy.wait_group(1)
                    k_lat = k_lat_s.index(buf)
                    fence_async_shared()
                    gl.thread_barrier()
                    acc, m_i, l_i = rows_tile_step(q_lat_s, q_rope_s, k_lat, k_rope_s.index(buf), p_s, acc, m_i, l_i,
                                                   ctx, tile, n_s, seq_len, qk_scale, S_L, ROW_A)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                # the trailing (empty) copy group
                async_copy.wait_group(0)

                store_rows_result(acc, m_i, l_i, row0, b64, nsplit, p_row, partial_cap, out_ptr, lse_ptr,
                                  po_ptr, plse_ptr, ROWS, SQ, H, BLOCK_M, RANK, ROW_S, ROW_A, COL_A)


def launch_decode_wgmma(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                        split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale_log2: float, rank: int,
                        rope_dim: int, block_m: int, block_n: int, fp8_group: int = 0) -> None:
    """Launch this kernel (arguments as ``decode_split.launch_decode_split``; ``routes.resolve``
    has admitted the launch). Shapes: q ``[B, s_q, h, rank + rope]`` (bf16/fp16, the cache's dtype);
    kv_cache ``[num_blocks, page, 1, rank + rope]``; block_m = block_n = 64; the rest as the Triton
    launcher (``fp8_group`` is not used)."""
    B, s_q, h, _ = q.shape
    num_parts = part_info.shape[0] - 1
    m_blocks = -(-(s_q * h) // block_m)
    pdl = pdl_on(q)
    _decode_wgmma_kernel[(num_parts, m_blocks)](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, block_table.shape[1], partial_o.shape[0], softmax_scale_log2, s_q, h,
        PAGE=kv_cache.shape[1], RANK=rank, ROPE=rope_dim, TOKEN_STRIDE=kv_cache.shape[-1], BLOCK_M=block_m,
        BLOCK_N=block_n, PDL=pdl, num_warps=8, launch_pdl=pdl)
