"""Hopper FP8 split-KV decode for few query rows (<= 32), keys on the tensor-core M axis (Gluon, GPU only).

The same contract, plan and stores as ``decode_split._decode_split_kernel`` (grid
``(num_parts, 1)``, one program per part; a request that is not split stores ``out``/``lse``,
a split one its fp32 partial), for an FP8 cache, bf16 queries and ``s_q * h <= 32`` query
rows (h=16 at s_q 1-2). A wgmma's M is 64 rows a warpgroup, so the 64-row kernel
(``decode_wgmma``) pads 16 query rows to 64: three quarters of its tensor-core work, its
softmax and its accumulator are padding. Here the dots are transposed so that the *keys*
fill M and the query rows are N (8-256 in steps of 8)::

    S^T   [BLOCK_N, R]  = K [BLOCK_N, 576] @ Q^T [576, R]           (A: the K tile, B: q)
    acc^T [512, R]     += K_lat^T [512, BLOCK_N] @ P^T [BLOCK_N, R]  (A: the K tile read transposed)

with ``R`` the query rows rounded up to 16 or 32. A tile is 128 keys: the two warpgroups
take 64 keys each in ``S^T`` and 256 latent columns each in ``acc^T``, so every shared K
element is read once a dot. The softmax runs down the columns of ``S^T`` (8 scores a thread
at R=16), and the accumulator is ``512 x R`` fp32 in four ``[128, R]`` parts, one per scale
group of latent columns (32 or 64 registers a thread, against 128 for the 64-row kernel).
Per tile (``S`` scaled by ``softmax_scale * log2(e)``)::

    S^T = where(visible, K_lat Q_lat^T + K_rope Q_rope^T, -inf)
    m'  = max(m, colmax S^T);  P^T = exp2(S^T - m');  alpha = exp2(m - m')
    l   = l alpha + colsum P^T;  acc^T = acc^T alpha + K_lat^T P^T;  m = m'

The next tile's e4m3 codes (as int32 words: a word a register, where 8-bit values would
take one each) are loaded into registers at the top of an iteration, its block-table pages
a tile earlier still (so the address arithmetic of those loads does not wait on the block
table), and its bf16 rope is copied ``cp.async`` into a ring of two; they are in flight
during this tile's QK, softmax and PV. Masked keys (past ``seq_len``) load zeros, so a
NaN-poisoned stale slot never reaches a dot. Once this tile's PV dot is done the codes go
into the one shared K tile, in one of two ways:

- *grouped* (16 rows; ``GROUPED``): the codes as fp16, exactly (one ``cvt.rn.f16x2.e4m3x2``
  per two codes), and the group scales on the dot results instead -- the Triton kernel's
  grouped path with fp16 dots (``decode_split`` module doc, "FP16 dots"): q's latent goes to
  fp16 once per request, each row times a power of two that keeps it in fp16's range; the
  latent scores are four group dots, each scaled per key in fp32 and summed, then the power
  of two is undone exactly; the PV dots take ``P^T * scale_g * 2**8`` in fp16 (four P^T
  buffers), and the ``2**8`` is undone at the end.
- *dequantising* (17-32 rows): ``code * scale`` in fp32 rounded to bf16 (inline PTX, a word
  per call), the values the Triton kernel's dequantise path feeds its dots. Four P^T
  buffers of 32 rows do not fit next to the 32-row q block.

Shared memory: q 18 / 36 KiB (R = 16 / 32), the K tile 128 KiB (four ``[128, 128]``
buffers), the rope ring 32 KiB, P^T 16 / 8 KiB.

Measured on an H100 against the 64-row Gluon kernel, same command (``kernel_bench.py``,
CUDA-graph replay of planner + decode + combine, h=16, B 1-128, L 1k-16k;
``benchmarks/results/h100-2026-11-26-kernel-13*.json``): s_q=1 1.06-1.55x in parts of two tiles
(B=128, L=16k: 1100 -> 708 us, 42% -> 65% of copy bandwidth), s_q=2 1.03-1.34x in parts of one
(1088 -> 815 us). Steps (``h100-2026-11-26-wgmma-keys-ab.json``): the transposed dots with a
bf16 dequantised tile 1.36x / 1.21x; pages a tile ahead 1.05x / 1.04x; codes as words with PTX
dequantisation 1.01x; the grouped path at 16 rows 1.06x; then the K tile and P^T as one
allocation per scale group (Gluon put a barrier between stores to slices of one buffer: 7
barriers a tile instead of 17) and the row sums kept per key slot, reduced after the loop:
1.00x / 1.04-1.05x (s_q=2, B=128, L=16k: 861 -> 821 us; 'v7'). Where it is bound: Nsight
Compute at B=128, L=16k (first version,
``benchmarks/results/ncu/h100-2026-11-26-ncu_keys_fp8_16_1_128_16384.txt``) measured DRAM at
45% of peak and put a fifth of the stall samples on address arithmetic waiting for the block
table (hence the pages a tile ahead); removing the
dequantisation, the PV dot or the QK dot (timing runs with wrong results) took 6%, 9% and 10%
off, so no single stage dominates: the loop is serial (QK, softmax, PV, conversion) with one
tile of loads in flight.
Tried and not kept (same json): the codes two tiles ahead (registers, a rope ring of three)
0.81x; a warp loading one key's 512 codes instead of 4 keys x 128 codes 0.83x, 8 or 16 keys x
64 or 32 codes 0.91x / 0.80x; ``ld.global.cg`` 0.92x.

Taken by ``decode_split.launch_decode_split`` when ``decode_wgmma.wgmma_plan`` allows it (a
Hopper device, ``block_m`` 16 or 32 holding all the query rows, ``block_n`` 128, 8 warps, an
FP8 cache of 128-value groups with bf16 q, the ``WGMMA_KEYS`` switch on); a build failure
falls back to the Triton kernel as for the 64-row one (``decode_wgmma.mark_unavailable``).
``config.default_config`` gives it its blocks only where the warp-specialised kernels are
switched off: up to 16 rows ``decode_wgmma_rs`` / ``decode_wgmma_ws`` take them, 17-32 rows the 64-row
``decode_wgmma_ws64`` (0.99-1.09x this kernel over B 1-128, L 1k-16k on an H100,
``benchmarks/results/h100-2026-11-26-kernel-19*.json``).
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
except Exception:  # pragma: no cover - a Triton without Gluon: the Triton kernel only
    gluon = None

from .gluon_parts import (part_bounds, q_rows_to_fp16, request_span, row_copy_layout, softmax_keys_step,
                          softmax_result, store_keys_result, wait_prior_grid, wgmma_layout)
from .pdl import pdl_on

__all__ = ["launch_decode_wgmma_keys", "KEYS_BLOCK_N"]

#: Keys a tile (two warpgroups x wgmma's 64 rows).
KEYS_BLOCK_N = 128


if gluon is not None:

    # e4m3 x4 (one 32-bit word, little-endian: byte k is the k-th code) times an fp32 scale ->
    # four bf16: each code converted exactly (e4m3 -> f16 -> f32), multiplied in fp32 and
    # rounded to nearest even: ``code.to(f32) * scale`` then ``.to(bf16)``, a word per call
    _DEQ_ASM = gl.constexpr("""
    {
    .reg .b16 lo, hi, h0, h1, h2, h3;
    .reg .b32 p01, p23;
    .reg .f32 f0, f1, f2, f3;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 p01, lo;
    cvt.rn.f16x2.e4m3x2 p23, hi;
    mov.b32 {h0, h1}, p01;
    mov.b32 {h2, h3}, p23;
    cvt.f32.f16 f0, h0;
    cvt.f32.f16 f1, h1;
    cvt.f32.f16 f2, h2;
    cvt.f32.f16 f3, h3;
    mul.rn.f32 f0, f0, $5;
    mul.rn.f32 f1, f1, $5;
    mul.rn.f32 f2, f2, $5;
    mul.rn.f32 f3, f3, $5;
    cvt.rn.bf16.f32 $0, f0;
    cvt.rn.bf16.f32 $1, f1;
    cvt.rn.bf16.f32 $2, f2;
    cvt.rn.bf16.f32 $3, f3;
    }
    """)

    # e4m3 x4 (a 32-bit word) -> four fp16, exactly (fp16 holds every finite e4m3 value)
    _CVT_ASM = gl.constexpr("""
    {
    .reg .b16 lo, hi;
    .reg .b32 p01, p23;
    mov.b32 {lo, hi}, $4;
    cvt.rn.f16x2.e4m3x2 p01, lo;
    cvt.rn.f16x2.e4m3x2 p23, hi;
    mov.b32 {$0, $1}, p01;
    mov.b32 {$2, $3}, p23;
    }
    """)

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
    def _store_group(k_s, codes, sc, GROUP: gl.constexpr, SCALED: gl.constexpr):
        # The group's GROUP columns of the K tile from its codes: SCALED, ``code * scale`` rounded
        # to bf16 (the Triton kernel's values); else the codes as fp16, exactly (the grouped
        # path). Word j holds columns 4j .. 4j + 3: [j, a, b] of the joins is b_{2a+b}, column
        # 4j + 2a + b.
        if SCALED:
            b0, b1, b2, b3 = gl.inline_asm_elementwise(_DEQ_ASM, "=h,=h,=h,=h,r,r", [codes, sc[:, None]],
                                                       dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16),
                                                       is_pure=True, pack=1)
        else:
            b0, b1, b2, b3 = gl.inline_asm_elementwise(_CVT_ASM, "=h,=h,=h,=h,r", [codes],
                                                       dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                                                       is_pure=True, pack=1)
        vals = gl.join(gl.join(b0, b2), gl.join(b1, b3))
        k_s.store(gl.reshape(vals, [codes.shape[0], GROUP]))

    @gluon.jit
    def _store_tile(k0_s, k1_s, k2_s, k3_s, c0, c1, c2, c3, s0, s1, s2, s3, GROUP: gl.constexpr,
                    SCALED: gl.constexpr):
        # The four scale groups of a tile (codes c*, scales s* from _load_codes) into their K buffers
        _store_group(k0_s, c0, s0, GROUP, SCALED)
        _store_group(k1_s, c1, s1, GROUP, SCALED)
        _store_group(k2_s, c2, s2, GROUP, SCALED)
        _store_group(k3_s, c3, s3, GROUP, SCALED)

    @gluon.jit
    def _copy_rope(rope_buf, kv_ptr, page, tile, seq_len, PAGE: gl.constexpr, RANK: gl.constexpr,
                   ROPE: gl.constexpr, NG: gl.constexpr, TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr,
                   ROPE_L: gl.constexpr):
        # The tile's bf16 rope (token layout codes | scales | rope), cp.async; masked keys land as zeros
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
        ok = offs_n < seq_len
        at = kv_ptr + (page.to(gl.int64) * PAGE + offs_n % PAGE) * TOKEN_STRIDE + RANK + 4 * NG
        at = at.to(gl.pointer_type(rope_buf.dtype))
        cols = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        async_copy.async_copy_global_to_shared(rope_buf, at[:, None] + cols[None, :],
                                               mask=ok[:, None] & (cols[None, :] < ROPE))

    @gluon.jit
    def _pages(bt_row, tile, seq_len, PAGE: gl.constexpr, BLOCK_N: gl.constexpr, L: gl.constexpr):
        # The cache page of each of the tile's keys ([BLOCK_N] int32 in the row slice of layout
        # L; 0 past seq_len): looked up a tile before the copies that use it, so that their
        # address arithmetic does not wait on the block table
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
        return gl.load(bt_row + offs_n // PAGE, mask=offs_n < seq_len, other=0)

    @gluon.jit
    def _key_scales(kv_ptr, page, tile, seq_len, PAGE: gl.constexpr, RANK: gl.constexpr,
                    TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr, L: gl.constexpr):
        # The tile's four group scales per key, [BLOCK_N] fp32 each in the row slice of L (the
        # dot layout: a thread's keys); 0 past seq_len
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L))
        ok = offs_n < seq_len
        at = (kv_ptr + (page.to(gl.int64) * PAGE + offs_n % PAGE) * TOKEN_STRIDE + RANK).to(gl.pointer_type(gl.float32))
        return (gl.load(at, mask=ok, other=0.0), gl.load(at + 1, mask=ok, other=0.0),
                gl.load(at + 2, mask=ok, other=0.0), gl.load(at + 3, mask=ok, other=0.0))

    @gluon.jit
    def _decode_keys_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr,
                            out_ptr, lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H,
                            PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                            TOKEN_STRIDE: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                            GROUPED: gl.constexpr, PDL: gl.constexpr):
        gl.static_assert(BLOCK_N == 128)
        gl.static_assert(gl.num_warps() == 8)
        wait_prior_grid(PDL)  # before any read of the plan (kernels/pdl.py)
        gl.static_assert(RANK // GROUP == 4)
        QT: gl.constexpr = q_ptr.dtype.element_ty
        # the K tile's (and q latent's) dtype: fp16 codes (grouped) or dequantised bf16
        if GROUPED:
            KT: gl.constexpr = gl.float16
        else:
            KT: gl.constexpr = QT
        D: gl.constexpr = RANK + ROPE
        NG: gl.constexpr = RANK // GROUP
        PV_SCALE: gl.constexpr = 256.0
        # [8, 1]: the warpgroups split M (keys in S^T, latent columns in acc^T); N is the q rows
        MMA_L: gl.constexpr = wgmma_layout([8, 1], BLOCK_R)
        KEY_L: gl.constexpr = gl.SliceLayout(1, MMA_L)
        ROW_L: gl.constexpr = gl.SliceLayout(0, MMA_L)
        Q_L: gl.constexpr = row_copy_layout(8, 32, 8)
        ROPE_L: gl.constexpr = row_copy_layout(8, 8, 8)
        # a group's codes as int32 words, four a thread (one 16-byte load), 4 keys x 128 codes a warp
        DEQ_L: gl.constexpr = row_copy_layout(4, 8, 8)
        K_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, GROUP], KT)
        ROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], QT)
        QLAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, RANK], KT)
        QROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_R, ROPE], QT)
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_R], KT)

        q_lat_s = gl.allocate_shared_memory(KT, [BLOCK_R, RANK], QLAT_SH)
        q_rope_s = gl.allocate_shared_memory(QT, [BLOCK_R, ROPE], QROPE_SH)
        # the K tile as four [BLOCK_N, GROUP] buffers, one per scale group, and four P^T ones:
        # separate allocations, so that writing one needs no barrier against the others
        k0_s = gl.allocate_shared_memory(KT, [BLOCK_N, GROUP], K_SH)
        k1_s = gl.allocate_shared_memory(KT, [BLOCK_N, GROUP], K_SH)
        k2_s = gl.allocate_shared_memory(KT, [BLOCK_N, GROUP], K_SH)
        k3_s = gl.allocate_shared_memory(KT, [BLOCK_N, GROUP], K_SH)
        rope_s = gl.allocate_shared_memory(QT, [2, BLOCK_N, ROPE], ROPE_SH)
        # grouped: one P^T per scale group (P times that group's scales)
        p0_s = gl.allocate_shared_memory(KT, [BLOCK_N, BLOCK_R], P_SH)
        if GROUPED:
            p1_s = gl.allocate_shared_memory(KT, [BLOCK_N, BLOCK_R], P_SH)
            p2_s = gl.allocate_shared_memory(KT, [BLOCK_N, BLOCK_R], P_SH)
            p3_s = gl.allocate_shared_memory(KT, [BLOCK_N, BLOCK_R], P_SH)
        else:
            p1_s = p0_s
            p2_s = p0_s
            p3_s = p0_s

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

        for b in range(b_first, b_last + 1):
            b64 = b.to(gl.int64)
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            if t1 > t0:
                bt_row = bt_ptr + b64 * bt_stride
                ctx = gl.load(ctx_ptr + b64 * ctx_w + tok, mask=row_ok & (tok < ctx_w), other=0)
                # every warp is done with the shared buffers of the previous request
                gl.thread_barrier()
                q_row = q_ptr + b64 * (ROWS * D)
                q_at = q_row + r_lat.to(gl.int64)[:, None] * D + c_lat[None, :]
                q_ok = (r_lat < ROWS)[:, None] & (c_lat[None, :] < RANK)
                if GROUPED:
                    # q's latent to fp16, each row times a power of two qs = 2**k, k <= 0, that
                    # brings its max |q| under 2**15 (decode_split module doc, "FP16 dots"): k =
                    # min(0, 14 - E), E the exponent of the row max from the fp32 bits (a NaN or
                    # inf row: E = 128; a zero or padding row: k = 0)
                    qs = q_rows_to_fp16(q_at, q_ok, q_lat_s)
                    inv_qs = gl.convert_layout(1.0 / qs, ROW_L)
                else:
                    async_copy.async_copy_global_to_shared(q_lat_s, q_at, mask=q_ok)
                async_copy.async_copy_global_to_shared(
                    q_rope_s, q_row + r_rope.to(gl.int64)[:, None] * D + RANK + c_rope[None, :],
                    mask=(r_rope < ROWS)[:, None] & (c_rope[None, :] < ROPE))
                pg_r = _pages(bt_row, t0, seq_len, PAGE, BLOCK_N, ROPE_L)
                pg_d = _pages(bt_row, t0, seq_len, PAGE, BLOCK_N, DEQ_L)
                len1 = gl.where(t0 + 1 < t1, seq_len, 0)
                nxt_r = _pages(bt_row, t0 + 1, len1, PAGE, BLOCK_N, ROPE_L)
                nxt_d = _pages(bt_row, t0 + 1, len1, PAGE, BLOCK_N, DEQ_L)
                _copy_rope(rope_s.index(0), kv_ptr, pg_r, t0, seq_len, PAGE, RANK, ROPE, NG, TOKEN_STRIDE,
                           BLOCK_N, ROPE_L)
                async_copy.commit_group()
                c0, s0 = _load_codes(kv_ptr, pg_d, t0, seq_len, 0, PAGE, RANK, GROUP, TOKEN_STRIDE, BLOCK_N, DEQ_L)
                c1, s1 = _load_codes(kv_ptr, pg_d, t0, seq_len, 1, PAGE, RANK, GROUP, TOKEN_STRIDE, BLOCK_N, DEQ_L)
                c2, s2 = _load_codes(kv_ptr, pg_d, t0, seq_len, 2, PAGE, RANK, GROUP, TOKEN_STRIDE, BLOCK_N, DEQ_L)
                c3, s3 = _load_codes(kv_ptr, pg_d, t0, seq_len, 3, PAGE, RANK, GROUP, TOKEN_STRIDE, BLOCK_N, DEQ_L)
                if GROUPED:
                    pg_k = _pages(bt_row, t0, seq_len, PAGE, BLOCK_N, MMA_L)
                    nxt_k = _pages(bt_row, t0 + 1, len1, PAGE, BLOCK_N, MMA_L)
                    k0, k1, k2, k3 = _key_scales(kv_ptr, pg_k, t0, seq_len, PAGE, RANK, TOKEN_STRIDE, BLOCK_N, MMA_L)
                _store_tile(k0_s, k1_s, k2_s, k3_s, c0, c1, c2, c3, s0, s1, s2, s3, GROUP, not GROUPED)
                async_copy.wait_group(0)
                fence_async_shared()
                gl.thread_barrier()

                m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, ROW_L)
                l_p = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                # acc^T in four [GROUP, BLOCK_R] parts, one per scale group of latent columns
                a0 = gl.full([GROUP, BLOCK_R], 0.0, gl.float32, MMA_L)
                a1 = gl.full([GROUP, BLOCK_R], 0.0, gl.float32, MMA_L)
                a2 = gl.full([GROUP, BLOCK_R], 0.0, gl.float32, MMA_L)
                a3 = gl.full([GROUP, BLOCK_R], 0.0, gl.float32, MMA_L)
                for tile in range(t0, t1):
                    buf = (tile - t0) % 2
                    # the next tile: rope into the other ring slot (last read by the QK of the
                    # previous tile, done), codes (and scales) into registers
                    nxt_len = gl.where(tile + 1 < t1, seq_len, 0)
                    # the pages of tile + 2, for the next trip's copies
                    len2 = gl.where(tile + 2 < t1, seq_len, 0)
                    nxt2_r = _pages(bt_row, tile + 2, len2, PAGE, BLOCK_N, ROPE_L)
                    nxt2_d = _pages(bt_row, tile + 2, len2, PAGE, BLOCK_N, DEQ_L)
                    _copy_rope(rope_s.index(1 - buf), kv_ptr, nxt_r, tile + 1, nxt_len, PAGE, RANK, ROPE, NG,
                               TOKEN_STRIDE, BLOCK_N, ROPE_L)
                    async_copy.commit_group()
                    c0, s0 = _load_codes(kv_ptr, nxt_d, tile + 1, nxt_len, 0, PAGE, RANK, GROUP, TOKEN_STRIDE,
                                         BLOCK_N, DEQ_L)
                    c1, s1 = _load_codes(kv_ptr, nxt_d, tile + 1, nxt_len, 1, PAGE, RANK, GROUP, TOKEN_STRIDE,
                                         BLOCK_N, DEQ_L)
                    c2, s2 = _load_codes(kv_ptr, nxt_d, tile + 1, nxt_len, 2, PAGE, RANK, GROUP, TOKEN_STRIDE,
                                         BLOCK_N, DEQ_L)
                    c3, s3 = _load_codes(kv_ptr, nxt_d, tile + 1, nxt_len, 3, PAGE, RANK, GROUP, TOKEN_STRIDE,
                                         BLOCK_N, DEQ_L)

                    sr = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                    sr = warpgroup_mma(rope_s.index(buf), q_rope_s.permute((1, 0)), sr, use_acc=False,
                                       is_async=True)
                    if GROUPED:
                        nxt2_k = _pages(bt_row, tile + 2, len2, PAGE, BLOCK_N, MMA_L)
                        j0, j1, j2, j3 = _key_scales(kv_ptr, nxt_k, tile + 1, nxt_len, PAGE, RANK, TOKEN_STRIDE,
                                                     BLOCK_N, MMA_L)
                        z = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                        g0 = warpgroup_mma(k0_s, q_lat_s.slice(0, GROUP, dim=1).permute((1, 0)),
                                           z, use_acc=False, is_async=True)
                        g1 = warpgroup_mma(k1_s,
                                           q_lat_s.slice(GROUP, GROUP, dim=1).permute((1, 0)), z, use_acc=False,
                                           is_async=True)
                        g2 = warpgroup_mma(k2_s,
                                           q_lat_s.slice(2 * GROUP, GROUP, dim=1).permute((1, 0)), z, use_acc=False,
                                           is_async=True)
                        g3 = warpgroup_mma(k3_s,
                                           q_lat_s.slice(3 * GROUP, GROUP, dim=1).permute((1, 0)), z, use_acc=False,
                                           is_async=True)
                        sr, g0, g1, g2, g3 = warpgroup_mma_wait(num_outstanding=0, deps=(sr, g0, g1, g2, g3))
                        # the scales on the dot results, in fp32; q's power of two undone exactly
                        s = (g0 * k0[:, None] + g1 * k1[:, None] + g2 * k2[:, None] + g3 * k3[:, None])
                        s = s * inv_qs[None, :] + sr
                    else:
                        s = warpgroup_mma(k0_s, q_lat_s.slice(0, GROUP, dim=1).permute((1, 0)), sr, is_async=True)
                        s = warpgroup_mma(k1_s, q_lat_s.slice(GROUP, GROUP, dim=1).permute((1, 0)), s, is_async=True)
                        s = warpgroup_mma(k2_s, q_lat_s.slice(2 * GROUP, GROUP, dim=1).permute((1, 0)), s,
                                          is_async=True)
                        s = warpgroup_mma(k3_s, q_lat_s.slice(3 * GROUP, GROUP, dim=1).permute((1, 0)), s,
                                          is_async=True)
                        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

                    # the row sums are kept per key slot and reduced once, after the loop
                    p, alpha, m_i, l_p = softmax_keys_step(s * qk_scale, m_i, l_p, ctx, tile * BLOCK_N + n, seq_len)
                    a0 = a0 * alpha[None, :]
                    a1 = a1 * alpha[None, :]
                    a2 = a2 * alpha[None, :]
                    a3 = a3 * alpha[None, :]
                    if GROUPED:
                        # P^T times each group's key scales (and 2**8, out of fp16's subnormals)
                        p0_s.store((p * (k0 * PV_SCALE)[:, None]).to(KT))
                        p1_s.store((p * (k1 * PV_SCALE)[:, None]).to(KT))
                        p2_s.store((p * (k2 * PV_SCALE)[:, None]).to(KT))
                        p3_s.store((p * (k3 * PV_SCALE)[:, None]).to(KT))
                    else:
                        p0_s.store(p.to(KT))
                    fence_async_shared()
                    gl.thread_barrier()
                    a0 = warpgroup_mma(k0_s.permute((1, 0)), p0_s, a0, is_async=True)
                    a1 = warpgroup_mma(k1_s.permute((1, 0)), p1_s, a1, is_async=True)
                    a2 = warpgroup_mma(k2_s.permute((1, 0)), p2_s, a2, is_async=True)
                    a3 = warpgroup_mma(k3_s.permute((1, 0)), p3_s, a3, is_async=True)
                    a0, a1, a2, a3 = warpgroup_mma_wait(num_outstanding=0, deps=(a0, a1, a2, a3))
                    # both warpgroups are done reading the K tile (and P)
                    gl.thread_barrier()
                    if tile + 1 < t1:
                        _store_tile(k0_s, k1_s, k2_s, k3_s, c0, c1, c2, c3, s0, s1, s2, s3, GROUP, not GROUPED)
                    async_copy.wait_group(0)
                    fence_async_shared()
                    gl.thread_barrier()
                    nxt_r = nxt2_r
                    nxt_d = nxt2_d
                    if GROUPED:
                        nxt_k = nxt2_k
                        k0, k1, k2, k3 = j0, j1, j2, j3

                l_safe, lse2 = softmax_result(m_i, gl.sum(l_p, axis=0))
                if GROUPED:
                    inv_l = 1.0 / (l_safe * PV_SCALE)
                else:
                    inv_l = 1.0 / l_safe
                store_keys_result(a0, a1, a2, a3, inv_l, lse2, r, c, b64, nsplit, p_row, partial_cap, out_ptr, lse_ptr,
                                  po_ptr, plse_ptr, ROWS, SQ, H, RANK, GROUP)


def launch_decode_wgmma_keys(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                             split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale_log2: float,
                             rank: int, rope_dim: int, fp8_group: int, block_m: int, block_n: int) -> None:
    """Launch this kernel (arguments as ``decode_split.launch_decode_split``; the caller has
    checked ``decode_wgmma.wgmma_plan``). Shapes: q ``[B, s_q, h, rank + rope]`` bf16 with
    ``s_q * h <= block_m`` (16 or 32); kv_cache uint8 ``[num_blocks, page, rank + 4 * groups +
    2 * rope]``; block_n 128; the rest as the Triton launcher."""
    num_parts = part_info.shape[0] - 1
    pdl = pdl_on(q)
    _decode_keys_kernel[(num_parts, 1)](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, block_table.shape[1], partial_o.shape[0], softmax_scale_log2,
        q.shape[1], q.shape[2], PAGE=kv_cache.shape[1], RANK=rank, ROPE=rope_dim, GROUP=fp8_group,
        TOKEN_STRIDE=kv_cache.shape[-1], BLOCK_R=block_m, BLOCK_N=block_n,
        GROUPED=block_m <= 16, PDL=pdl, num_warps=8, launch_pdl=pdl)
