"""Hopper FP8 split-KV decode in 16-row blocks with each key tile's codes converted in registers:
TMA copies of the raw cache rows, wgmma with its A operand in registers (Gluon, GPU only).

Contract, plan and stores of the Triton decode (``kernels/decode_split.py``), grid ``(num_parts,
m_blocks)``: program ``(p, mb)`` runs rows ``16 mb + [0, 16)`` of every request of part ``p``.
Shapes: rank 512 + rope 64, FP8 cache of 128-value groups, bf16 queries, 64-key tiles, 4
consumer warps. The Triton kernel's grouped path with the keys on the wgmma M axis: codes
converted to fp16 exactly, the group scales on the four group dots' results, q scaled per row by
a power of two into fp16's range (``qs``), ``P^T * scale_g * 2**8`` in fp16::

    S^T   [64, R]   = sum_g scale_g * (K_g [64, 128] @ Q_g^T [128, R]) / qs_g + K_rope Q_rope^T
    acc^T [512, R] += per group g: K_g^T [128, 64] @ (P^T * scale_g * 2**8) [64, R]

No dequantised tile goes through shared memory:

- a one-warp *producer* issues TMA copies of each tile's raw rows -- codes as four ``[64, 32]``
  int32 boxes (one a scale group, 128-byte swizzle), the fp32 scales, the bf16 rope (41 KiB) --
  into a ring of ``RS_STAGES`` stages, one box a page when a page holds fewer than 64 keys; it
  reads each tile's page a tile ahead (``gluon_parts.tma_tile_walk``);
- two *consumer* warpgroups split the scale groups (0-1 and the rope dot; 2-3). Each reads its
  groups' codes from shared memory straight into wgmma's register operand layout and converts
  them there (``cvt.rn.f16x2.e4m3x2``). ``S^T``'s group dot takes ``K_g`` as A: the dot's k order
  is free (q's columns are stored permuted alike), so logical column ``16s + 8h + 2c + j`` is
  byte ``32c + 4s + 2h + j`` of the group and a thread reads 32 contiguous bytes of each of its
  two rows (``_k_operand``). The PV dot takes ``K_g^T``: its row order is free too (undone before
  the stores as a relabelling, ``_unpermute``), so logical row ``64 i1 + 16 w + 8 i0 + r`` is
  latent column ``32 w + 4 r + 2 i1 + i0``, and a thread pairs the bytes of keys ``2p`` and
  ``2p + 1`` (``prmt``) before converting them (``_v_operand``).

The two halves of ``S^T`` meet through shared memory each tile (slots by tile parity, an
mbarrier each); both warpgroups run the same softmax on the same sum, so they agree on P without
another hand-over, and each keeps and stores the accumulator of its own groups. TMA copies
whatever the slots hold, so keys past ``seq_len`` are masked in registers: their scores by the
softmax, their codes (zero words) and scales (zero) before the PV dot.

Per tile the shared pipe sees the TMA writes (41 KiB), the code reads (32 KiB as ``K``, 32 as
``K^T``), the rope dot's 8 KiB and q / P; ``decode_wgmma_ws``'s 64 KiB fp16 tile and its 128 KiB
of wgmma reads are gone. The two programs of a part (h=16 x 2 at small batches: two 16-row
blocks) read the same tiles at about the same time, the second mostly from L2.

The route table (``kernels/routes.py``) gives it FP8 up to 16 rows on Hopper, and h=16 x 2 at
batches up to ``routes.SPLIT_ROWS_MAX_BATCH``; a cache TMA cannot copy goes to
``decode_wgmma_ws`` (one block) or the Triton kernel. Measurements:
``docs/kernel-performance.md``.
"""
from __future__ import annotations

import torch

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except Exception:  # pragma: no cover - a Triton without Gluon: the Triton kernel only
    gluon = None
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except Exception:  # pragma: no cover - a Gluon without host-side TMA descriptors: decode_wgmma_ws
    TensorDescriptor = None

from .gluon_parts import (copy_q_rope_now, part_bounds, request_span, ring_barriers, row_copy_layout,
                          softmax_keys_step, softmax_result, store_keys_lse, store_keys_part, tma_tile_walk,
                          wait_prior_grid, wgmma_layout)
from .pdl import pdl_on
from ..config import UNSPECIALIZED_DECODE_INTEGERS

__all__ = ["launch_decode_wgmma_rs", "rs_descriptors", "rs_descriptors_available", "RS_STAGES"]

#: warps of each consumer warpgroup (the first is the launch's ``num_warps``, the default partition)
RS_WARPS = 4
#: stages of the TMA ring (41 KiB each): 3 ran 1.00-1.05x 4 (``h100-2026-11-27-wgmma-rs-ab.json``)
RS_STAGES = 3
#: warps and registers of the producer partition (it only issues TMA copies)
RS_PRODUCER_WARPS = 1
RS_PRODUCER_REGS = 40
#: registers of the second consumer warpgroup (a worker partition)
RS_CONSUMER_REGS = 232
#: the kernel's register cap: 12 warps (the one-warp producer takes a warpgroup's) x 32 threads x this <= 64K
RS_MAXNREG = 168

if gluon is not None:
    from .gluon_parts import E4M3X4_TO_F16_ASM as _CVT_ASM  # a word's four e4m3 bytes -> fp16, byte i as output $i

    # e4m3 bytes of keys 2p (word $8) and 2p + 1 (word $9) -> fp16, byte i of both as outputs
    # $(2i) (key 2p) and $(2i + 1) (key 2p + 1)
    _PAIR_CVT_ASM = gl.constexpr("""
    {
    .reg .b32 t01, t23, d0, d1, d2, d3;
    .reg .b16 a0, a1, a2, a3;
    prmt.b32 t01, $8, $9, 0x5140;
    prmt.b32 t23, $8, $9, 0x7362;
    mov.b32 {a0, a1}, t01;
    mov.b32 {a2, a3}, t23;
    cvt.rn.f16x2.e4m3x2 d0, a0;
    cvt.rn.f16x2.e4m3x2 d1, a1;
    cvt.rn.f16x2.e4m3x2 d2, a2;
    cvt.rn.f16x2.e4m3x2 d3, a3;
    mov.b32 {$0, $1}, d0;
    mov.b32 {$2, $3}, d1;
    mov.b32 {$4, $5}, d2;
    mov.b32 {$6, $7}, d3;
    }
    """)
    @gluon.constexpr_function
    def _k_words_layout():
        # [64 keys, 32 words] of a group: warp w keys 16w + {q, q + 8} (q = lane // 4), lane % 4 =
        # c the words 8c .. 8c + 7 (registers)
        return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [0, 4], [8, 0]],
                                          lane_bases=[[0, 8], [0, 16], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 32])

    @gluon.constexpr_function
    def _v_words_layout():
        # [64 keys, 32 words] of a group: keys {2c, 2c + 1, 2c + 8, 2c + 9} + 16 s (c = lane % 4;
        # registers: +1, +8, +16, +32), word 8 w + r (r = lane // 4, w the warp)
        return gl.DistributedLinearLayout(reg_bases=[[1, 0], [8, 0], [16, 0], [32, 0]],
                                          lane_bases=[[2, 0], [4, 0], [0, 1], [0, 2], [0, 4]],
                                          warp_bases=[[0, 8], [0, 16]], block_bases=[], shape=[64, 32])

    @gluon.constexpr_function
    def _scales_layout():
        # [64 keys, 4 groups]: each key where the scores' row slice holds it (warp w keys 16 w +
        # {q, q + 8}, the four lanes of a q alike), its four scales in registers
        return gl.DistributedLinearLayout(reg_bases=[[0, 1], [0, 2], [8, 0]],
                                          lane_bases=[[0, 0], [0, 0], [1, 0], [2, 0], [4, 0]],
                                          warp_bases=[[16, 0], [32, 0]], block_bases=[], shape=[64, 4])

    @gluon.jit
    def _k_operand(words, A_L: gl.constexpr):
        # A group's codes [64 keys, 32 words] (_k_words_layout) -> fp16 [64, 128] in wgmma's A
        # operand layout, logical column 16s + 8h + 2c + j = byte 32c + 4s + 2h + j
        b0, b1, b2, b3 = gl.inline_asm_elementwise(_CVT_ASM, "=h,=h,=h,=h,r", [words],
                                                   dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                                   is_pure=True, pack=1)
        v = gl.join(gl.join(b0, b1), gl.join(b2, b3))  # [key, 8c + s, j, h]
        v = gl.reshape(v, [64, 4, 8, 2, 2])  # [key, c, s, j, h]
        v = gl.permute(v, (0, 2, 4, 1, 3))  # [key, s, h, c, j]
        v = gl.reshape(v, [64, 128])
        return gl.convert_layout(v, A_L, assert_trivial=True)

    @gluon.jit
    def _v_operand(words, A_L: gl.constexpr):
        # A group's codes [64 keys, 32 words] (_v_words_layout) -> fp16 [128, 64] in wgmma's A
        # operand layout: K_g^T with logical row 64 i1 + 16 w + 8 i0 + r = column 32 w + 4 r + 2 i1 + i0
        w2 = gl.permute(gl.reshape(words, [32, 2, 32]), (0, 2, 1))  # [p, u, j]: key 2p + j, word u
        w0, w1 = gl.split(w2)
        o00, o01, o10, o11, o20, o21, o30, o31 = gl.inline_asm_elementwise(
            _PAIR_CVT_ASM, "=h,=h,=h,=h,=h,=h,=h,=h,r,r", [w0, w1],
            dtype=(gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16, gl.float16),
            is_pure=True, pack=1)
        v = gl.join(gl.join(gl.join(o00, o01), gl.join(o10, o11)),
                    gl.join(gl.join(o20, o21), gl.join(o30, o31)))  # [p, u, j, i0, i1]
        v = gl.reshape(v, [32, 4, 8, 2, 2, 2])  # [p, w, r, j, i0, i1]
        v = gl.permute(v, (5, 1, 4, 2, 0, 3))  # [i1, w, i0, r, p, j]
        v = gl.reshape(v, [128, 64])
        return gl.convert_layout(v, A_L, assert_trivial=True)

    @gluon.constexpr_function
    def _out_layout(rows):
        # acc^T [128 latent columns, rows (16 or 32)] of a group in column order (_unpermute): a
        # thread's four registers of a row are four adjacent columns, eight lanes 32 of them
        regs = [[1, 0], [2, 0], [0, 1], [0, 8]] + ([[0, 16]] if rows == 32 else [])
        return gl.DistributedLinearLayout(reg_bases=regs, lane_bases=[[0, 2], [0, 4], [4, 0], [8, 0], [16, 0]],
                                          warp_bases=[[32, 0], [64, 0]], block_bases=[], shape=[128, rows])

    @gluon.jit
    def _unpermute(a, OUT_L: gl.constexpr):
        # A group's accumulator acc^T [128, R] (row m = latent column 32 w + 4 r + 2 i1 + i0 with
        # m = 64 i1 + 16 w + 8 i0 + r; _v_operand) relabelled in column order: no data moves
        v = gl.reshape(a, [2, 4, 2, 8, a.shape[1]])  # [i1, w, i0, r, row]
        v = gl.permute(v, (1, 3, 0, 2, 4))  # [w, r, i1, i0, row]
        return gl.convert_layout(gl.reshape(v, [a.shape[0], a.shape[1]]), OUT_L, assert_trivial=True)

    @gluon.jit
    def _rs_copy_boxes(descs, bufs, row, bar, s, r0, NS: gl.constexpr):
        # one box of a tile (tma_tile_walk): cache rows [row, row + SUB) into rows [r0, r0 + SUB) of
        # stage s -- the codes as NG int32 boxes (a scale group each), the fp32 scales, the bf16 rope
        codes_desc, scales_desc, rope_desc = descs
        codes_s, sc_s, rope_s = bufs
        SUB: gl.constexpr = codes_desc.block_shape[0]
        GW: gl.constexpr = codes_desc.block_shape[1]
        NG: gl.constexpr = sc_s.shape[2]
        for g in gl.static_range(NG):
            tma.async_copy_global_to_shared(codes_desc, [row, g * GW], bar, codes_s.index(s * NG + g).slice(r0, SUB))
        tma.async_copy_global_to_shared(scales_desc, [row, NG * GW], bar, sc_s.index(s).slice(r0, SUB))
        tma.async_copy_global_to_shared(rope_desc, [row, (4 * NG * GW + 4 * NG) // 2], bar,
                                        rope_s.index(s).slice(r0, SUB))

    @gluon.jit
    def _rs_producer(codes_desc, scales_desc, rope_desc, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride,
                     codes_s, sc_s, rope_s, ready, empty, PAGE: gl.constexpr, RANK: gl.constexpr,
                     GROUP: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr, PDL: gl.constexpr):
        wait_prior_grid(PDL)  # this partition's warps too (kernels/hopper/pdl.py)
        NG: gl.constexpr = RANK // GROUP
        TILE_BYTES: gl.constexpr = BLOCK_N * (RANK + 4 * NG) + rope_s.shape[1] * rope_s.shape[2] * 2
        # (a box past the request's keys copies page 0's rows, never read unmasked)
        tma_tile_walk(_rs_copy_boxes, (codes_desc, scales_desc, rope_desc), (codes_s, sc_s, rope_s), bt_ptr, seq_ptr,
                      part_ptr, nsplit_ptr, off_ptr, bt_stride, ready, empty, TILE_BYTES, codes_desc.block_shape[0],
                      PAGE, BLOCK_N, NS)

    @gluon.jit
    def _rs_consumer(q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                     plse_ptr, partial_cap, qk_scale, SQ, H, codes_s, sc_s, rope_s, q_lat_s, q_rope_s, p_s, sx_s,
                     ready, empty, xready, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                     BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr, WG: gl.constexpr):
        # Consumer warpgroup WG (0 or 1) of two: scale groups 2 WG and 2 WG + 1 of every tile (WG 0
        # the rope dot too); the two halves of S^T meet through sx_s, each warpgroup runs the same
        # softmax on their sum and keeps the accumulator of its own groups
        W: gl.constexpr = 4
        KT: gl.constexpr = gl.float16
        D: gl.constexpr = RANK + ROPE
        NG: gl.constexpr = RANK // GROUP
        GA: gl.constexpr = 2 * WG
        GB: gl.constexpr = 2 * WG + 1
        PV_SCALE: gl.constexpr = 256.0
        MMA_L: gl.constexpr = wgmma_layout([W, 1], BLOCK_R)
        A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA_L, k_width=2)
        KEY_L: gl.constexpr = gl.SliceLayout(1, MMA_L)
        ROW_L: gl.constexpr = gl.SliceLayout(0, MMA_L)
        KW_L: gl.constexpr = _k_words_layout()
        VW_L: gl.constexpr = _v_words_layout()
        SC_L: gl.constexpr = _scales_layout()
        Q_L: gl.constexpr = row_copy_layout(8, 32, W)
        ROPE_L: gl.constexpr = row_copy_layout(8, 8, W)

        pid_p = gl.program_id(0)
        ROWS = SQ * H
        b_first, t_first, j_first, b_end, t_end, b_last = part_bounds(part_ptr, pid_p)
        ctx_w = gl.load(ctxw_ptr)
        # row block program_id(1): rows row0 + [0, BLOCK_R) of every request
        row0 = gl.program_id(1) * BLOCK_R
        r_lat = row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, Q_L))
        r_rope = row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ROPE_L))
        # this warpgroup's two groups of q's latent; the dots' column k is the cache's column
        # 32 c + 4 s + 2 h + j of the group (k = 16 s + 8 h + 2 c + j; _k_operand)
        k_lat = gl.arange(0, 2 * GROUP, layout=gl.SliceLayout(0, Q_L))
        kk = k_lat % GROUP
        c_lat = (GA * GROUP + (k_lat // GROUP) * GROUP + ((kk // 2) % 4) * 32 + (kk // 16) * 4 + ((kk // 8) % 2) * 2
                 + kk % 2)
        c_rope = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        r = row0 + gl.arange(0, BLOCK_R, layout=ROW_L)
        OUT_L: gl.constexpr = _out_layout(BLOCK_R)
        c_out = gl.arange(0, GROUP, layout=gl.SliceLayout(1, OUT_L))
        r_out = row0 + gl.arange(0, BLOCK_R, layout=gl.SliceLayout(0, OUT_L))
        n = gl.arange(0, BLOCK_N, layout=KEY_L)
        n_v = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, VW_L))
        row_ok = r < ROWS
        tok = r // H
        qa_s = q_lat_s.index(WG).slice(0, GROUP, dim=1)
        qb_s = q_lat_s.index(WG).slice(GROUP, GROUP, dim=1)
        it = 0
        for b in range(b_first, b_last + 1):
            b64 = b.to(gl.int64)
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            if t1 > t0:
                ctx = gl.load(ctx_ptr + b64 * ctx_w + tok, mask=row_ok & (tok < ctx_w), other=0)
                # every warp of this warpgroup is done with q of the previous request
                gl.thread_barrier()
                q_row = q_ptr + b64 * (ROWS * D)
                # this warpgroup's half of q's latent to fp16, permuted, each row times a power of
                # two qs = 2**k, k <= 0, that brings its max |q| under 2**15
                # (gluon_parts.q_rows_to_fp16's rule, over the half)
                # (kept in bf16 until scaled: the exponent is that of the fp32 value)
                q = gl.load(q_row + r_lat.to(gl.int64)[:, None] * D + c_lat[None, :],
                            mask=(r_lat < ROWS)[:, None] & (c_lat[None, :] < RANK), other=0.0)
                bits = gl.max((q.to(gl.int16, bitcast=True) & 0x7FFF).to(gl.int32), axis=1)
                qs = gl.exp2(gl.minimum(0, 14 - ((bits >> 7) - 127)).to(gl.float32))
                q_lat_s.index(WG).store((q.to(gl.float32) * qs[:, None]).to(KT))
                inv_qs = gl.convert_layout(1.0 / qs, ROW_L)
                if WG == 0:
                    copy_q_rope_now(q_rope_s, q_row, r_rope, c_rope, ROWS, RANK)
                else:
                    fence_async_shared()
                    gl.thread_barrier()

                m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, ROW_L)
                l_p = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                aa = gl.full([GROUP, BLOCK_R], 0.0, gl.float32, MMA_L)
                ab = gl.full([GROUP, BLOCK_R], 0.0, gl.float32, MMA_L)
                for tile in range(t0, t1):
                    s = it % NS
                    mbarrier.wait(ready.index(s), (it // NS) & 1)
                    z = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                    if WG == 0:
                        sr = warpgroup_mma(rope_s.index(s), q_rope_s.permute((1, 0)), z, use_acc=False,
                                           is_async=True)
                    kaa = _k_operand(codes_s.index(s * NG + GA).load(KW_L), A_L)
                    ga = warpgroup_mma(kaa, qa_s.permute((1, 0)), z, use_acc=False, is_async=True)
                    if BLOCK_R > 16:
                        # 32 rows: one group's operand in registers at a time
                        ga = warpgroup_mma_wait(num_outstanding=0, deps=(ga, kaa))[0]
                    kab = _k_operand(codes_s.index(s * NG + GB).load(KW_L), A_L)
                    gb = warpgroup_mma(kab, qb_s.permute((1, 0)), z, use_acc=False, is_async=True)
                    # the group scales of keys past seq_len are 0 (a stale slot's may be NaN)
                    ok = tile * BLOCK_N + n < seq_len
                    s4 = gl.permute(gl.reshape(sc_s.index(s).load(SC_L), [BLOCK_N, 2, 2]), (0, 2, 1))
                    s_lo, s_hi = gl.split(s4)
                    if WG == 0:
                        ka, kb = gl.split(s_lo)
                    else:
                        ka, kb = gl.split(s_hi)
                    ka = gl.where(ok, gl.convert_layout(ka, KEY_L, assert_trivial=True), 0.0)
                    kb = gl.where(ok, gl.convert_layout(kb, KEY_L, assert_trivial=True), 0.0)
                    if WG == 0:
                        sr, ga, gb = warpgroup_mma_wait(num_outstanding=0, deps=(sr, ga, gb, kaa, kab))[:3]
                        part = (ga * ka[:, None] + gb * kb[:, None]) * inv_qs[None, :] + sr
                    else:
                        ga, gb = warpgroup_mma_wait(num_outstanding=0, deps=(ga, gb, kaa, kab))[:2]
                        part = (ga * ka[:, None] + gb * kb[:, None]) * inv_qs[None, :]
                    # hand this half of S^T to the other warpgroup (slots by tile parity: a slot
                    # is rewritten two tiles on, after the other has read it) and take its half
                    x = it % 2
                    sx_s.index(2 * x + WG).store(part)
                    gl.thread_barrier()
                    mbarrier.arrive(xready.index(2 * x + WG))
                    mbarrier.wait(xready.index(2 * x + 1 - WG), (it // 2) & 1)
                    other = sx_s.index(2 * x + 1 - WG).load(MMA_L)
                    if WG == 0:
                        sc = (part + other) * qk_scale
                    else:
                        sc = (other + part) * qk_scale
                    p, alpha, m_i, l_p = softmax_keys_step(sc, m_i, l_p, ctx, tile * BLOCK_N + n, seq_len)
                    aa = aa * alpha[None, :]
                    ab = ab * alpha[None, :]
                    p_s.index(GA).store((p * (ka * PV_SCALE)[:, None]).to(KT))
                    p_s.index(GB).store((p * (kb * PV_SCALE)[:, None]).to(KT))
                    fence_async_shared()
                    gl.thread_barrier()
                    ok_v = (tile * BLOCK_N + n_v < seq_len)[:, None]
                    vaa = _v_operand(gl.where(ok_v, codes_s.index(s * NG + GA).load(VW_L), 0), A_L)
                    aa = warpgroup_mma(vaa, p_s.index(GA), aa, is_async=True)
                    if BLOCK_R > 16:
                        aa = warpgroup_mma_wait(num_outstanding=0, deps=(aa, vaa))[0]
                    vab = _v_operand(gl.where(ok_v, codes_s.index(s * NG + GB).load(VW_L), 0), A_L)
                    ab = warpgroup_mma(vab, p_s.index(GB), ab, is_async=True)
                    aa, ab = warpgroup_mma_wait(num_outstanding=0, deps=(aa, ab, vaa, vab))[:2]
                    # every warp of this warpgroup is done reading stage s (and P) before its arrival
                    gl.thread_barrier()
                    mbarrier.arrive(empty.index(s))
                    it += 1

                l_safe, lse2 = softmax_result(m_i, gl.sum(l_p, axis=0))
                inv_l = 1.0 / (l_safe * PV_SCALE)
                inv_o = gl.convert_layout(inv_l, gl.SliceLayout(0, OUT_L), assert_trivial=True)
                store_keys_part(_unpermute(aa, OUT_L), GA * GROUP, inv_o, r_out, c_out, b64, nsplit, p_row, partial_cap,
                                out_ptr, po_ptr, ROWS, RANK)
                store_keys_part(_unpermute(ab, OUT_L), GB * GROUP, inv_o, r_out, c_out, b64, nsplit, p_row, partial_cap,
                                out_ptr, po_ptr, ROWS, RANK)
                if WG == 0:
                    store_keys_lse(lse2, r, b64, nsplit, p_row, partial_cap, lse_ptr, plse_ptr, ROWS, SQ, H)

    @gluon.jit(do_not_specialize=UNSPECIALIZED_DECODE_INTEGERS)
    def _decode_rs_kernel(codes_desc, scales_desc, rope_desc, q_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr,
                          nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale,
                          SQ, H, PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                          BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr, NS: gl.constexpr,
                          CONSUMER_REGS: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                          PDL: gl.constexpr):
        gl.static_assert(BLOCK_N == 16 * gl.num_warps())
        gl.static_assert(RANK // GROUP == 4)
        wait_prior_grid(PDL)  # before any read of the plan (kernels/hopper/pdl.py)
        QT: gl.constexpr = q_ptr.dtype.element_ty
        KT: gl.constexpr = gl.float16
        NG: gl.constexpr = RANK // GROUP
        QLAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, 2 * GROUP], KT)
        QROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, ROPE], QT)
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_R], KT)
        SX_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        codes_s = gl.allocate_shared_memory(gl.int32, [NS * NG, BLOCK_N, GROUP // 4], codes_desc.layout)
        sc_s = gl.allocate_shared_memory(gl.float32, [NS, BLOCK_N, NG], scales_desc.layout)
        rope_s = gl.allocate_shared_memory(QT, [NS, BLOCK_N, ROPE], rope_desc.layout)
        q_lat_s = gl.allocate_shared_memory(KT, [2, BLOCK_R, 2 * GROUP], QLAT_SH)
        q_rope_s = gl.allocate_shared_memory(QT, [BLOCK_R, ROPE], QROPE_SH)
        p_s = gl.allocate_shared_memory(KT, [NG, BLOCK_N, BLOCK_R], P_SH)
        sx_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_N, BLOCK_R], SX_SH)
        ready, empty = ring_barriers(NS, 2)  # a stage is freed by both consumer warpgroups
        xready = gl.allocate_shared_memory(gl.int64, [4, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(4):
            mbarrier.init(xready.index(i), count=1)
        gl.warp_specialize([
            (_rs_consumer, (q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                            plse_ptr, partial_cap, qk_scale, SQ, H, codes_s, sc_s, rope_s, q_lat_s, q_rope_s, p_s,
                            sx_s, ready, empty, xready, RANK, ROPE, GROUP, BLOCK_R, BLOCK_N, NS, 0)),
            (_rs_consumer, (q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                            plse_ptr, partial_cap, qk_scale, SQ, H, codes_s, sc_s, rope_s, q_lat_s, q_rope_s, p_s,
                            sx_s, ready, empty, xready, RANK, ROPE, GROUP, BLOCK_R, BLOCK_N, NS, 1)),
            (_rs_producer, (codes_desc, scales_desc, rope_desc, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr,
                            bt_stride, codes_s, sc_s, rope_s, ready, empty, PAGE, RANK, GROUP, BLOCK_N, NS, PDL)),
        ], [4, PRODUCER_WARPS], [CONSUMER_REGS, PRODUCER_REGS])


def rs_descriptors_available() -> bool:
    """Whether this Triton has the Gluon kernel and its host-side TMA descriptors."""
    return gluon is not None and TensorDescriptor is not None


def rs_descriptors(kv_cache, *, rank: int, rope_dim: int, fp8_group: int, block_n: int) -> tuple:
    """The three TMA descriptors over the cache (uint8 ``[num_blocks, page, token bytes]``, token =
    codes | fp32 scales | bf16 rope) seen as ``[rows, token]`` rows (``rows = num_blocks * page``):
    int32 words of the codes (boxes ``[block_n, group / 4]``, a scale group, 128-byte swizzle),
    fp32 scales (box ``[block_n, groups]``) and bf16 rope (box ``[block_n, rope_dim]``, the
    layout its wgmma reads)."""
    nb, page, token = kv_cache.shape
    rows = nb * page
    ng = rank // fp8_group
    sub = min(page, block_n)
    flat = kv_cache.view(rows, token)
    words = flat.view(torch.int32)
    code_l = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=32, rank=2)
    sc_l = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)
    rope_l = gl.NVMMASharedLayout.get_default_for([block_n, rope_dim], gl.bfloat16)
    codes = TensorDescriptor(words, shape=[rows, token // 4], strides=[token // 4, 1],
                             block_shape=[sub, fp8_group // 4], layout=code_l)
    scales = TensorDescriptor(flat.view(torch.float32), shape=[rows, token // 4], strides=[token // 4, 1],
                              block_shape=[sub, ng], layout=sc_l)
    rope = TensorDescriptor(flat.view(torch.bfloat16), shape=[rows, token // 2], strides=[token // 2, 1],
                            block_shape=[sub, rope_dim], layout=rope_l)
    return codes, scales, rope


def launch_decode_wgmma_rs(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                           split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale_log2: float,
                           rank: int, rope_dim: int, fp8_group: int, block_m: int, block_n: int) -> None:
    """Launch this kernel (arguments as ``decode_split.launch_decode_split``). Shapes: q ``[B, s_q,
    h, rank + rope]`` bf16 (``ceil(s_q * h / block_m)`` row blocks of 16); kv_cache uint8
    ``[num_blocks, page, rank + 4 * groups + 2 * rope]``, 16-byte aligned, ``page`` a multiple of
    ``block_n`` (64); the rest as the Triton launcher."""
    num_parts = part_info.shape[0] - 1
    pdl = pdl_on(q)
    codes, scales, rope = rs_descriptors(kv_cache, rank=rank, rope_dim=rope_dim, fp8_group=fp8_group,
                                         block_n=block_n)
    m_blocks = -(-q.shape[1] * q.shape[2] // block_m)
    _decode_rs_kernel[(num_parts, m_blocks)](
        codes, scales, rope, q, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, block_table.shape[1], partial_o.shape[0], softmax_scale_log2,
        q.shape[1], q.shape[2], PAGE=kv_cache.shape[1], RANK=rank, ROPE=rope_dim, GROUP=fp8_group,
        BLOCK_R=block_m, BLOCK_N=block_n, NS=RS_STAGES, CONSUMER_REGS=RS_CONSUMER_REGS, PRODUCER_WARPS=RS_PRODUCER_WARPS,
        PRODUCER_REGS=RS_PRODUCER_REGS, PDL=pdl, num_warps=RS_WARPS, maxnreg=RS_MAXNREG, launch_pdl=pdl)
