"""Hopper 16-bit split-KV decode at 64-row blocks with two ping-pong warpgroups (Gluon, GPU only).

Contract, plan, numerics and stores of ``decode_wgmma`` (bf16 / fp16 cache with q of its dtype,
rank 512 + rope 64, 64-row blocks of 64-key tiles), with the work of a tile pair split between
the two warpgroups in time rather than in space (FlashMLA's "seesaw"): each warpgroup is its own
partition (``gl.warp_specialize``).

- Warpgroup A takes a request's even tiles, B the odd ones. Each copies its own tiles
  (``cp.async``) into its own buffer and computes their scores ``S = Q K^T`` over all 64 keys and
  64 rows, so the row max and sum are reductions inside one warpgroup. A tile is copied as two
  commit groups, the owner's latent half first: the scores' dot over that half starts once it has
  landed, the rope's and the other half's once the rest has (``_pp_scores``).
- A holds columns 0-255 of the accumulator, B 256-511: both tiles' ``P V`` reach both halves. A
  tile's owner writes its ``P`` over the tile's rope (dead once its QK is done) with the running
  max it reached and arrives on ``pready``; the other warpgroup rescales and issues its half.
- The running max is one sequence for both, so the softmaxes alternate and each warpgroup's dots
  fill the other's gaps. Each keeps the row sum of its own tiles, rescaled along; the two are
  added once a request (``lready``). A buffer is refilled once both halves of its ``P V`` are
  done (``free``); q is copied by A once B is done with the previous request's (``qready``).

Per pair of tiles (log2 domain; ``r(m) = 0 if m == -inf else m``)::

    A:  m_a = max(m, rowmax S_2j);  P_2j = exp2(S_2j - r(m_a));  l_A = l_A 2^(m - r(m_a)) + rowsum P_2j
        O_L = O_L 2^(m - r(m_a)) + P_2j V_2j[:, :256]
    B:  O_R = O_R 2^(m - r(m_a)) + P_2j V_2j[:, 256:];  l_B = l_B 2^(m - r(m_a))
        m_b = max(m_a, rowmax S_2j+1);  P_2j+1 = exp2(S_2j+1 - r(m_b));  beta = 2^(m_a - r(m_b))
        l_B = l_B beta + rowsum P_2j+1;  O_R = O_R beta + P_2j+1 V_2j+1[:, 256:]
    A:  l_A = l_A beta;  O_L = O_L beta + P_2j+1 V_2j+1[:, :256];  m = m_b

The values of the one-warpgroup online softmax within fp32 rounding (the same powers of two,
the sums grouped otherwise; the split score dots sum in another order: up to one bf16 rounding).

Staged stores (as ``decode_wgmma_ws64``'s): each warpgroup stores an unsplit request's 256
columns of ``out`` through the latent half of its own buffer that only its own dots read, in
16-byte vectors along rows, compiled in where parts can hold whole requests (``num_parts <=
PP_STAGE_OUT_PARTS_PER_REQUEST * B``).

Shared memory: q 72 KiB, two 72 KiB tiles, the hand-overs (1.5 KiB): 217.5 KiB of the H100's
227. Registers: 255 a thread in each partition, no spills -- once the dots' shared-memory
descriptors are kept from being hoisted out of the loops (``_pp_scores``).

The route table (``kernels/routes.py``) gives it 16-bit 64-row blocks on Hopper (h=128) with two
or more row blocks and 16+ (request, row block) pairs; the rest go to ``decode_wgmma``. What
bounds it is the copies (one buffer a warpgroup, no room for a third tile): measurements in
``docs/kernel-performance.md``.
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

from .gluon_parts import (key_rows, program_rows, request_span, row_copy_layout, softmax_rows_step, store_rows_result,
                          tile_page, wait_prior_grid, wgmma_layout)
from .pdl import pdl_on
from ..config import UNSPECIALIZED_DECODE_INTEGERS

__all__ = ["launch_decode_wgmma_pp", "PP_ODD_REGS", "PP_STAGE_OUT_PARTS_PER_REQUEST"]

#: registers a thread of warpgroup B (the worker partition) gets; A gets the rest
PP_ODD_REGS = 240
#: unsplit requests' ``out`` goes through each warpgroup's own buffer in whole rows (module doc,
#: "Staged stores") in launches of at most this many parts a request of the padded batch; 0: never
PP_STAGE_OUT_PARTS_PER_REQUEST = 2

if gluon is not None:
    # The layouts of both partitions (one warpgroup each), for rank 512, 64-key tiles, 64 rows:
    # the dots' results, the four warps splitting the 64 rows
    _S_L = gl.constexpr(wgmma_layout([4, 1], 64))
    _ACC_L = gl.constexpr(wgmma_layout([4, 1], 256))
    # copies: 16-byte vectors along a row of a latent half / of the rope
    _HALF_L = gl.constexpr(row_copy_layout(8, 32, 4))
    _ROPE_L = gl.constexpr(row_copy_layout(8, 8, 4))
    # the rows of a score tile and of the accumulator, the accumulator's columns
    _ROW_S = gl.constexpr(gl.SliceLayout(1, _S_L.value))
    _ROW_A = gl.constexpr(gl.SliceLayout(1, _ACC_L.value))
    _COL_A = gl.constexpr(gl.SliceLayout(0, _ACC_L.value))

    @gluon.jit
    def _pp_request(b, b_first, t_first, j_first, b_end, t_end, seq_ptr, nsplit_ptr, off_ptr, bt_ptr, bt_stride,
                    ctx_ptr, ctx_w, m_s, SQ, H, BLOCK_N: gl.constexpr):
        # Request b of the part, in either partition: ``request_span``'s facts, its block-table
        # row, and the visible context of each of the block's rows ``m_s`` (0 for padding rows)
        b64 = b.to(gl.int64)
        seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr, nsplit_ptr,
                                                      off_ptr, BLOCK_N)
        tok = m_s // H
        ctx = gl.load(ctx_ptr + b64 * ctx_w + tok, mask=(m_s < SQ * H) & (tok < ctx_w) & (t1 > t0), other=0)
        return b64, seq_len, t0, t1, nsplit, p_row, bt_ptr + b64 * bt_stride, ctx

    @gluon.jit
    def _pp_copy_rows(lo_s, hi_s, rope_s, row_at, ok, ok_r, row_at_r, RANK: gl.constexpr, HALF_L: gl.constexpr,
                      ROPE_L: gl.constexpr):
        # cp.async one [rows, RANK + ROPE] block into its two latent halves and its rope:
        # ``row_at`` / ``row_at_r`` the rows' first elements in HALF_L / ROPE_L's row slices,
        # ``ok`` / ``ok_r`` which rows are real (the others land as zeros)
        HALF: gl.constexpr = RANK // 2
        ROPE: gl.constexpr = rope_s.shape[1]
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, HALF_L))
        mask = ok[:, None] & (cols[None, :] < HALF)
        async_copy.async_copy_global_to_shared(lo_s, row_at[:, None] + cols[None, :], mask=mask)
        async_copy.async_copy_global_to_shared(hi_s, row_at[:, None] + HALF + cols[None, :], mask=mask)
        cols_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        async_copy.async_copy_global_to_shared(rope_s, row_at_r[:, None] + RANK + cols_r[None, :],
                                               mask=ok_r[:, None] & (cols_r[None, :] < ROPE))

    @gluon.jit
    def _pp_copy_tile(k_s, kr_s, buf: gl.constexpr, kv_ptr, bt_row, tile, seq_len, page0, PAGE: gl.constexpr,
                      RANK: gl.constexpr, TOKEN_STRIDE: gl.constexpr, BLOCK_N: gl.constexpr, HALF_L: gl.constexpr,
                      ROPE_L: gl.constexpr):
        # A tile's keys into buffer ``buf`` (k_s[2 buf], k_s[2 buf + 1], kr_s[buf]) as two commit
        # groups: the buffer owner's latent half (k_s[3 buf], columns 256 buf + [0, 256)), then
        # the other half and the rope, so that ``_pp_scores`` can start on the first while the
        # second lands. Keys past seq_len land as zeros (a NaN-poisoned stale slot never reaches
        # a dot). Their cache rows: in page ``page0`` (``tile_page``) when a page holds whole
        # tiles, else each key's through the block table
        HALF: gl.constexpr = RANK // 2
        ROPE: gl.constexpr = kr_s.shape[2]
        offs = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, HALF_L))
        ok = offs < seq_len
        rows = key_rows(kv_ptr, bt_row, offs, ok, page0, PAGE, BLOCK_N, TOKEN_STRIDE)
        cols = gl.arange(0, HALF, layout=gl.SliceLayout(0, HALF_L))
        mask = ok[:, None] & (cols[None, :] < HALF)
        async_copy.async_copy_global_to_shared(k_s.index(3 * buf), rows[:, None] + buf * HALF + cols[None, :],
                                               mask=mask)
        async_copy.commit_group()
        async_copy.async_copy_global_to_shared(k_s.index(buf + 1), rows[:, None] + (1 - buf) * HALF + cols[None, :],
                                               mask=mask)
        offs_r = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ROPE_L))
        ok_r = offs_r < seq_len
        rows_r = key_rows(kv_ptr, bt_row, offs_r, ok_r, page0, PAGE, BLOCK_N, TOKEN_STRIDE)
        cols_r = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        async_copy.async_copy_global_to_shared(kr_s.index(buf), rows_r[:, None] + RANK + cols_r[None, :],
                                               mask=ok_r[:, None] & (cols_r[None, :] < ROPE))
        async_copy.commit_group()

    @gluon.jit
    def _pp_scores(q_lat_s, q_rope_s, kr_s, k_s, buf, z, S_L: gl.constexpr):
        # Issue S = Q K^T for the tile in buffer ``buf``, the last this thread copied
        # (``_pp_copy_tile``'s two groups): the owner's latent half once the first group has
        # landed, the rope and the other half once the second has, so the first dot runs while
        # the rest of the tile arrives. ``buf`` and ``z`` (0) are run-time values that change
        # every trip: with loop-invariant indices the compiler hoists the dots' shared-memory
        # descriptors (two 64-bit words a 16-deep k step, 36 steps for QK alone) out of the
        # loops, and they spill
        async_copy.wait_group(1)
        fence_async_shared()
        gl.thread_barrier()
        s = gl.full([q_lat_s.shape[1], k_s.shape[1]], 0.0, gl.float32, S_L)
        s = warpgroup_mma(q_lat_s.index(buf), k_s.index(3 * buf).permute((1, 0)), s, use_acc=False, is_async=True)
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        s = warpgroup_mma(q_rope_s.index(z), kr_s.index(buf).permute((1, 0)), s, is_async=True)
        return warpgroup_mma(q_lat_s.index(1 - buf), k_s.index(buf + 1).permute((1, 0)), s, is_async=True)

    @gluon.jit
    def _pp_hand_over(p, m_i, kr_s, mx_s, buf, pready):
        # P (over its tile's rope; every warp's QK is done with it) and the row max it was
        # taken against, to the other warpgroup's dots (async proxy) and loads
        mx_s.index(buf).store(m_i)
        gl.thread_barrier()
        kr_s.index(buf).store(p.to(kr_s.dtype))
        fence_async_shared()
        gl.thread_barrier()
        mbarrier.arrive(pready.index(buf))

    @gluon.jit
    def _pp_rescale_to(m_i, l_i, acc, mx_s, buf, ROW_S: gl.constexpr, ROW_A: gl.constexpr):
        # Move the running sum and accumulator (done) from max m_i to the other warpgroup's
        # new max (mx_s[buf], >= m_i): returns (m_new, l, acc) as tensors
        m_new = mx_s.index(buf).load(ROW_S)
        f = gl.exp2(m_i - gl.where(m_new == float("-inf"), 0.0, m_new))
        return m_new, l_i * f, acc * gl.convert_layout(f, ROW_A)[:, None]

    @gluon.jit
    def _pp_finish(acc, m_i, l_i, lx_s, lready, me: gl.constexpr, nreq, col0, row0, b64, nsplit, p_row,
                   partial_cap, out_ptr, lse_ptr, po_ptr, plse_ptr, ROWS, SQ, H, BLOCK_M: gl.constexpr,
                   RANK: gl.constexpr, ROW_S: gl.constexpr, ROW_A: gl.constexpr, COL_A: gl.constexpr, stage,
                   STAGED: gl.constexpr):
        # A request's end in one warpgroup: hand its row sums over (double-buffered by request
        # parity, so a warpgroup a request ahead never overwrites sums not yet read), add the
        # other's, store its 256 columns (both store the same lse). STAGED: an unsplit request's
        # out goes through ``stage``, the latent half of its own buffer that only its own dots
        # read (A: buffer 0's columns 0-255, B: buffer 1's 256-511), all done by now; its next
        # copy into that buffer waits for the barrier after ("Staged stores")
        slot = 2 * (nreq % 2)
        lx_s.index(slot + me).store(l_i)
        gl.thread_barrier()
        mbarrier.arrive(lready.index(me))
        mbarrier.wait(lready.index(1 - me), nreq & 1)
        l_tot = l_i + lx_s.index(slot + 1 - me).load(ROW_S)
        store_rows_result(acc, m_i, l_tot, row0, b64, nsplit, p_row, partial_cap, out_ptr + col0, lse_ptr,
                          po_ptr + col0, plse_ptr, ROWS, SQ, H, BLOCK_M, RANK, ROW_S, ROW_A, COL_A, stage, _HALF_L,
                          STAGED)
        if STAGED:
            gl.thread_barrier()

    @gluon.jit
    def _pp_even(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr,
                 po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, k_s, kr_s, mx_s, lx_s,
                 pready, free, qready, lready, PAGE: gl.constexpr, RANK: gl.constexpr, TOKEN_STRIDE: gl.constexpr,
                 BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGE_OUT: gl.constexpr):
        D: gl.constexpr = RANK + kr_s.shape[2]
        ROWS = SQ * H
        b_first, t_first, j_first, b_end, t_end, b_last, row0, ctx_w, m_s, n_s = program_rows(
            part_ptr, ctxw_ptr, BLOCK_M, BLOCK_N, _S_L)
        ka = 0  # A's tiles so far (the free[0] phases), and B's (the pready[1] phases)
        kb = 0
        nreq = 0
        for b in range(b_first, b_last + 1):
            b64, seq_len, t0, t1, nsplit, p_row, bt_row, ctx = _pp_request(
                b, b_first, t_first, j_first, b_end, t_end, seq_ptr, nsplit_ptr, off_ptr, bt_ptr, bt_stride, ctx_ptr,
                ctx_w, m_s, SQ, H, BLOCK_N)
            if t1 > t0:
                # q (B handed its sums of the last request over: done with that q), then tile t0
                # into buffer 0 once B is done with the last tile there
                rows_q = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _HALF_L))
                rows_qr = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, _ROPE_L))
                q_row = q_ptr + b64 * (ROWS * D)
                _pp_copy_rows(q_lat_s.index(0), q_lat_s.index(1), q_rope_s.index(0), q_row + rows_q.to(gl.int64) * D,
                              rows_q < ROWS, rows_qr < ROWS, q_row + rows_qr.to(gl.int64) * D, RANK, _HALF_L, _ROPE_L)
                async_copy.commit_group()
                mbarrier.wait(free.index(0), (ka & 1) ^ 1)
                _pp_copy_tile(k_s, kr_s, 0, kv_ptr, bt_row, t0, seq_len, tile_page(bt_row, t0, t1, PAGE, BLOCK_N),
                              PAGE, RANK, TOKEN_STRIDE, BLOCK_N, _HALF_L,
                              _ROPE_L)
                async_copy.wait_group(2)  # q (the tile's two groups may be in flight)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(qready.index(0))

                m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, _ROW_S)
                l_i = gl.full([BLOCK_M], 0.0, gl.float32, _ROW_S)
                acc = warpgroup_mma_init(gl.full([BLOCK_M, RANK // 2], 0.0, gl.float32, _ACC_L))
                for j in range(0, (t1 - t0 + 1) // 2):
                    tile = t0 + 2 * j
                    z = (tile < 0).to(gl.int32)  # 0, opaque to the compiler (see _pp_scores)
                    pg_next = tile_page(bt_row, tile + 2, t1, PAGE, BLOCK_N)
                    # the last pair's P_2j-1 V dot is done in every warp: buffer 1 back to B
                    acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                    if j > 0:
                        gl.thread_barrier()
                        mbarrier.arrive(free.index(1))
                    s = _pp_scores(q_lat_s, q_rope_s, kr_s, k_s, z, z, _S_L)
                    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
                    p, alpha, m_i, l_i = softmax_rows_step(s * qk_scale, m_i, l_i, ctx, tile * BLOCK_N + n_s, seq_len)
                    _pp_hand_over(p, m_i, kr_s, mx_s, z, pready)
                    acc = acc * gl.convert_layout(alpha, _ROW_A)[:, None]
                    acc = warpgroup_mma(kr_s.index(z), k_s.index(z), acc, is_async=True)
                    ka += 1
                    if tile + 1 < t1:
                        # B's tile 2j + 1: its P and max, then this half of its P V
                        mbarrier.wait(pready.index(1), kb & 1)
                        kb += 1
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                        m_i, l_i, acc = _pp_rescale_to(m_i, l_i, acc, mx_s, z + 1, _ROW_S, _ROW_A)
                        acc = warpgroup_mma(kr_s.index(z + 1), k_s.index(z + 2), acc, is_async=True)
                        if tile + 2 < t1:
                            # the next own tile, once B is done with this one's buffer
                            mbarrier.wait(free.index(0), (ka & 1) ^ 1)
                            _pp_copy_tile(k_s, kr_s, 0, kv_ptr, bt_row, tile + 2, seq_len, pg_next, PAGE, RANK,
                                          TOKEN_STRIDE, BLOCK_N, _HALF_L, _ROPE_L)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                if (t1 - t0) % 2 == 0:
                    gl.thread_barrier()
                    mbarrier.arrive(free.index(1))
                _pp_finish(acc, m_i, l_i, lx_s, lready, 0, nreq, 0, row0, b64, nsplit, p_row, partial_cap, out_ptr,
                           lse_ptr, po_ptr, plse_ptr, ROWS, SQ, H, BLOCK_M, RANK, _ROW_S, _ROW_A, _COL_A, k_s.index(0),
                           STAGE_OUT)
                nreq += 1

    @gluon.jit
    def _pp_odd(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr, lse_ptr,
                po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, k_s, kr_s, mx_s, lx_s,
                pready, free, qready, lready, PAGE: gl.constexpr, RANK: gl.constexpr, TOKEN_STRIDE: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGE_OUT: gl.constexpr, PDL: gl.constexpr):
        wait_prior_grid(PDL)  # this partition's warps too (kernels/hopper/pdl.py)
        HALF: gl.constexpr = RANK // 2
        ROWS = SQ * H
        b_first, t_first, j_first, b_end, t_end, b_last, row0, ctx_w, m_s, n_s = program_rows(
            part_ptr, ctxw_ptr, BLOCK_M, BLOCK_N, _S_L)
        ka = 0  # A's tiles so far (the pready[0] phases), and B's (the free[1] phases)
        kb = 0
        nreq = 0
        for b in range(b_first, b_last + 1):
            b64, seq_len, t0, t1, nsplit, p_row, bt_row, ctx = _pp_request(
                b, b_first, t_first, j_first, b_end, t_end, seq_ptr, nsplit_ptr, off_ptr, bt_ptr, bt_stride, ctx_ptr,
                ctx_w, m_s, SQ, H, BLOCK_N)
            if t1 > t0:
                if t0 + 1 < t1:
                    mbarrier.wait(free.index(1), (kb & 1) ^ 1)
                    _pp_copy_tile(k_s, kr_s, 1, kv_ptr, bt_row, t0 + 1, seq_len,
                                  tile_page(bt_row, t0 + 1, t1, PAGE, BLOCK_N), PAGE, RANK, TOKEN_STRIDE, BLOCK_N,
                                  _HALF_L, _ROPE_L)
                mbarrier.wait(qready.index(0), nreq & 1)

                m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, _ROW_S)
                l_i = gl.full([BLOCK_M], 0.0, gl.float32, _ROW_S)
                acc = warpgroup_mma_init(gl.full([BLOCK_M, HALF], 0.0, gl.float32, _ACC_L))
                for j in range(0, (t1 - t0 + 1) // 2):
                    tile = t0 + 2 * j + 1
                    z = (tile < 0).to(gl.int32)  # 0, opaque to the compiler (see _pp_scores)
                    pg_next = tile_page(bt_row, tile + 2, t1, PAGE, BLOCK_N)
                    if tile < t1:
                        # the last pair's P V dot is done
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                        # own QK runs while A's softmax does
                        s = _pp_scores(q_lat_s, q_rope_s, kr_s, k_s, z + 1, z, _S_L)
                        mbarrier.wait(pready.index(0), ka & 1)
                        ka += 1
                        m_i, l_i, acc = _pp_rescale_to(m_i, l_i, acc, mx_s, z, _ROW_S, _ROW_A)
                        acc = warpgroup_mma(kr_s.index(z), k_s.index(z + 1), acc, is_async=True)
                        # the QK (issued before that P V) is done
                        s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
                        p, beta, m_i, l_i = softmax_rows_step(s * qk_scale, m_i, l_i, ctx, tile * BLOCK_N + n_s,
                                                              seq_len)
                        _pp_hand_over(p, m_i, kr_s, mx_s, z + 1, pready)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                        gl.thread_barrier()
                        mbarrier.arrive(free.index(0))
                        acc = acc * gl.convert_layout(beta, _ROW_A)[:, None]
                        acc = warpgroup_mma(kr_s.index(z + 1), k_s.index(z + 3), acc, is_async=True)
                        kb += 1
                        if tile + 2 < t1:
                            # the next own tile, once both halves of this one's P V are done
                            acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                            mbarrier.wait(free.index(1), (kb & 1) ^ 1)
                            _pp_copy_tile(k_s, kr_s, 1, kv_ptr, bt_row, tile + 2, seq_len, pg_next, PAGE, RANK,
                                          TOKEN_STRIDE, BLOCK_N, _HALF_L, _ROPE_L)
                            acc = warpgroup_mma_init(acc)
                    else:
                        # the request's last tile is A's: only this half of its P V
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                        mbarrier.wait(pready.index(0), ka & 1)
                        ka += 1
                        m_i, l_i, acc = _pp_rescale_to(m_i, l_i, acc, mx_s, z, _ROW_S, _ROW_A)
                        acc = warpgroup_mma(kr_s.index(z), k_s.index(z + 1), acc, is_async=True)
                        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                        gl.thread_barrier()
                        mbarrier.arrive(free.index(0))
                        acc = warpgroup_mma_init(acc)
                acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc, ))
                _pp_finish(acc, m_i, l_i, lx_s, lready, 1, nreq, HALF, row0, b64, nsplit, p_row, partial_cap,
                           out_ptr, lse_ptr, po_ptr, plse_ptr, ROWS, SQ, H, BLOCK_M, RANK, _ROW_S, _ROW_A, _COL_A,
                           k_s.index(3), STAGE_OUT)
                nreq += 1

    @gluon.jit(do_not_specialize=UNSPECIALIZED_DECODE_INTEGERS)
    def _decode_pp_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr,
                          lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H, PAGE: gl.constexpr,
                          RANK: gl.constexpr, ROPE: gl.constexpr, TOKEN_STRIDE: gl.constexpr, BLOCK_M: gl.constexpr,
                          BLOCK_N: gl.constexpr, ODD_REGS: gl.constexpr, STAGE_OUT: gl.constexpr, PDL: gl.constexpr):
        gl.static_assert(BLOCK_M == 64)
        gl.static_assert(BLOCK_N == 64)
        gl.static_assert(ROPE == 64)
        gl.static_assert(RANK == 512)
        gl.static_assert(gl.num_warps() == 4)
        wait_prior_grid(PDL)  # before any read of the plan (kernels/hopper/pdl.py)
        DT: gl.constexpr = q_ptr.dtype.element_ty
        HALF: gl.constexpr = RANK // 2
        HALF_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, HALF], DT)
        ROPE_SH: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, ROPE], DT)
        ROWS_SH: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
        # q: latent columns 0-255 ([0]) and 256-511 ([1]), the rope
        q_lat_s = gl.allocate_shared_memory(DT, [2, BLOCK_M, HALF], HALF_SH)
        q_rope_s = gl.allocate_shared_memory(DT, [1, BLOCK_M, ROPE], ROPE_SH)
        # tiles: buffer t's latent halves k_s[2t], k_s[2t + 1], its rope (then its P) kr_s[t]
        k_s = gl.allocate_shared_memory(DT, [4, BLOCK_N, HALF], HALF_SH)
        kr_s = gl.allocate_shared_memory(DT, [2, BLOCK_N, ROPE], ROPE_SH)
        mx_s = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M], ROWS_SH)
        lx_s = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M], ROWS_SH)
        pready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        lready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        qready = gl.allocate_shared_memory(gl.int64, [1, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(2):
            mbarrier.init(pready.index(i), count=1)
            mbarrier.init(free.index(i), count=1)
            mbarrier.init(lready.index(i), count=1)
        mbarrier.init(qready.index(0), count=1)
        # (the argument tuples written out in the call: a tuple bound to a name first would turn
        # the constexprs in it into tensors)
        gl.warp_specialize([
            (_pp_even, (q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr,
                        lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, k_s,
                        kr_s, mx_s, lx_s, pready, free, qready, lready, PAGE, RANK, TOKEN_STRIDE, BLOCK_M, BLOCK_N,
                        STAGE_OUT)),
            (_pp_odd, (q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr, out_ptr,
                       lse_ptr, po_ptr, plse_ptr, bt_stride, partial_cap, qk_scale, SQ, H, q_lat_s, q_rope_s, k_s,
                       kr_s, mx_s, lx_s, pready, free, qready, lready, PAGE, RANK, TOKEN_STRIDE, BLOCK_M, BLOCK_N,
                       STAGE_OUT, PDL)),
        ], [4], [ODD_REGS])


def launch_decode_wgmma_pp(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                           split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale_log2: float, rank: int,
                           rope_dim: int, block_m: int, block_n: int, fp8_group: int = 0) -> None:
    """Launch this kernel (arguments as ``decode_split.launch_decode_split``; ``routes.resolve`` has
    admitted the launch). Shapes: q ``[B, s_q, h, rank + rope]`` bf16 / fp16;
    kv_cache ``[num_blocks, page, rank + rope]`` of q's dtype; block_m 64, block_n 64; the rest
    as the Triton launcher (``fp8_group`` is not used: no FP8 here)."""
    B, s_q, h, _ = q.shape
    num_parts = part_info.shape[0] - 1
    m_blocks = -(-(s_q * h) // block_m)
    pdl = pdl_on(q)
    _decode_pp_kernel[(num_parts, m_blocks)](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, block_table.shape[1], partial_o.shape[0], softmax_scale_log2, s_q, h,
        PAGE=kv_cache.shape[1], RANK=rank, ROPE=rope_dim, TOKEN_STRIDE=kv_cache.shape[-1], BLOCK_M=block_m,
        BLOCK_N=block_n, ODD_REGS=PP_ODD_REGS,
        STAGE_OUT=out.dtype == q.dtype and num_parts <= PP_STAGE_OUT_PARTS_PER_REQUEST * B, PDL=pdl, num_warps=4,
        launch_pdl=pdl)
