"""Hopper FP8 split-KV decode at 64-row blocks, warp-specialised: a producer partition copies and
dequantises the next key tile while the consumer runs this one's dots (Gluon, GPU only).

Contract, plan and stores of the Triton decode (``kernels/decode_split.py``): grid ``(num_parts,
m_blocks)``; a request that is not split stores ``out`` / ``lse``, a split one its fp32 partial.
Shapes: rank 512 + rope 64, FP8 cache of 128-value groups (codes | fp32 scales | bf16 rope a
token), bf16 queries, 64-key tiles. The keys are ``code * scale`` in fp32 rounded to bf16 -- the
Triton kernel's dequantise path -- and then the 16-bit math of ``decode_wgmma``::

    S = where(visible, Q_lat K_lat^T + Q_rope K_rope^T, -inf) * scale * log2(e)
    online softmax over the tiles;  acc += P K_lat;  out = acc / l

Two partitions (``gl.warp_specialize``) hand dequantised tiles over through two shared buffers
and an mbarrier pair a buffer (ready / empty):

- the *producer* (``W64_PRODUCER_WARPS`` warps) walks the part's requests and tiles as the
  consumer does; per tile it waits for a free buffer and ``cp.async``-copies the tile into it in
  four commit groups (rope, scales and scale group 0's codes; then groups 1, 2, 3), dequantising
  each group *in place* once it has landed: the bf16 K tile ``[64, 512]`` holds the tile's 32 KiB
  of codes in its upper half, staged group-major, and the 128-byte swizzle puts group ``g``'s
  bf16 values at bytes ``[16 KiB g, 16 KiB (g + 1))`` -- groups 0-1 where no codes are, group 2
  over 0-1's codes once every producer thread has read them, group 3 over its own and 2's
  (barriers between). A thread converts 8 codes into one 16-byte store. A tile's page is read a
  tile ahead when a page holds whole tiles (``gluon_parts.tile_page``). Keys past ``seq_len`` are
  masked copies, which land as zeros (a NaN-poisoned stale slot never reaches a dot).
- the *64-row consumer* (8 warps, two warpgroups) runs ``decode_wgmma``'s tile step without its
  copies: ``S`` split ``[4, 2]`` (32 keys a warpgroup), the softmax across both, ``acc += P V``
  (256 columns a warpgroup), handing a buffer back once its PV dot is done.
- up to ``W64_KEYS_ROWS`` (32) query rows a request (h=16 x 2, h=8 x 4), a *keys-on-M consumer*
  (one warpgroup, every row) instead: ``S^T [64 keys, 32 rows] = K Q^T`` and ``acc^T [512, 32] +=
  K^T P^T`` put the keys / latent columns on the wgmma M axis, so no padding rows are computed
  and the K tile is read once a dot; the producer beside it gets ``W64_KEYS_PRODUCER_WARPS``.

Staged stores: a program whose part holds whole requests moves on often, and from the
accumulator's layout a thread stores ``out`` in 4-byte pieces of eight rows. So the 64-row
consumer writes an unsplit request's ``out`` into q's latent buffer (no dot reads it after the
request's last QK) and stores it in 16-byte vectors along rows (``gluon_parts.store_out_staged``),
compiled in where parts can hold whole requests (``num_parts <= W64_STAGE_OUT_PARTS_PER_REQUEST *
B``); and a part's last piece, when split, goes through the two free K buffers as fp32
(``store_part_staged``), compiled in at ``num_parts >= W64_STAGE_PART_PARTS_PER_REQUEST * B``.

Shared memory: q 72 KiB, P 8 KiB, two buffers of a K tile (64 KiB), its rope (8) and scales (1):
226 KiB of the H100's 227. Registers: at most 168 a thread over the 12 warps (``W64_MAXNREG``),
the producer 64, the consumer the rest (no spills in its loop).

The route table (``kernels/routes.py``) gives it FP8 64-row blocks on Hopper (h=128; h=16 x 2 at
batches past ``routes.SPLIT_ROWS_MAX_BATCH``). Measurements, and the variants measured and not
kept: ``docs/kernel-performance.md``.
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_init, warpgroup_mma_wait)
except Exception:  # pragma: no cover - a Triton without Gluon: the Triton kernel only
    gluon = None

from .gluon_parts import (key_rows, part_bounds, program_rows, request_span, ring_barriers, row_copy_layout,
                          rows_tile_step, softmax_keys_step, softmax_result, start_request_rows, store_keys_lse,
                          store_keys_part, store_part_staged, store_rows_result, tile_page, wait_prior_grid,
                          wgmma_layout)
from .pdl import pdl_on
from ..config import UNSPECIALIZED_DECODE_INTEGERS

__all__ = ["launch_decode_wgmma_ws64", "W64_BUFS", "W64_PRODUCER_WARPS", "W64_PRODUCER_REGS", "W64_KEYS_ROWS",
           "W64_STAGE_OUT_PARTS_PER_REQUEST", "W64_STAGE_PART_PARTS_PER_REQUEST"]

#: tile buffers handed between the two partitions (two fill the shared memory)
W64_BUFS = 2
#: warps of the producer partition
W64_PRODUCER_WARPS = 4
#: registers a producer thread gets (the consumer gets the rest of the register file)
W64_PRODUCER_REGS = 64
#: the kernel's register cap: (8 + W64_PRODUCER_WARPS) warps x 32 threads x this <= 64K
W64_MAXNREG = 168
#: launches of at most this many query rows a request take the keys-on-M consumer (module doc): one
#: warpgroup holding every row, the launch's 4 warps
W64_KEYS_ROWS = 32
W64_KEYS_WARPS = 4
#: beside the keys-on-M consumer (which needs under half the register file), the producer's warps
#: and registers
W64_KEYS_PRODUCER_WARPS = 8
W64_KEYS_PRODUCER_REGS = 72
#: the 64-row consumer stores unsplit requests' ``out`` through q's latent buffer in whole rows (module
#: doc, "Staged stores") in launches of at most this many parts a request of the padded batch (where
#: parts hold whole requests: 1.08-1.11x; with it compiled in, launches whose requests are all split ran
#: 0.97-0.99x); 0: never
W64_STAGE_OUT_PARTS_PER_REQUEST = 2
#: the 64-row consumer stores the fp32 partial of its part's last request through the two free K
#: buffers (module doc, "Staged stores") in launches of at least this many parts a request of the
#: padded batch (where a part's last piece is a split one: 1.003-1.035x; compiled into launches of
#: fewer parts a request, 0.989-0.998x); 0: every 64-row launch, None: never
W64_STAGE_PART_PARTS_PER_REQUEST = 2
#: the register cap with the keys-on-M consumer: (4 + 8) warps x 32 threads x this <= 64K
W64_KEYS_MAXNREG = 168

if gluon is not None:

    @gluon.jit
    def _w64_copy(stage_s, stage, rope_buf, sc_buf, kv_ptr, bt_row, tile, seq_len, page0, PAGE: gl.constexpr,
                  RANK: gl.constexpr, ROPE: gl.constexpr, NG: gl.constexpr, GROUP: gl.constexpr,
                  TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr, CODE_L: gl.constexpr, ROPE_L: gl.constexpr,
                  SC_L: gl.constexpr):
        # Copy one tile into a free buffer (cp.async; keys past seq_len are masked and land as
        # zeros), in NG commit groups: the bf16 rope, the fp32 scales (token layout codes | scales
        # | rope) and the codes of scale group 0; then the codes of each further group. Group g's
        # codes go to stage_s[stage + g] ([BLOCK_N, GROUP] uint8), so that the dequantisation of
        # a group can start once its commit group has landed. The keys' pages: ``page0``
        # (``tile_page``, loaded a tile ahead) when a page holds whole tiles.
        offs_r = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
        ok_r = offs_r < seq_len
        rope_at = key_rows(kv_ptr, bt_row, offs_r, ok_r, page0, PAGE, BLOCK_N, TOKEN_STRIDE) + RANK + 4 * NG
        cols_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        async_copy.async_copy_global_to_shared(rope_buf, rope_at.to(gl.pointer_type(gl.bfloat16))[:, None]
                                               + cols_r[None, :], mask=ok_r[:, None] & (cols_r[None, :] < ROPE))
        offs_s = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SC_L))
        ok_s = offs_s < seq_len
        sc_at = key_rows(kv_ptr, bt_row, offs_s, ok_s, page0, PAGE, BLOCK_N, TOKEN_STRIDE) + RANK
        cols_s = gl.arange(0, NG, layout=gl.SliceLayout(0, SC_L))
        async_copy.async_copy_global_to_shared(sc_buf, sc_at.to(gl.pointer_type(gl.float32))[:, None]
                                               + cols_s[None, :], mask=ok_s[:, None] & (cols_s[None, :] < NG))
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, CODE_L))
        ok = offs_n < seq_len
        row = key_rows(kv_ptr, bt_row, offs_n, ok, page0, PAGE, BLOCK_N, TOKEN_STRIDE)
        cols = gl.arange(0, GROUP, layout=gl.SliceLayout(0, CODE_L))
        for g in gl.static_range(NG):
            async_copy.async_copy_global_to_shared(stage_s.index(stage + g), row[:, None] + g * GROUP + cols[None, :],
                                                   mask=ok[:, None] & (cols[None, :] < GROUP))
            async_copy.commit_group()

    @gluon.jit
    def _w64_group(codes, sc, g: gl.constexpr, DT: gl.constexpr, DEQ_L: gl.constexpr, SC_L: gl.constexpr):
        # One scale group's values code * scale in fp32, rounded to DT: codes [BLOCK_N, GROUP]
        # (DEQ_L), sc the tile's scales [BLOCK_N, NG] (SC_L)
        cols = gl.arange(0, sc.shape[1], layout=gl.SliceLayout(0, SC_L))
        sc_g = gl.sum(gl.where(cols[None, :] == g, sc, 0.0), axis=1)
        sc_g = gl.convert_layout(sc_g, gl.SliceLayout(1, DEQ_L))
        return (codes.to(gl.float8e4nv, bitcast=True).to(gl.float32) * sc_g[:, None]).to(DT)

    @gluon.jit
    def _w64_dequantise(k_lat, stage_s, stage, sc_buf, NG: gl.constexpr, GROUP: gl.constexpr, DT: gl.constexpr,
                        DEQ_L: gl.constexpr, SC_L: gl.constexpr):
        # The staged codes of a tile into its bf16 K tile, in place (module doc), a scale group
        # as soon as its commit group (``_w64_copy``) has landed for every producer thread: groups 0
        # and 1 land below the staging half; group 2 over groups 0-1's codes, once every thread
        # has read those; group 3 over its own and group 2's, once every thread holds them
        gl.static_assert(NG == 4)
        async_copy.wait_group(3)
        gl.thread_barrier()
        sc = sc_buf.load(SC_L)
        k_lat.slice(0, GROUP, dim=1).store(_w64_group(stage_s.index(stage).load(DEQ_L), sc, 0, DT, DEQ_L, SC_L))
        async_copy.wait_group(2)
        gl.thread_barrier()
        k_lat.slice(GROUP, GROUP, dim=1).store(_w64_group(stage_s.index(stage + 1).load(DEQ_L), sc, 1, DT, DEQ_L, SC_L))
        async_copy.wait_group(1)
        gl.thread_barrier()
        k_lat.slice(2 * GROUP, GROUP, dim=1).store(_w64_group(stage_s.index(stage + 2).load(DEQ_L), sc, 2, DT, DEQ_L,
                                                              SC_L))
        async_copy.wait_group(0)
        gl.thread_barrier()
        c3 = stage_s.index(stage + 3).load(DEQ_L)
        gl.thread_barrier()
        k_lat.slice(3 * GROUP, GROUP, dim=1).store(_w64_group(c3, sc, 3, DT, DEQ_L, SC_L))

    @gluon.jit
    def _w64_producer(kv_ptr, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride, k_lat_s, k_rope_s, sc_s,
                      ready, empty, PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                      TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr, NB: gl.constexpr, PDL: gl.constexpr):
        wait_prior_grid(PDL)  # this partition's warps too (kernels/hopper/pdl.py)
        W: gl.constexpr = gl.num_warps()
        NG: gl.constexpr = RANK // GROUP
        DT: gl.constexpr = gl.bfloat16
        # 16-byte vectors along a row: 16 codes, 8 rope values; a key's NG scale words
        CODE_L: gl.constexpr = row_copy_layout(16, 8, W)
        # the dequantisation's codes, 8 a thread: a thread's bf16 values are one 16-byte store, and
        # the 16 threads of a row write its 16 chunks of 16 bytes, which the K tile's swizzle puts in
        # distinct banks. With CODE_L's 16 a thread (two stores, 8 threads a row) each store hit half
        # the banks: twice the ideal shared wavefronts (Nsight Compute); 8 ran 0.998-1.045x
        # (h200-2026-11-27-ws64-dequant-vec.json)
        DEQ_L: gl.constexpr = row_copy_layout(8, GROUP // 8, W)
        ROPE_L: gl.constexpr = row_copy_layout(8, 8, W)
        SC_L: gl.constexpr = row_copy_layout(NG, 8, W)
        # the K tiles' bytes as uint8 [NB * 2 * NG, BLOCK_N, GROUP]: [(2 s + 1) NG + g] group g of
        # the staging half of buffer s
        STAGE_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        stage_s = k_lat_s._reinterpret(gl.uint8, [NB * 2 * NG, BLOCK_N, GROUP], STAGE_SH)
        pid_p = gl.program_id(0)
        b_first, t_first, j_first, b_end, t_end, b_last = part_bounds(part_ptr, pid_p)
        it = 0
        for b in range(b_first, b_last + 1):
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            bt_row = bt_ptr + b.to(gl.int64) * bt_stride
            pg = tile_page(bt_row, t0, t1, PAGE, BLOCK_N)
            for tile in range(t0, t1):
                s = it % NB
                # the next tile's page, read while this one waits and copies
                pg_next = tile_page(bt_row, tile + 1, t1, PAGE, BLOCK_N)
                # the consumer's PV dot of tile it - NB (which read this buffer) is done
                mbarrier.wait(empty.index(s), ((it // NB) & 1) ^ 1)
                stage = (2 * s + 1) * NG
                _w64_copy(stage_s, stage, k_rope_s.index(s), sc_s.index(s), kv_ptr, bt_row, tile, seq_len, pg, PAGE,
                          RANK, ROPE, NG, GROUP, TOKEN_STRIDE, BLOCK_N, CODE_L, ROPE_L, SC_L)
                pg = pg_next
                _w64_dequantise(k_lat_s.index(s), stage_s, stage, sc_s.index(s), NG, GROUP, DT, DEQ_L, SC_L)
                # the generic-proxy stores (and the copies) visible to the consumer's wgmma reads,
                # from every producer warp, before the (single) arrival
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(ready.index(s))
                it += 1

    @gluon.jit
    def _w64_take_buffer(acc, it, tile, t0, ready, empty, NB: gl.constexpr):
        # A consumer's turn to tile ``it``: the PV dot of the previous tile is done (in both
        # warpgroups, after the barrier), so its buffer goes back to the producer and P may be
        # rewritten; then this tile's buffer is waited for. Returns ``acc`` waited on.
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
        gl.thread_barrier()
        if tile > t0:
            mbarrier.arrive(empty.index((it + NB - 1) % NB))
        mbarrier.wait(ready.index(it % NB), (it // NB) & 1)
        return acc

    @gluon.jit
    def _w64_consumer(q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                      plse_ptr, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, p_s, k_lat_s, k_rope_s, ready, empty,
                      RANK: gl.constexpr, ROPE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                      NB: gl.constexpr, STAGE_OUT: gl.constexpr, STAGE_PART: gl.constexpr = False):
        # [4, 2]: the four warps of a warpgroup split the 64 rows, the two warpgroups the N axis
        S_L: gl.constexpr = wgmma_layout([4, 2], BLOCK_N // 2)
        ACC_L: gl.constexpr = wgmma_layout([4, 2], RANK // 2)
        ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
        ROW_A: gl.constexpr = gl.SliceLayout(1, ACC_L)
        COL_A: gl.constexpr = gl.SliceLayout(0, ACC_L)
        Q_L: gl.constexpr = row_copy_layout(8, 32, 8)
        QR_L: gl.constexpr = row_copy_layout(8, 8, 8)
        # a staged fp32 partial: rows spread over the banks (16-byte units XOR the row), read back
        # in 16-byte vectors along rows
        PART_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=4, per_phase=1, max_phase=8, order=[1, 0])
        PART_L: gl.constexpr = row_copy_layout(4, 32, 8)

        ROWS = SQ * H
        b_first, t_first, j_first, b_end, t_end, b_last, row0, ctx_w, m_s, n_s = program_rows(
            part_ptr, ctxw_ptr, BLOCK_M, BLOCK_N, S_L)
        row_ok_s = m_s < ROWS
        tok_s = m_s // H
        it = 0
        for b in range(b_first, b_last + 1):
            b64 = b.to(gl.int64)
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            if t1 > t0:
                ctx = start_request_rows(q_ptr, ctx_ptr, b64, ctx_w, tok_s, row_ok_s, row0, ROWS, q_lat_s, q_rope_s,
                                         RANK, ROPE, Q_L, QR_L)

                m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, ROW_S)
                l_i = gl.full([BLOCK_M], 0.0, gl.float32, ROW_S)
                acc = warpgroup_mma_init(gl.full([BLOCK_M, RANK], 0.0, gl.float32, ACC_L))
                for tile in range(t0, t1):
                    s = it % NB
                    acc = _w64_take_buffer(acc, it, tile, t0, ready, empty, NB)
                    k_lat = k_lat_s.index(s)
                    acc, m_i, l_i = rows_tile_step(q_lat_s, q_rope_s, k_lat, k_rope_s.index(s), p_s, acc, m_i, l_i,
                                                   ctx, tile, n_s, seq_len, qk_scale, S_L, ROW_A)
                    it += 1
                # the last tile's buffer goes back once its PV dot is done
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                gl.thread_barrier()
                mbarrier.arrive(empty.index((it + NB - 1) % NB))

                if STAGE_PART and nsplit > 1 and b == b_last:
                    # the part's last piece: the producer has no tile left, so both K buffers are
                    # free for the fp32 partial ("Staged stores")
                    store_part_staged(acc, m_i, l_i, row0, p_row, partial_cap, po_ptr, plse_ptr, ROWS,
                                      k_lat_s._reinterpret(gl.float32, [BLOCK_M, RANK], PART_SH), ROW_S, ROW_A,
                                      PART_L)
                else:
                    # STAGE_OUT: out through q's latent buffer, free since the last tile's barrier ("Staged stores")
                    store_rows_result(acc, m_i, l_i, row0, b64, nsplit, p_row, partial_cap, out_ptr, lse_ptr, po_ptr,
                                      plse_ptr, ROWS, SQ, H, BLOCK_M, RANK, ROW_S, ROW_A, COL_A, q_lat_s, Q_L,
                                      STAGE_OUT)

    @gluon.jit
    def _w64_keys_consumer(q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr, po_ptr,
                           plse_ptr, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, p_s, k_lat_s, k_rope_s, ready,
                           empty, RANK: gl.constexpr, ROPE: gl.constexpr, BLOCK_R: gl.constexpr, BLOCK_N: gl.constexpr,
                           NB: gl.constexpr):
        # The consumer for up to BLOCK_R (32) query rows: the keys on the wgmma M axis (module doc)
        # -- S^T [keys, rows], acc^T [RANK, rows] -- so that no padding rows of a 64-row block are
        # computed. [4, CW]: a warpgroup's four warps split the keys / latent columns; with one
        # warpgroup (W64_KEYS_WARPS = 4) it holds every row and reads the K tile once a dot, with
        # two each takes half the rows (no exchange between them either way)
        CW: gl.constexpr = gl.num_warps() // 4
        MMA_L: gl.constexpr = wgmma_layout([4, CW], BLOCK_R // CW)
        KEY_L: gl.constexpr = gl.SliceLayout(1, MMA_L)
        ROW_L: gl.constexpr = gl.SliceLayout(0, MMA_L)
        Q_L: gl.constexpr = row_copy_layout(8, 32, gl.num_warps())
        QR_L: gl.constexpr = row_copy_layout(8, 8, gl.num_warps())

        ROWS = SQ * H
        b_first, t_first, j_first, b_end, t_end, b_last = part_bounds(part_ptr, gl.program_id(0))
        row0 = gl.program_id(1) * BLOCK_R
        ctx_w = gl.load(ctxw_ptr)
        r = row0 + gl.arange(0, BLOCK_R, layout=ROW_L)
        n = gl.arange(0, BLOCK_N, layout=KEY_L)
        c = gl.arange(0, RANK, layout=KEY_L)
        row_ok = r < ROWS
        tok = r // H
        it = 0
        for b in range(b_first, b_last + 1):
            b64 = b.to(gl.int64)
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            if t1 > t0:
                ctx = start_request_rows(q_ptr, ctx_ptr, b64, ctx_w, tok, row_ok, row0, ROWS, q_lat_s, q_rope_s, RANK,
                                         ROPE, Q_L, QR_L)

                m_i = gl.full([BLOCK_R], float("-inf"), gl.float32, ROW_L)
                l_p = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                acc = warpgroup_mma_init(gl.full([RANK, BLOCK_R], 0.0, gl.float32, MMA_L))
                for tile in range(t0, t1):
                    s = it % NB
                    acc = _w64_take_buffer(acc, it, tile, t0, ready, empty, NB)
                    k_lat = k_lat_s.index(s)
                    st = gl.full([BLOCK_N, BLOCK_R], 0.0, gl.float32, MMA_L)
                    st = warpgroup_mma(k_rope_s.index(s), q_rope_s.permute((1, 0)), st, use_acc=False, is_async=True)
                    st = warpgroup_mma(k_lat, q_lat_s.permute((1, 0)), st, is_async=True)
                    st = warpgroup_mma_wait(num_outstanding=0, deps=(st, ))
                    p, alpha, m_i, l_p = softmax_keys_step(st * qk_scale, m_i, l_p, ctx, tile * BLOCK_N + n, seq_len)
                    acc = acc * alpha[None, :]
                    p_s.store(p.to(p_s.dtype))
                    fence_async_shared()
                    gl.thread_barrier()
                    acc = warpgroup_mma(k_lat.permute((1, 0)), p_s, acc, is_async=True)
                    it += 1
                # the last tile's buffer goes back once its PV dot is done
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                gl.thread_barrier()
                mbarrier.arrive(empty.index((it + NB - 1) % NB))

                l_safe, lse2 = softmax_result(m_i, gl.sum(l_p, axis=0))
                store_keys_part(acc, 0, 1.0 / l_safe, r, c, b64, nsplit, p_row, partial_cap, out_ptr, po_ptr, ROWS,
                                RANK)
                store_keys_lse(lse2, r, b64, nsplit, p_row, partial_cap, lse_ptr, plse_ptr, ROWS, SQ, H)

    @gluon.jit(do_not_specialize=UNSPECIALIZED_DECODE_INTEGERS)
    def _decode_ws64_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr,
                            out_ptr, lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H,
                            PAGE: gl.constexpr, RANK: gl.constexpr, ROPE: gl.constexpr, GROUP: gl.constexpr,
                            TOKEN_STRIDE: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                            NB: gl.constexpr, PRODUCER_WARPS: gl.constexpr, PRODUCER_REGS: gl.constexpr,
                            PDL: gl.constexpr, KEYS: gl.constexpr, STAGE_OUT: gl.constexpr,
                            STAGE_PART: gl.constexpr = False):
        # BLOCK_M: a program's query rows, 64, or 32 with the keys-on-M consumer (KEYS); the launch's
        # warps: the consumer's, 8 (two warpgroups) or, keys-on-M, 4
        gl.static_assert(BLOCK_M == (32 if KEYS else 64))
        gl.static_assert(gl.num_warps() == 8 or (KEYS and gl.num_warps() == 4))
        wait_prior_grid(PDL)  # before any read of the plan (kernels/hopper/pdl.py)
        gl.static_assert(RANK // GROUP == 4)
        DT: gl.constexpr = q_ptr.dtype.element_ty
        LAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, RANK], DT)
        ROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], DT)
        QLAT_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, RANK], DT)
        QROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, ROPE], DT)
        # P [rows, keys], or P^T [keys, rows] for the keys-on-M consumer
        P_SHAPE: gl.constexpr = [BLOCK_N, BLOCK_M] if KEYS else [BLOCK_M, BLOCK_N]
        P_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for(P_SHAPE, DT)
        PLAIN_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        q_lat_s = gl.allocate_shared_memory(DT, [BLOCK_M, RANK], QLAT_SH)
        q_rope_s = gl.allocate_shared_memory(DT, [BLOCK_M, ROPE], QROPE_SH)
        p_s = gl.allocate_shared_memory(DT, P_SHAPE, P_SH)
        k_lat_s = gl.allocate_shared_memory(DT, [NB, BLOCK_N, RANK], LAT_SH)
        k_rope_s = gl.allocate_shared_memory(DT, [NB, BLOCK_N, ROPE], ROPE_SH)
        sc_s = gl.allocate_shared_memory(gl.float32, [NB, BLOCK_N, RANK // GROUP], PLAIN_SH)
        ready, empty = ring_barriers(NB)
        if KEYS:
            gl.warp_specialize([
                (_w64_keys_consumer, (q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr,
                                      lse_ptr, po_ptr, plse_ptr, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, p_s,
                                      k_lat_s, k_rope_s, ready, empty, RANK, ROPE, BLOCK_M, BLOCK_N, NB)),
                (_w64_producer, (kv_ptr, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride, k_lat_s, k_rope_s,
                                 sc_s, ready, empty, PAGE, RANK, ROPE, GROUP, TOKEN_STRIDE, BLOCK_N, NB, PDL)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])
        else:
            gl.warp_specialize([
                (_w64_consumer, (q_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr,
                                 po_ptr, plse_ptr, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, p_s, k_lat_s,
                                 k_rope_s, ready, empty, RANK, ROPE, BLOCK_M, BLOCK_N, NB, STAGE_OUT, STAGE_PART)),
                (_w64_producer, (kv_ptr, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr, bt_stride, k_lat_s, k_rope_s,
                                 sc_s, ready, empty, PAGE, RANK, ROPE, GROUP, TOKEN_STRIDE, BLOCK_N, NB, PDL)),
            ], [PRODUCER_WARPS], [PRODUCER_REGS])


def launch_decode_wgmma_ws64(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                             split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale_log2: float,
                             rank: int, rope_dim: int, fp8_group: int, block_m: int, block_n: int) -> None:
    """Launch this kernel (arguments as ``decode_split.launch_decode_split``; ``routes.resolve`` has
    admitted the launch). Shapes: q ``[B, s_q, h, rank + rope]`` bf16;
    kv_cache uint8 ``[num_blocks, page, rank + 4 * groups + 2 * rope]``; block_m 64, block_n
    64; the rest as the Triton launcher. Up to ``W64_KEYS_ROWS`` query rows take the keys-on-M
    consumer in ``W64_KEYS_WARPS`` warps (with the producer's beside them), more the 64-row one in 8."""
    B, s_q, h, _ = q.shape
    num_parts = part_info.shape[0] - 1
    m_blocks = -(-(s_q * h) // block_m)
    # up to W64_KEYS_ROWS rows, one row block: the keys-on-M consumer, a 32-row q
    keys = s_q * h <= W64_KEYS_ROWS
    pdl = pdl_on(q)
    _decode_ws64_kernel[(num_parts, m_blocks)](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, block_table.shape[1], partial_o.shape[0], softmax_scale_log2, s_q, h,
        PAGE=kv_cache.shape[1], RANK=rank, ROPE=rope_dim, GROUP=fp8_group, TOKEN_STRIDE=kv_cache.shape[-1],
        BLOCK_M=W64_KEYS_ROWS if keys else block_m, BLOCK_N=block_n, NB=W64_BUFS,
        PRODUCER_WARPS=W64_KEYS_PRODUCER_WARPS if keys else W64_PRODUCER_WARPS,
        PRODUCER_REGS=W64_KEYS_PRODUCER_REGS if keys else W64_PRODUCER_REGS, PDL=pdl, KEYS=keys,
        # (q's latent buffer is what out goes through: of out's dtype)
        STAGE_OUT=not keys and out.dtype == q.dtype and num_parts <= W64_STAGE_OUT_PARTS_PER_REQUEST * B,
        STAGE_PART=(not keys and W64_BUFS == 2 and block_m == block_n and W64_STAGE_PART_PARTS_PER_REQUEST is not None
                    and num_parts >= W64_STAGE_PART_PARTS_PER_REQUEST * B),
        num_warps=W64_KEYS_WARPS if keys else 8, maxnreg=W64_KEYS_MAXNREG if keys else W64_MAXNREG,
        launch_pdl=pdl)
