"""Hopper split-KV decode of a 16-bit cache in blocks of up to 32 query rows: TMA copies of the
cache rows, keys on the wgmma M axis (Gluon, GPU only).

Contract, plan and stores of the Triton decode (``kernels/decode_split.py``), grid ``(num_parts,
m_blocks)`` of 16- or 32-row blocks. Shapes: rank 512 + rope 64, bf16 / fp16 cache ``[num_blocks,
page, 1, 576]`` with q of its dtype, 64-key tiles, a 4-warp consumer. With ``R`` query rows a block,
the dots put the keys on wgmma's M axis (64, its minimum) and the query rows on N, so no row of a
dot is padding::

    S^T   [64, R]   = sum_c K_c [64, 64] @ Q_c^T [64, R]      (c: eight latent chunks, the rope)
    acc^T [512, R] += per latent chunk c: K_c^T [64, 64] @ P^T [64, R]

- A one-warp *producer* issues TMA copies of each tile's rows -- nine ``[rows, 64]`` boxes
  (eight of the latent, one of the rope), 128-byte swizzle, one set a page when a page holds
  fewer than 64 keys -- into a ring of ``KT_STAGES`` stages of 72 KiB, reading each tile's page
  a tile ahead (``gluon_parts.tma_tile_walk``).
- The *consumer* warpgroup copies q into shared memory once a request and per tile runs QK (nine
  dots into one accumulator), the softmax (``gluon_parts.softmax_keys_step``), P^T into shared
  memory in the cache's dtype, and PV (eight dots, ``K_c^T`` the same buffer read transposed),
  then frees the stage.

TMA copies whatever the slots hold, so keys past ``seq_len`` (a NaN-poisoned stale slot, a page
past the request's: page 0's rows) reach shared memory. Their scores are masked by the softmax
(P = 0), but 0 times a NaN is a NaN: in a request's last, partial tile the consumer zeroes those
keys' latent rows before the dots. At 32 rows the eight ``[64, 32]`` fp32 accumulators spill a
little (52 bytes, sm_90a, Triton 3.6).

The route table (``kernels/routes.py``) gives it 16-bit launches of up to 32 rows on Hopper
(h=16 at s_q 1-2; h=16 x 2 at batches up to ``routes.SPLIT_ROWS_MAX_BATCH`` in two 16-row
blocks); a cache TMA cannot copy goes to the Triton kernel. Measurements:
``docs/kernel-performance.md``.
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except Exception:  # pragma: no cover - a Triton without Gluon: the Triton kernel only
    gluon = None
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - a Gluon without host-side TMA descriptors
    TensorDescriptor = None

from .gluon_parts import (part_bounds, request_span, ring_barriers, row_copy_layout, softmax_keys_step,
                          softmax_result, start_request_rows, store_keys_lse, store_keys_part, tma_tile_walk,
                          wait_prior_grid, wgmma_layout)
from .pdl import pdl_on
from ..config import UNSPECIALIZED_DECODE_INTEGERS

__all__ = ["launch_decode_wgmma_kt", "kt_descriptor", "kt_descriptors_available", "KT_STAGES", "KT_CHUNK"]

#: warps of the consumer warpgroup (the launch's ``num_warps``)
KT_WARPS = 4
#: stages of the TMA ring (72 KiB each; three would not fit beside q and P)
KT_STAGES = 2
#: columns of a TMA box and of a dot's k slice: 128 bytes of a 16-bit row, the swizzle's width
KT_CHUNK = 64
#: warps and registers of the producer partition (it only issues TMA copies)
KT_PRODUCER_WARPS = 1
KT_PRODUCER_REGS = 40
#: the kernel's register cap: 8 warps (the one-warp producer takes a warpgroup's) x 32 x this <= 64K
KT_MAXNREG = 232

if gluon is not None:

    @gluon.jit
    def _kt_copy_boxes(descs, bufs, row, bar, s, r0, NS: gl.constexpr):
        # one box of a tile (gluon_parts.tma_tile_walk): cache rows [row, row + SUB) into rows
        # [r0, r0 + SUB) of stage s, one box a 64-column chunk (the latent's eight, the rope)
        k_desc, = descs
        k_s, = bufs
        NC: gl.constexpr = k_s.shape[0] // NS
        SUB: gl.constexpr = k_desc.block_shape[0]
        CH: gl.constexpr = k_desc.block_shape[1]
        for c in gl.static_range(NC):
            tma.async_copy_global_to_shared(k_desc, [row, c * CH], bar, k_s.index(s * NC + c).slice(r0, SUB))

    @gluon.jit
    def _kt_producer(k_desc, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride, k_s, ready, empty,
                     PAGE: gl.constexpr, NC: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr,
                     PDL: gl.constexpr):
        wait_prior_grid(PDL)  # this partition's warps too (kernels/hopper/pdl.py)
        # (a box past the request's keys copies page 0's rows, zeroed by the consumer before any dot)
        tma_tile_walk(_kt_copy_boxes, (k_desc, ), (k_s, ), bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr,
                      bt_stride, ready, empty, BLOCK_N * NC * k_desc.block_shape[1] * 2, k_desc.block_shape[0], PAGE,
                      BLOCK_N, NS)

    @gluon.jit
    def _kt_consumer(q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                     plse_ptr, partial_cap, qk_scale, SQ, H, k_s, q_lat_s, q_rope_s, p_s, ready, empty,
                     RANK: gl.constexpr, ROPE: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                     NS: gl.constexpr):
        W: gl.constexpr = gl.num_warps()
        KT: gl.constexpr = q_ptr.dtype.element_ty
        CH: gl.constexpr = k_s.shape[2]
        NL: gl.constexpr = RANK // CH  # latent chunks; chunk NL is the rope
        NC: gl.constexpr = NL + 1
        MMA_L: gl.constexpr = wgmma_layout([W, 1], BLOCK_R)
        KEY_L: gl.constexpr = gl.SliceLayout(1, MMA_L)
        ROW_L: gl.constexpr = gl.SliceLayout(0, MMA_L)
        Q_L: gl.constexpr = row_copy_layout(8, 32, W)
        # q's rope, and a chunk's rows read and rewritten when stale keys must be zeroed: 16-byte
        # vectors along 64-column rows
        QR_L: gl.constexpr = row_copy_layout(8, 8, W)
        # acc^T [CH, R] of a chunk in a store-friendly layout: four adjacent latent columns a thread
        OUT_L: gl.constexpr = gl.BlockedLayout(size_per_thread=[4, 1], threads_per_warp=[16, 2],
                                               warps_per_cta=[1, W], order=[0, 1])

        ROWS = SQ * H
        b_first, t_first, j_first, b_end, t_end, b_last = part_bounds(part_ptr, gl.program_id(0))
        ctx_w = gl.load(ctxw_ptr)
        # row block program_id(1): rows row0 + [0, BLOCK_R) of every request
        row0 = gl.program_id(1) * BLOCK_R
        r = row0 + gl.arange(0, BLOCK_R, layout=ROW_L)
        n = gl.arange(0, BLOCK_N, layout=KEY_L)
        n_z = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, QR_L))
        r_out = row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, OUT_L))
        c_out = gl.arange(0, CH, layout=gl.SliceLayout(1, OUT_L))
        row_ok = r < ROWS
        tok = r // H
        it = 0
        for b in range(b_first, b_last + 1):
            b64 = b.to(gl.int64)
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            if t1 > t0:
                # q (rows past ROWS as zeros) into shared memory, after every warp is done with the last
                ctx = start_request_rows(q_ptr, ctx_ptr, b64, ctx_w, tok, row_ok, row0, ROWS, q_lat_s, q_rope_s, RANK,
                                         ROPE, Q_L, QR_L)
                m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, ROW_L)
                l_p = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                a0 = gl.full([CH, BLOCK_R], 0.0, gl.float32, MMA_L)
                a1 = a0
                a2 = a0
                a3 = a0
                a4 = a0
                a5 = a0
                a6 = a0
                a7 = a0
                for tile in range(t0, t1):
                    s = it % NS
                    mbarrier.wait(ready.index(s), (it // NS) & 1)
                    if tile * BLOCK_N + BLOCK_N > seq_len:
                        # the last, partial tile: zero the latent rows of keys past seq_len (what
                        # TMA copied there may be NaN, and 0 * NaN in PV is NaN)
                        stale = (tile * BLOCK_N + n_z >= seq_len)[:, None]
                        for c in gl.static_range(NL):
                            buf = k_s.index(s * NC + c)
                            buf.store(gl.where(stale, 0.0, buf.load(QR_L).to(gl.float32)).to(KT))
                        fence_async_shared()
                        gl.thread_barrier()
                    z = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                    sc = warpgroup_mma(k_s.index(s * NC + NL), q_rope_s.permute((1, 0)), z, use_acc=False,
                                       is_async=True)
                    for c in gl.static_range(NL):
                        sc = warpgroup_mma(k_s.index(s * NC + c), q_lat_s.slice(c * CH, CH, dim=1).permute((1, 0)),
                                           sc, is_async=True)
                    sc = warpgroup_mma_wait(num_outstanding=0, deps=(sc, ))
                    p, alpha, m_i, l_p = softmax_keys_step(sc * qk_scale, m_i, l_p, ctx, tile * BLOCK_N + n, seq_len)
                    p_s.store(p.to(KT))
                    fence_async_shared()
                    gl.thread_barrier()
                    sa = alpha[None, :]
                    a0 = warpgroup_mma(k_s.index(s * NC + 0).permute((1, 0)), p_s, a0 * sa, is_async=True)
                    a1 = warpgroup_mma(k_s.index(s * NC + 1).permute((1, 0)), p_s, a1 * sa, is_async=True)
                    a2 = warpgroup_mma(k_s.index(s * NC + 2).permute((1, 0)), p_s, a2 * sa, is_async=True)
                    a3 = warpgroup_mma(k_s.index(s * NC + 3).permute((1, 0)), p_s, a3 * sa, is_async=True)
                    a4 = warpgroup_mma(k_s.index(s * NC + 4).permute((1, 0)), p_s, a4 * sa, is_async=True)
                    a5 = warpgroup_mma(k_s.index(s * NC + 5).permute((1, 0)), p_s, a5 * sa, is_async=True)
                    a6 = warpgroup_mma(k_s.index(s * NC + 6).permute((1, 0)), p_s, a6 * sa, is_async=True)
                    a7 = warpgroup_mma(k_s.index(s * NC + 7).permute((1, 0)), p_s, a7 * sa, is_async=True)
                    a0, a1, a2, a3, a4, a5, a6, a7 = warpgroup_mma_wait(
                        num_outstanding=0, deps=(a0, a1, a2, a3, a4, a5, a6, a7))
                    # every warp is done reading stage s (and P) before the arrival
                    gl.thread_barrier()
                    mbarrier.arrive(empty.index(s))
                    it += 1

                l_safe, lse2 = softmax_result(m_i, gl.sum(l_p, axis=0))
                inv_o = gl.convert_layout(1.0 / l_safe, gl.SliceLayout(0, OUT_L))
                accs = (a0, a1, a2, a3, a4, a5, a6, a7)
                for c in gl.static_range(NL):
                    _kt_store(accs[c], c, inv_o, r_out, c_out, b64, nsplit, p_row, partial_cap, out_ptr, po_ptr, ROWS,
                              RANK, OUT_L)
                store_keys_lse(lse2, r, b64, nsplit, p_row, partial_cap, lse_ptr, plse_ptr, ROWS, SQ, H)

    @gluon.jit
    def _kt_store(a, c: gl.constexpr, inv_o, r_out, c_out, b64, nsplit, p_row, partial_cap, out_ptr, po_ptr, ROWS,
                  RANK: gl.constexpr, OUT_L: gl.constexpr):
        # latent chunk c's acc^T [CH, R] (wgmma layout) into OUT_L, then stored (store_keys_part)
        store_keys_part(gl.convert_layout(a, OUT_L), c * a.shape[0], inv_o, r_out, c_out, b64, nsplit, p_row,
                        partial_cap, out_ptr, po_ptr, ROWS, RANK)

    @gluon.jit(do_not_specialize=UNSPECIALIZED_DECODE_INTEGERS)
    def _decode_kt_kernel(k_desc, q_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr,
                          lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H, PAGE: gl.constexpr,
                          RANK: gl.constexpr, ROPE: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                          NS: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                          PDL: gl.constexpr):
        gl.static_assert(BLOCK_N == 16 * gl.num_warps())
        CH: gl.constexpr = k_desc.block_shape[1]
        gl.static_assert(RANK == 8 * CH)
        gl.static_assert(ROPE == CH)
        wait_prior_grid(PDL)  # before any read of the plan (kernels/hopper/pdl.py)
        KT: gl.constexpr = q_ptr.dtype.element_ty
        NC: gl.constexpr = RANK // CH + 1
        QLAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, RANK], KT)
        QROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, ROPE], KT)
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_R], KT)
        k_s = gl.allocate_shared_memory(KT, [NS * NC, BLOCK_N, CH], k_desc.layout)
        q_lat_s = gl.allocate_shared_memory(KT, [BLOCK_R, RANK], QLAT_SH)
        q_rope_s = gl.allocate_shared_memory(KT, [BLOCK_R, ROPE], QROPE_SH)
        p_s = gl.allocate_shared_memory(KT, [BLOCK_N, BLOCK_R], P_SH)
        ready, empty = ring_barriers(NS)
        gl.warp_specialize([
            (_kt_consumer, (q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                            plse_ptr, partial_cap, qk_scale, SQ, H, k_s, q_lat_s, q_rope_s, p_s, ready, empty, RANK,
                            ROPE, BLOCK_R, BLOCK_N, NS)),
            (_kt_producer, (k_desc, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride, k_s, ready, empty, PAGE,
                            NC, BLOCK_N, NS, PDL)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


def kt_descriptors_available() -> bool:
    """Whether this Triton has the Gluon kernel and its host-side TMA descriptors."""
    return gluon is not None and TensorDescriptor is not None


def kt_descriptor(kv_cache, *, d_qk: int, block_n: int):
    """The TMA descriptor over a 16-bit cache (``[num_blocks, page, 1, d_qk]``, contiguous) seen as
    ``[rows, d_qk]`` (``rows = num_blocks * page``): boxes of ``[min(page, block_n), KT_CHUNK]``
    (a page's keys, 128 bytes of each row), 128-byte swizzle -- the layout the dots read."""
    nb, page = kv_cache.shape[0], kv_cache.shape[1]
    flat = kv_cache.view(nb * page, d_qk)
    layout = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    return TensorDescriptor(flat, shape=[nb * page, d_qk], strides=[d_qk, 1],
                            block_shape=[min(page, block_n), KT_CHUNK], layout=layout)


def launch_decode_wgmma_kt(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                           split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale_log2: float,
                           rank: int, rope_dim: int, fp8_group: int, block_m: int, block_n: int) -> None:
    """Launch this kernel (arguments as ``decode_split.launch_decode_split``; ``routes.resolve`` has admitted
    the launch). Shapes: q ``[B, s_q, h, rank + rope]``
    of the cache's dtype (``ceil(s_q * h / block_m)`` row blocks of 16 or 32); kv_cache bf16 / fp16
    ``[num_blocks, page, 1, rank + rope]``; block_n 64; the rest as the Triton launcher."""
    num_parts = part_info.shape[0] - 1
    pdl = pdl_on(q)
    desc = kt_descriptor(kv_cache, d_qk=rank + rope_dim, block_n=block_n)
    m_blocks = -(-q.shape[1] * q.shape[2] // block_m)
    _decode_kt_kernel[(num_parts, m_blocks)](
        desc, q, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, block_table.shape[1], partial_o.shape[0], softmax_scale_log2,
        q.shape[1], q.shape[2], PAGE=kv_cache.shape[1], RANK=rank, ROPE=rope_dim, BLOCK_R=block_m, BLOCK_N=block_n,
        NS=KT_STAGES, PRODUCER_WARPS=KT_PRODUCER_WARPS, PRODUCER_REGS=KT_PRODUCER_REGS, PDL=pdl,
        num_warps=KT_WARPS, maxnreg=KT_MAXNREG, launch_pdl=pdl)
