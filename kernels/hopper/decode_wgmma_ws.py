"""Hopper FP8 split-KV decode for up to 16 query rows, warp-specialised: a producer partition
converts the next key tile while a consumer warpgroup runs this one's dots (Gluon, GPU only).

Contract, plan and stores of the Triton decode (``kernels/decode_split.py``), grid ``(num_parts,
1)``: one 16-row block holds every query row of a request (h=16 at s_q=1). Shapes: rank 512 +
rope 64, FP8 cache of 128-value groups, bf16 queries, 64-key tiles. The math of
``decode_wgmma_rs`` (keys on the wgmma M axis, codes converted to fp16 exactly, the group
scales on the four group dots' results, q scaled per row by a power of two into fp16's range,
``P^T * scale_g * 2**8`` in fp16)::

    S^T   [64, R]   = sum_g scale_g * (K_g [64, 128] @ Q_g^T [128, R]) / qs + K_rope Q_rope^T
    acc^T [512, R] += per group g: K_g^T [128, 64] @ (P^T * scale_g * 2**8) [64, R]

Two partitions (``gl.warp_specialize``) hand 64-key tiles over through two shared buffers and
an mbarrier pair a buffer (ready / empty):

- the *producer* (``WS_PRODUCER_WARPS`` warps, ``WS_PRODUCER_REGS`` registers a thread) walks
  the same requests and tiles as the consumer, software-pipelined by one tile: a trip issues the
  loads of tile ``it`` (codes as int32 words, scales, rope; into registers; its pages looked up a
  trip earlier) and then writes tile ``it - 1`` into its buffer once the consumer has freed it --
  codes as fp16, scales, rope -- and marks it ready. Keys past ``seq_len`` load zeros, so a
  NaN-poisoned stale slot never reaches a dot.
- the *consumer* (4 warps: one warpgroup, wgmma's M = 64 keys) loads q once a request, then per
  tile waits for a ready buffer, runs QK, the softmax and PV, and marks the buffer empty.

Shared memory: two buffers of a 64-key tile (fp16 codes 64 KiB, rope 8 KiB, scales 1 KiB each),
q 18 KiB, P^T 8 KiB: 172 KiB. Registers: 12 warps at most 168 a thread; the consumer gets 248.

The route table (``kernels/routes.py``) runs it where it would run ``decode_wgmma_rs`` but TMA
cannot copy the cache (``routes.KERNELS``: pages neither a multiple nor a divisor of 64 keys, a
misaligned or non-contiguous cache). Measurements: ``docs/kernel-performance.md``.
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except Exception:  # pragma: no cover - a Triton without Gluon: the Triton kernel only
    gluon = None

from .gluon_parts import (copy_q_rope_now, part_bounds, q_rows_to_fp16, request_span, ring_barriers,
                          row_copy_layout, softmax_keys_step, softmax_result, store_keys_result, wait_prior_grid,
                          wgmma_layout)
from .pdl import pdl_on
from ..config import UNSPECIALIZED_DECODE_INTEGERS

__all__ = ["launch_decode_wgmma_ws", "WS_BLOCK_N", "WS_WARPS"]

#: Keys a tile (one warpgroup x wgmma's 64 rows)
WS_BLOCK_N = 64
#: warps of the consumer (the launch's ``num_warps``; the producer adds WS_PRODUCER_WARPS)
WS_WARPS = 4
#: tile buffers handed between the two partitions
WS_BUFS = 2
#: warps of the producer partition
WS_PRODUCER_WARPS = 8
#: registers a producer thread gets (the consumer gets the rest of the register file)
WS_PRODUCER_REGS = 128
#: the kernel's register cap: (WS_WARPS + WS_PRODUCER_WARPS) warps x 32 threads x this <= 64K
WS_MAXNREG = 168

if gluon is not None:
    from .gluon_parts import E4M3X4_TO_F16_ASM as _CVT_ASM

    @gluon.jit
    def _load_codes(kv_ptr, page, tile, seq_len, g: gl.constexpr, PAGE: gl.constexpr, RANK: gl.constexpr,
                    GROUP: gl.constexpr, TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr, WORD_L: gl.constexpr):
        # One scale group of the tile's keys, in registers: the codes as int32 words [BLOCK_N,
        # GROUP // 4] (four codes a word, a word a register -- 8-bit values would take one
        # each) and the scales [BLOCK_N] fp32. Keys past seq_len load zeros (no memory read).
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, WORD_L))
        ok = offs_n < seq_len
        row = kv_ptr + (page.to(gl.int64) * PAGE + offs_n % PAGE) * TOKEN_STRIDE
        words = (g * GROUP) // 4 + gl.arange(0, GROUP // 4, layout=gl.SliceLayout(0, WORD_L))
        codes = gl.load(row.to(gl.pointer_type(gl.int32))[:, None] + words[None, :],
                        mask=ok[:, None] & (words[None, :] < RANK // 4), other=0)
        sc = gl.load((row + RANK + 4 * g).to(gl.pointer_type(gl.float32)), mask=ok, other=0.0)
        return codes, sc

    @gluon.jit
    def _store_group(k_s, codes, GROUP: gl.constexpr):
        # The group's GROUP columns of the K tile: its codes as fp16, exactly. Word j holds
        # columns 4j .. 4j + 3: [j, a, b] of the joins is b_{2a+b}, column 4j + 2a + b.
        b0, b1, b2, b3 = gl.inline_asm_elementwise(_CVT_ASM, "=h,=h,=h,=h,r", [codes],
                                                   dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                                   is_pure=True, pack=1)
        vals = gl.join(gl.join(b0, b2), gl.join(b1, b3))
        k_s.store(gl.reshape(vals, [codes.shape[0], GROUP]))

    @gluon.jit
    def _pages(bt_row, tile, seq_len, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, L: gl.constexpr):
        # The cache page of each of the tile's keys ([BLOCK_N] int32 in the row slice of layout
        # L; 0 past seq_len): looked up a tile before the copies that use it, so that their
        # address arithmetic does not wait on the block table
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
        return gl.load(bt_row + offs_n // PAGE, mask=offs_n < seq_len, other=0)

    @gluon.jit
    def _load_rope(kv_ptr, page, tile, seq_len, PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr,
                   NG: gl.constexpr, TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr, ROPE_L: gl.constexpr):
        # The tile's bf16 rope [BLOCK_N, ROPE] into registers (token layout codes | scales | rope);
        # keys past seq_len load zeros
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
        ok = offs_n < seq_len
        at = kv_ptr + (page.to(gl.int64) * PAGE + offs_n % PAGE) * TOKEN_STRIDE + RANK + 4 * NG
        cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        return gl.load(at.to(gl.pointer_type(gl.bfloat16))[:, None] + cols[None, :],
                       mask=ok[:, None] & (cols[None, :] < ROPE), other=0.0)

    @gluon.jit
    def _ws_fill(k0_s, k1_s, k2_s, k3_s, rope_s, sc0_s, sc1_s, sc2_s, sc3_s, ready, empty, it, c0, c1, c2, c3, s0, s1,
                 s2, s3, rope, GROUP: gl.constexpr, NB: gl.constexpr):
        # Tile number ``it`` of the part (its codes c*, scales s* and rope in registers) into buffer
        # it % NB, once the consumer has freed it (its PV of tile it - NB is done), then marked ready
        s = it % NB
        mbarrier.wait(empty.index(s), ((it // NB) & 1) ^ 1)
        rope_s.index(s).store(rope)
        _store_group(k0_s.index(s), c0, GROUP)
        _store_group(k1_s.index(s), c1, GROUP)
        _store_group(k2_s.index(s), c2, GROUP)
        _store_group(k3_s.index(s), c3, GROUP)
        sc0_s.index(s).store(s0)
        sc1_s.index(s).store(s1)
        sc2_s.index(s).store(s2)
        sc3_s.index(s).store(s3)
        # the generic-proxy stores visible to the consumer's wgmma reads, from every producer
        # warp, before the (single) arrival
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(ready.index(s))

    @gluon.jit
    def _ws_producer(kv_ptr, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride, k0_s, k1_s, k2_s, k3_s,
                     rope_s, sc0_s, sc1_s, sc2_s, sc3_s, ready, empty, PAGE: gl.constexpr, RANK: gl.constexpr,
                     ROPE: gl.constexpr, GROUP: gl.constexpr, TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr,
                     NB: gl.constexpr, PDL: gl.constexpr):
        wait_prior_grid(PDL)  # this partition's warps too (kernels/hopper/pdl.py)
        # Software-pipelined by one tile: a trip issues the loads of tile ``it`` (codes and scales
        # into registers, rope too) and only then writes tile ``it - 1`` (loaded a trip earlier)
        # into its buffer, so a tile's loads are in flight while the previous one is converted
        # and while the producer waits for a free buffer; the first tile's pages of a request
        # are looked up on entry, each next tile's a trip ahead.
        W: gl.constexpr = gl.num_warps()
        NG: gl.constexpr = RANK // GROUP
        # a group's codes as int32 words, four a thread (one 16-byte load)
        DEQ_L: gl.constexpr = row_copy_layout(4, 8, W)
        ROPE_L: gl.constexpr = row_copy_layout(8, 8, W)
        pid_p = gl.program_id(0)
        b_first, t_first, j_first, b_end, t_end, b_last = part_bounds(part_ptr, pid_p)
        c0 = gl.zeros([BLOCK_N, GROUP // 4], gl.int32, DEQ_L)
        c1 = c0
        c2 = c0
        c3 = c0
        s0 = gl.zeros([BLOCK_N], gl.float32, gl.SliceLayout(1, DEQ_L))
        s1 = s0
        s2 = s0
        s3 = s0
        rope = gl.zeros([BLOCK_N, ROPE], gl.bfloat16, ROPE_L)
        it = 0
        for b in range(b_first, b_last + 1):
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            bt_row = bt_ptr + b.to(gl.int64) * bt_stride
            len0 = gl.where(t1 > t0, seq_len, 0)
            pg_d = _pages(bt_row, t0, len0, PAGE, BLOCK_N, DEQ_L)
            pg_r = _pages(bt_row, t0, len0, PAGE, BLOCK_N, ROPE_L)
            for tile in range(t0, t1):
                len1 = gl.where(tile + 1 < t1, seq_len, 0)
                nx_d = _pages(bt_row, tile + 1, len1, PAGE, BLOCK_N, DEQ_L)
                nx_r = _pages(bt_row, tile + 1, len1, PAGE, BLOCK_N, ROPE_L)
                n0, m0 = _load_codes(kv_ptr, pg_d, tile, seq_len, 0, PAGE, RANK, GROUP, TOKEN_STRIDE, BLOCK_N, DEQ_L)
                n1, m1 = _load_codes(kv_ptr, pg_d, tile, seq_len, 1, PAGE, RANK, GROUP, TOKEN_STRIDE, BLOCK_N, DEQ_L)
                n2, m2 = _load_codes(kv_ptr, pg_d, tile, seq_len, 2, PAGE, RANK, GROUP, TOKEN_STRIDE, BLOCK_N, DEQ_L)
                n3, m3 = _load_codes(kv_ptr, pg_d, tile, seq_len, 3, PAGE, RANK, GROUP, TOKEN_STRIDE, BLOCK_N, DEQ_L)
                nrope = _load_rope(kv_ptr, pg_r, tile, seq_len, PAGE, RANK, ROPE, NG, TOKEN_STRIDE, BLOCK_N, ROPE_L)
                if it > 0:
                    _ws_fill(k0_s, k1_s, k2_s, k3_s, rope_s, sc0_s, sc1_s, sc2_s, sc3_s, ready, empty, it - 1, c0, c1,
                             c2, c3, s0, s1, s2, s3, rope, GROUP, NB)
                c0, c1, c2, c3 = n0, n1, n2, n3
                s0, s1, s2, s3 = m0, m1, m2, m3
                rope = nrope
                pg_d = nx_d
                pg_r = nx_r
                it += 1
        if it > 0:
            _ws_fill(k0_s, k1_s, k2_s, k3_s, rope_s, sc0_s, sc1_s, sc2_s, sc3_s, ready, empty, it - 1, c0, c1, c2, c3,
                     s0, s1, s2, s3, rope, GROUP, NB)

    @gluon.jit
    def _ws_consumer(q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                     plse_ptr, partial_cap, qk_scale, SQ, H, k0_s, k1_s, k2_s, k3_s, rope_s, sc0_s, sc1_s, sc2_s,
                     sc3_s, q_lat_s, q_rope_s, p0_s, p1_s, p2_s, p3_s, ready, empty, RANK: gl.constexpr,
                     ROPE: gl.constexpr, GROUP: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                     NB: gl.constexpr):
        W: gl.constexpr = gl.num_warps()
        KT: gl.constexpr = gl.float16
        D: gl.constexpr = RANK + ROPE
        PV_SCALE: gl.constexpr = 256.0
        MMA_L: gl.constexpr = wgmma_layout([W, 1], BLOCK_R)
        KEY_L: gl.constexpr = gl.SliceLayout(1, MMA_L)
        ROW_L: gl.constexpr = gl.SliceLayout(0, MMA_L)
        Q_L: gl.constexpr = row_copy_layout(8, 32, W)
        ROPE_L: gl.constexpr = row_copy_layout(8, 8, W)

        pid_p = gl.program_id(0)
        ROWS = SQ * H
        b_first, t_first, j_first, b_end, t_end, b_last = part_bounds(part_ptr, pid_p)
        ctx_w = gl.load(ctxw_ptr)
        r_lat = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, Q_L))
        r_rope = gl.arange(0, BLOCK_R, layout=gl.SliceLayout(1, ROPE_L))
        c_lat = gl.arange(0, RANK, layout=gl.SliceLayout(0, Q_L))
        c_rope = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        r = gl.arange(0, BLOCK_R, layout=ROW_L)
        c = gl.arange(0, GROUP, layout=KEY_L)
        n = gl.arange(0, BLOCK_N, layout=KEY_L)
        row_ok = r < ROWS
        tok = r // H
        it = 0
        for b in range(b_first, b_last + 1):
            b64 = b.to(gl.int64)
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            if t1 > t0:
                ctx = gl.load(ctx_ptr + b64 * ctx_w + tok, mask=row_ok & (tok < ctx_w), other=0)
                # every consumer warp is done with q of the previous request
                gl.thread_barrier()
                q_row = q_ptr + b64 * (ROWS * D)
                # q's latent to fp16, each row times a power of two qs = 2**k, k <= 0, that brings
                # its max |q| under 2**15 (the Triton kernel's grouped path)
                qs = q_rows_to_fp16(q_row + r_lat.to(gl.int64)[:, None] * D + c_lat[None, :],
                                    (r_lat < ROWS)[:, None] & (c_lat[None, :] < RANK), q_lat_s)
                inv_qs = gl.convert_layout(1.0 / qs, ROW_L)
                copy_q_rope_now(q_rope_s, q_row, r_rope, c_rope, ROWS, RANK)

                m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, ROW_L)
                l_p = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                a0 = gl.full([GROUP, BLOCK_R], 0.0, gl.float32, MMA_L)
                a1 = gl.full([GROUP, BLOCK_R], 0.0, gl.float32, MMA_L)
                a2 = gl.full([GROUP, BLOCK_R], 0.0, gl.float32, MMA_L)
                a3 = gl.full([GROUP, BLOCK_R], 0.0, gl.float32, MMA_L)
                for tile in range(t0, t1):
                    s = it % NB
                    mbarrier.wait(ready.index(s), (it // NB) & 1)
                    k0 = sc0_s.index(s).load(KEY_L)
                    k1 = sc1_s.index(s).load(KEY_L)
                    k2 = sc2_s.index(s).load(KEY_L)
                    k3 = sc3_s.index(s).load(KEY_L)
                    z = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                    sr = warpgroup_mma(rope_s.index(s), q_rope_s.permute((1, 0)), z, use_acc=False, is_async=True)
                    g0 = warpgroup_mma(k0_s.index(s), q_lat_s.slice(0, GROUP, dim=1).permute((1, 0)), z,
                                       use_acc=False, is_async=True)
                    g1 = warpgroup_mma(k1_s.index(s), q_lat_s.slice(GROUP, GROUP, dim=1).permute((1, 0)), z,
                                       use_acc=False, is_async=True)
                    g2 = warpgroup_mma(k2_s.index(s), q_lat_s.slice(2 * GROUP, GROUP, dim=1).permute((1, 0)), z,
                                       use_acc=False, is_async=True)
                    g3 = warpgroup_mma(k3_s.index(s), q_lat_s.slice(3 * GROUP, GROUP, dim=1).permute((1, 0)), z,
                                       use_acc=False, is_async=True)
                    sr, g0, g1, g2, g3 = warpgroup_mma_wait(num_outstanding=0, deps=(sr, g0, g1, g2, g3))
                    sc = (g0 * k0[:, None] + g1 * k1[:, None] + g2 * k2[:, None] + g3 * k3[:, None])
                    sc = (sc * inv_qs[None, :] + sr) * qk_scale
                    p, alpha, m_i, l_p = softmax_keys_step(sc, m_i, l_p, ctx, tile * BLOCK_N + n, seq_len)
                    a0 = a0 * alpha[None, :]
                    a1 = a1 * alpha[None, :]
                    a2 = a2 * alpha[None, :]
                    a3 = a3 * alpha[None, :]
                    p0_s.store((p * (k0 * PV_SCALE)[:, None]).to(KT))
                    p1_s.store((p * (k1 * PV_SCALE)[:, None]).to(KT))
                    p2_s.store((p * (k2 * PV_SCALE)[:, None]).to(KT))
                    p3_s.store((p * (k3 * PV_SCALE)[:, None]).to(KT))
                    fence_async_shared()
                    gl.thread_barrier()
                    a0 = warpgroup_mma(k0_s.index(s).permute((1, 0)), p0_s, a0, is_async=True)
                    a1 = warpgroup_mma(k1_s.index(s).permute((1, 0)), p1_s, a1, is_async=True)
                    a2 = warpgroup_mma(k2_s.index(s).permute((1, 0)), p2_s, a2, is_async=True)
                    a3 = warpgroup_mma(k3_s.index(s).permute((1, 0)), p3_s, a3, is_async=True)
                    a0, a1, a2, a3 = warpgroup_mma_wait(num_outstanding=0, deps=(a0, a1, a2, a3))
                    # every consumer warp is done reading buffer s (and P) before the arrival
                    gl.thread_barrier()
                    mbarrier.arrive(empty.index(s))
                    it += 1

                l_safe, lse2 = softmax_result(m_i, gl.sum(l_p, axis=0))
                inv_l = 1.0 / (l_safe * PV_SCALE)
                store_keys_result(a0, a1, a2, a3, inv_l, lse2, r, c, b64, nsplit, p_row, partial_cap, out_ptr, lse_ptr,
                                  po_ptr, plse_ptr, ROWS, SQ, H, RANK, GROUP)

    @gluon.jit(do_not_specialize=UNSPECIALIZED_DECODE_INTEGERS)
    def _decode_ws_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr,
                          out_ptr, lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H,
                          PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                          TOKEN_STRIDE: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                          NB: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                          PDL: gl.constexpr):
        gl.static_assert(BLOCK_N == 16 * gl.num_warps())
        wait_prior_grid(PDL)  # before any read of the plan (kernels/hopper/pdl.py)
        gl.static_assert(RANK // GROUP == 4)
        QT: gl.constexpr = q_ptr.dtype.element_ty
        KT: gl.constexpr = gl.float16
        K_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, GROUP], KT)
        ROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], QT)
        QLAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, RANK], KT)
        QROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, ROPE], QT)
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_R], KT)
        SC_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        # NB buffers of a tile: the codes as fp16, one allocation per scale group; rope; scales
        k0_s = gl.allocate_shared_memory(KT, [NB, BLOCK_N, GROUP], K_SH)
        k1_s = gl.allocate_shared_memory(KT, [NB, BLOCK_N, GROUP], K_SH)
        k2_s = gl.allocate_shared_memory(KT, [NB, BLOCK_N, GROUP], K_SH)
        k3_s = gl.allocate_shared_memory(KT, [NB, BLOCK_N, GROUP], K_SH)
        rope_s = gl.allocate_shared_memory(QT, [NB, BLOCK_N, ROPE], ROPE_SH)
        sc0_s = gl.allocate_shared_memory(gl.float32, [NB, BLOCK_N], SC_SH)
        sc1_s = gl.allocate_shared_memory(gl.float32, [NB, BLOCK_N], SC_SH)
        sc2_s = gl.allocate_shared_memory(gl.float32, [NB, BLOCK_N], SC_SH)
        sc3_s = gl.allocate_shared_memory(gl.float32, [NB, BLOCK_N], SC_SH)
        q_lat_s = gl.allocate_shared_memory(KT, [BLOCK_R, RANK], QLAT_SH)
        q_rope_s = gl.allocate_shared_memory(QT, [BLOCK_R, ROPE], QROPE_SH)
        p0_s = gl.allocate_shared_memory(KT, [BLOCK_N, BLOCK_R], P_SH)
        p1_s = gl.allocate_shared_memory(KT, [BLOCK_N, BLOCK_R], P_SH)
        p2_s = gl.allocate_shared_memory(KT, [BLOCK_N, BLOCK_R], P_SH)
        p3_s = gl.allocate_shared_memory(KT, [BLOCK_N, BLOCK_R], P_SH)
        ready, empty = ring_barriers(NB)
        gl.warp_specialize([
            (_ws_consumer, (q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                            plse_ptr, partial_cap, qk_scale, SQ, H, k0_s, k1_s, k2_s, k3_s, rope_s, sc0_s, sc1_s,
                            sc2_s, sc3_s, q_lat_s, q_rope_s, p0_s, p1_s, p2_s, p3_s, ready, empty, RANK, ROPE, GROUP,
                            BLOCK_R, BLOCK_N, NB)),
            (_ws_producer, (kv_ptr, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride, k0_s, k1_s, k2_s, k3_s,
                            rope_s, sc0_s, sc1_s, sc2_s, sc3_s, ready, empty, PAGE, RANK, ROPE, GROUP, TOKEN_STRIDE,
                            BLOCK_N, NB, PDL)),
        ], [PRODUCER_WARPS], [PRODUCER_REGS])


def launch_decode_wgmma_ws(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                           split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale_log2: float,
                           rank: int, rope_dim: int, fp8_group: int, block_m: int, block_n: int) -> None:
    """Launch this kernel (arguments as ``decode_split.launch_decode_split``; ``routes.resolve`` has
    admitted the launch). Shapes: q ``[B, s_q, h, rank + rope]`` bf16 with
    ``s_q * h <= block_m`` (16); kv_cache uint8 ``[num_blocks, page, rank + 4 * groups + 2 *
    rope]``; block_n 64; the rest as the Triton launcher."""
    num_parts = part_info.shape[0] - 1
    pdl = pdl_on(q)
    _decode_ws_kernel[(num_parts, 1)](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, block_table.shape[1], partial_o.shape[0], softmax_scale_log2,
        q.shape[1], q.shape[2], PAGE=kv_cache.shape[1], RANK=rank, ROPE=rope_dim, GROUP=fp8_group,
        TOKEN_STRIDE=kv_cache.shape[-1], BLOCK_R=block_m, BLOCK_N=block_n, NB=WS_BUFS, PRODUCER_WARPS=WS_PRODUCER_WARPS,
        PRODUCER_REGS=WS_PRODUCER_REGS, PDL=pdl, num_warps=WS_WARPS, maxnreg=WS_MAXNREG, launch_pdl=pdl)
