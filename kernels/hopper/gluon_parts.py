"""Pieces shared by the Gluon decode kernels of ``kernels/hopper/``.

The planner (``kernels/planner.py``) writes ``part_info`` ``[num_parts + 1, 3]`` int32: part
``p`` covers the key tiles from row ``p``'s ``(request, tile, piece)`` to row ``p + 1``'s.
A decode program walks the requests of its part and, for each, needs the tiles it owns, the
request's piece count and the row of its fp32 partial (``part_bounds``, ``request_span``,
``program_rows``; a TMA producer's walk, ``tma_tile_walk``). The Triton kernels inline these
lines (under the interpreter a nested jit call costs more than the lines); the Gluon kernels,
GPU-only, share them here.

- keys on the wgmma M axis (``decode_wgmma_rs``, ``decode_wgmma_ws``, ``decode_wgmma_kt``, the
  keys-on-M consumer of ``decode_wgmma_ws64``: scores ``S^T [keys, rows]``, accumulator ``acc^T
  [512, rows]``): q's conversion to fp16 (``q_rows_to_fp16``), the online-softmax step down the
  key axis (``softmax_keys_step``) and the stores (``store_keys_result``, ``store_keys_part``,
  ``store_keys_lse``); q's rope copy (``copy_q_rope_now``);
- the query rows on the M axis (``decode_wgmma``, ``decode_wgmma_ws64``, ``decode_wgmma_pp``:
  scores ``S [64, keys]``, accumulator ``[64, 512]``): q's copy (``copy_q_rows``,
  ``start_request_rows``), a tile's dots and softmax step (``rows_tile_step`` over
  ``softmax_rows_step``), the stores (``store_rows_result``; through a free shared buffer in
  whole rows, ``store_out_staged`` / ``store_part_staged``); a tile's cache rows, its page read
  ahead when a page holds whole tiles (``tile_page``, ``key_rows``);
- every kernel: register layouts (``row_copy_layout``: 16-byte vectors along rows;
  ``wgmma_layout``), an mbarrier ring (``ring_barriers``), the end of a row's softmax
  (``softmax_result``: a row without keys gets ``out`` 0 and ``lse`` -inf), the wait of a
  launch with programmatic dependent launch (``wait_prior_grid``, ``kernels/hopper/pdl.py``), and
  the e4m3 -> fp16 conversion of a 32-bit word (``E4M3X4_TO_F16_ASM``).

Moving the kernels' shared lines here left their SASS unchanged (sm_90, Triton 3.6).
"""
from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy
    from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, warpgroup_mma,
                                                                  warpgroup_mma_wait)
except Exception:  # pragma: no cover - a Triton without Gluon: the Triton kernels only
    gluon = None

__all__ = ["E4M3X4_TO_F16_ASM", "row_copy_layout", "wgmma_layout", "wait_prior_grid", "ring_barriers", "rows_tile_step", "part_bounds",
           "program_rows", "request_span", "tma_tile_walk", "tile_page", "key_rows", "q_rows_to_fp16",
           "copy_q_rope_now", "softmax_keys_step", "softmax_result", "store_keys_result", "store_keys_part",
           "store_keys_lse", "copy_q_rows", "start_request_rows", "store_out_staged", "softmax_rows_step",
           "store_rows_result"]

if gluon is not None:

    #: ``gl.inline_asm_elementwise`` text: e4m3 x4 (one 32-bit word, little-endian: byte k is the
    #: k-th code, input $4) -> four fp16 (outputs $0-$3), exactly (fp16 holds every finite e4m3 value)
    E4M3X4_TO_F16_ASM = gl.constexpr("""
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

    @gluon.constexpr_function
    def row_copy_layout(vec, row_threads, warps):
        """The register layout of a tile copied in ``vec``-element vectors along its rows (16
        bytes each): ``row_threads`` threads of a warp side by side along a row (so ``32 //
        row_threads`` rows a warp), ``warps`` warps stacked down the rows, row-major."""
        return gl.BlockedLayout(size_per_thread=[1, vec], threads_per_warp=[32 // row_threads, row_threads],
                                warps_per_cta=[warps, 1], order=[1, 0])

    @gluon.constexpr_function
    def wgmma_layout(warps_per_cta, n):
        """The layout of a wgmma result spread over ``warps_per_cta`` (``[along M, along N]``),
        each warpgroup's instructions ``n`` columns wide."""
        return gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=warps_per_cta, instr_shape=[16, n, 16])

    @gluon.jit
    def wait_prior_grid(PDL: gl.constexpr):
        """With ``PDL`` (the launch used programmatic dependent launch, ``kernels/hopper/pdl.py``): wait
        until the previous grid in the stream has completed and its writes are visible. Every
        thread that reads or writes what an earlier kernel touched executes it first."""
        if PDL:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                                      pack=1)

    @gluon.jit
    def ring_barriers(NB: gl.constexpr, EMPTY_ARRIVALS: gl.constexpr = 1):
        """A producer / consumer ring's mbarriers: ``ready`` and ``empty``, ``[NB, 1]`` int64 each,
        one a buffer, initialised (``ready`` completed by one arrival, ``empty`` by
        ``EMPTY_ARRIVALS``: one per consumer warpgroup that frees a buffer)."""
        ready = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [NB, 1], mbarrier.MBarrierLayout())
        for i in gl.static_range(NB):
            mbarrier.init(ready.index(i), count=1)
            mbarrier.init(empty.index(i), count=EMPTY_ARRIVALS)
        return ready, empty

    @gluon.jit
    def part_bounds(part_ptr, pid_p):
        """Part ``pid_p``'s bounds from ``part_info`` (int32 ``[num_parts + 1, 3]``): its first
        request, tile and piece (``b_first, t_first, j_first``), the end row's request and tile
        (``b_end, t_end``) and the last request it touches (``b_last``); int32 scalars."""
        b_first = gl.load(part_ptr + pid_p * 3 + 0)
        t_first = gl.load(part_ptr + pid_p * 3 + 1)
        j_first = gl.load(part_ptr + pid_p * 3 + 2)
        b_end = gl.load(part_ptr + (pid_p + 1) * 3 + 0)
        t_end = gl.load(part_ptr + (pid_p + 1) * 3 + 1)
        # an end at tile 0 of b_end leaves b_end to the next part
        b_last = gl.where(t_end > 0, b_end, b_end - 1)
        return b_first, t_first, j_first, b_end, t_end, b_last

    @gluon.jit
    def program_rows(part_ptr, ctxw_ptr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, S_L: gl.constexpr):
        """What a 64-row kernel's program (part ``program_id(0)``, row block ``program_id(1)``)
        needs first: its part's bounds (``part_bounds``), the row block's first row ``row0``, the
        context-lens width ``ctx_w`` (``ctxw_ptr``: int32 ``[1]``), and its rows ``m_s`` and a
        tile's keys ``n_s`` (``arange(BLOCK_N)``) in the score layout ``S_L``'s slices. Returns
        ``(b_first, t_first, j_first, b_end, t_end, b_last, row0, ctx_w, m_s, n_s)``."""
        b_first, t_first, j_first, b_end, t_end, b_last = part_bounds(part_ptr, gl.program_id(0))
        row0 = gl.program_id(1) * BLOCK_M
        ctx_w = gl.load(ctxw_ptr)
        m_s = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, S_L))
        n_s = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, S_L))
        return b_first, t_first, j_first, b_end, t_end, b_last, row0, ctx_w, m_s, n_s

    @gluon.jit
    def request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr, nsplit_ptr, off_ptr,
                     BLOCK_N: gl.constexpr):
        """For request ``b`` of a part (bounds from ``part_bounds``): its key count
        (``seq_ptr``: int32 ``[B]``), the part's tiles ``[t0, t1)`` of it (``BLOCK_N`` keys each;
        empty when ``t1 <= t0``), its piece count (``nsplit_ptr``: int32 ``[B]``) and the
        partial-buffer row of this piece (``off_ptr``: int32 ``[B]``, plus the piece index);
        int32 scalars."""
        seq_len = gl.load(seq_ptr + b)
        n_tiles = (gl.maximum(seq_len, 0) + BLOCK_N - 1) // BLOCK_N
        t0 = gl.where(b == b_first, t_first, 0)
        t1 = gl.where(b == b_end, t_end, n_tiles)
        nsplit = gl.load(nsplit_ptr + b)
        p_row = gl.load(off_ptr + b) + gl.where(b == b_first, j_first, 0)
        return seq_len, t0, t1, nsplit, p_row

    @gluon.jit
    def tma_tile_walk(copy_boxes: gl.constexpr, descs, bufs, bt_ptr, seq_ptr, part_ptr, nsplit_ptr, off_ptr,
                      bt_stride, ready, empty, TILE_BYTES: gl.constexpr, SUB: gl.constexpr, PAGE: gl.constexpr,
                      BLOCK_N: gl.constexpr, NS: gl.constexpr):
        """The walk of a TMA producer (one warp) over the key tiles of its part (``program_id(0)``;
        ``part_bounds``, ``request_span``) into a ring of ``NS`` stages with an mbarrier pair each
        (``ready`` / ``empty``: int64 ``[NS, 1]``). Per tile: waits for its stage ``s`` to be free,
        expects ``TILE_BYTES`` on ``ready[s]``, and for each box of ``SUB`` keys -- one a page where
        a page holds fewer than ``BLOCK_N`` keys, else the tile -- calls ``copy_boxes(descs, bufs,
        row, ready[s], s, r0, NS)`` to issue the copies of cache rows ``[row, row + SUB)`` into rows
        ``[r0, r0 + SUB)`` of stage ``s`` (``descs`` / ``bufs``: the kernel's TMA descriptors and
        shared buffers, tuples). Rows are ``page * PAGE + key % PAGE`` through the request's
        block-table row (``bt_ptr``, ``bt_stride``); a page holding whole tiles is read a tile
        ahead, off the copies' path; a box past the request's keys copies page 0's rows, which the
        consumer must mask."""
        b_first, t_first, j_first, b_end, t_end, b_last = part_bounds(part_ptr, gl.program_id(0))
        it = 0
        for b in range(b_first, b_last + 1):
            seq_len, t0, t1, nsplit, p_row = request_span(b, b_first, t_first, j_first, b_end, t_end, seq_ptr,
                                                          nsplit_ptr, off_ptr, BLOCK_N)
            bt_row = bt_ptr + b.to(gl.int64) * bt_stride
            pg = gl.load(bt_row + (t0 * BLOCK_N) // PAGE, mask=(t0 < t1) & (SUB == BLOCK_N), other=0)
            for tile in range(t0, t1):
                s = it % NS
                key0 = tile * BLOCK_N
                if SUB == BLOCK_N:
                    page = pg
                    pg = gl.load(bt_row + (key0 + BLOCK_N) // PAGE, mask=tile + 1 < t1, other=0)
                mbarrier.wait(empty.index(s), ((it // NS) & 1) ^ 1)
                mbarrier.expect(ready.index(s), TILE_BYTES)
                for j in gl.static_range(BLOCK_N // SUB):
                    key = key0 + j * SUB
                    if SUB < BLOCK_N:
                        page = gl.load(bt_row + key // PAGE, mask=key < seq_len, other=0)
                    copy_boxes(descs, bufs, page * PAGE + key % PAGE, ready.index(s), s, j * SUB, NS)
                it += 1

    @gluon.jit
    def tile_page(bt_row, tile, t1, PAGE: gl.constexpr, BLOCK_N: gl.constexpr):
        """The cache page holding key tile ``tile`` (``BLOCK_N`` keys) when a page holds whole
        tiles (``PAGE`` a multiple of ``BLOCK_N``), read from the request's block-table row
        ``bt_row`` (0 for ``tile >= t1``); else 0, unused. An int32 scalar a kernel loads a tile
        or two ahead of the tile's copies, so that the block-table read's latency stays off
        their path (``key_rows``)."""
        if PAGE % BLOCK_N == 0:
            page0 = gl.load(bt_row + (tile * BLOCK_N) // PAGE, mask=tile < t1, other=0)
        else:
            page0 = tile * 0
        return page0

    @gluon.jit
    def key_rows(kv_ptr, bt_row, offs_n, ok, page0, PAGE: gl.constexpr, BLOCK_N: gl.constexpr,
                 TOKEN_STRIDE: gl.constexpr):
        """Pointers to the cache rows (``kv_ptr``: ``[num_blocks, PAGE, TOKEN_STRIDE]``, any
        element type) of the keys ``offs_n`` (``[BLOCK_N]`` int32 positions of one tile, in any
        layout; ``ok`` the real ones): in page ``page0`` (``tile_page``'s, loaded ahead) when a
        page holds whole tiles -- a scalar base and 32-bit offsets -- else each key's page
        through the block-table row ``bt_row``."""
        if PAGE % BLOCK_N == 0:
            rows = kv_ptr + page0.to(gl.int64) * (PAGE * TOKEN_STRIDE) + (offs_n % PAGE) * TOKEN_STRIDE
        else:
            page = gl.load(bt_row + offs_n // PAGE, mask=ok, other=0)
            rows = kv_ptr + (page.to(gl.int64) * PAGE + offs_n % PAGE) * TOKEN_STRIDE
        return rows

    @gluon.jit
    def q_rows_to_fp16(q_at, q_ok, q_lat_s):
        """q's latent ``[R, RANK]`` (pointers ``q_at`` / mask ``q_ok``, bf16) into ``q_lat_s`` as
        fp16, each row times a power of two ``qs = 2**k``, ``k <= 0``, that brings its max |q|
        under 2**15 (``decode_split`` module doc, "FP16 dots"): ``k = min(0, 14 - E)``, E the
        exponent of the row max from the fp32 bits (a NaN or inf row: E = 128; a zero or
        padding row: k = 0). Returns ``qs`` (fp32 ``[R]``, the rows' slice of the load layout)."""
        q = gl.load(q_at, mask=q_ok, other=0.0).to(gl.float32)
        bits = gl.max(q.to(gl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
        k = gl.minimum(0, 14 - ((bits >> 23) - 127))
        qs = gl.exp2(k.to(gl.float32))
        q_lat_s.store((q * qs[:, None]).to(gl.float16))
        return qs

    @gluon.jit
    def copy_q_rope_now(q_rope_s, q_row, r_rope, c_rope, ROWS, RANK: gl.constexpr):
        """Copy a request's q rope into ``q_rope_s`` (``[R, ROPE]``, 16-bit) and wait until it has
        landed and is visible to the dots of every warp of the partition: ``q_row`` points at the
        request's q (``[ROWS, RANK + ROPE]``), ``r_rope`` / ``c_rope`` are the block's rows
        (``row0 + arange(R)``) / ``arange(ROPE)`` in the row / column slices of the copy's layout;
        rows at or past ``ROWS`` (padding) land as zeros. ``cp.async``, with every earlier group of the thread
        waited for too."""
        ROPE: gl.constexpr = q_rope_s.shape[1]
        async_copy.async_copy_global_to_shared(
            q_rope_s, q_row + r_rope.to(gl.int64)[:, None] * (RANK + ROPE) + RANK + c_rope[None, :],
            mask=(r_rope < ROWS)[:, None] & (c_rope[None, :] < ROPE))
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()

    @gluon.jit
    def softmax_keys_step(s, m_i, l_p, ctx, offs_n, seq_len):
        """One tile of the online softmax down the key axis of ``S^T`` (fp32 ``[keys, R]``,
        already times ``softmax_scale * log2(e)``): keys ``offs_n`` (``[keys]``) past ``seq_len``
        or, per query row, past its context ``ctx`` (``[R]``) are masked; ``m_i`` (``[R]``) the
        running max, ``l_p`` (``[keys, R]``) the running sums kept per key slot (reduced once,
        after the loop). Returns ``(p, alpha, m_new, l_p)``: ``p = exp2(S - m_new)`` and the
        factor ``alpha`` (``[R]``) by which the accumulator is to be rescaled."""
        visible = (offs_n[:, None] < ctx[None, :]) & (offs_n < seq_len)[:, None]
        s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_ref)
        p = gl.exp2(s - m_ref[None, :])
        l_p = l_p * alpha[None, :] + p
        return p, alpha, m_new, l_p

    @gluon.jit
    def store_keys_result(a0, a1, a2, a3, inv_l, lse2, r, c, b64, nsplit, p_row, partial_cap, out_ptr, lse_ptr,
                          po_ptr, plse_ptr, ROWS, SQ, H, RANK: gl.constexpr, GROUP: gl.constexpr):
        """A request's result from the four group parts ``a*`` of ``acc^T`` (fp32 ``[GROUP, R]``,
        rows ``r`` = ``token * H + head``, columns ``c`` within a group), times ``inv_l``
        (``[R]``), with its log2-sum-exp ``lse2``: an unsplit request (``nsplit == 1``) stores
        ``out`` (its dtype, ``[B, s_q, h, RANK]``) and ``lse`` (natural log, ``[B, h, s_q]``); a
        split one its fp32 partial row ``p_row`` (``[cap, ROWS, RANK]``, log2 lse ``[cap, ROWS]``)
        while ``p_row < partial_cap``."""
        LN2: gl.constexpr = 0.6931471805599453
        row_ok = r < ROWS
        ok_o = (c[:, None] < GROUP) & row_ok[None, :]
        at = r.to(gl.int64)[None, :] * RANK + c[:, None]
        if nsplit == 1:
            o_at = out_ptr + b64 * (ROWS * RANK) + at
            OT: gl.constexpr = out_ptr.dtype.element_ty
            gl.store(o_at, (a0 * inv_l[None, :]).to(OT), mask=ok_o)
            gl.store(o_at + GROUP, (a1 * inv_l[None, :]).to(OT), mask=ok_o)
            gl.store(o_at + 2 * GROUP, (a2 * inv_l[None, :]).to(OT), mask=ok_o)
            gl.store(o_at + 3 * GROUP, (a3 * inv_l[None, :]).to(OT), mask=ok_o)
            gl.store(lse_ptr + b64 * ROWS + (r % H) * SQ + r // H, lse2 * LN2, mask=row_ok)
        elif p_row < partial_cap:
            p64 = p_row.to(gl.int64)
            o_at = po_ptr + p64 * (ROWS * RANK) + at
            gl.store(o_at, a0 * inv_l[None, :], mask=ok_o)
            gl.store(o_at + GROUP, a1 * inv_l[None, :], mask=ok_o)
            gl.store(o_at + 2 * GROUP, a2 * inv_l[None, :], mask=ok_o)
            gl.store(o_at + 3 * GROUP, a3 * inv_l[None, :], mask=ok_o)
            gl.store(plse_ptr + p64 * ROWS + r, lse2, mask=row_ok)

    @gluon.jit
    def softmax_result(m_i, l_i):
        """The end of a row's online softmax (``m_i`` / ``l_i``: its running log2 max and sum,
        fp32, any shape): ``(l_safe, lse2)`` -- what its accumulator is divided by (1 for a row
        without keys, whose accumulator is 0: its ``out`` is 0) and its log2-sum-exp (-inf for
        such a row), the stores' convention for every kernel."""
        has_keys = l_i > 0.0
        l_safe = gl.where(has_keys, l_i, 1.0)
        lse2 = gl.where(has_keys, m_i + gl.log2(l_safe), float("-inf"))
        return l_safe, lse2

    @gluon.jit
    def store_keys_part(a, col0, inv_l, r, c, b64, nsplit, p_row, partial_cap, out_ptr, po_ptr, ROWS,
                        RANK: gl.constexpr):
        """One part ``a`` of a keys-on-M kernel's accumulator ``acc^T`` (fp32 ``[C, R]``: latent
        columns ``col0 + c``, ``c`` of ``[C]`` below ``C``; rows ``r`` = ``token * H + head``), times
        ``inv_l`` (``[R]``): an unsplit request (``nsplit == 1``) stores it into ``out`` (its dtype,
        ``[B, s_q, h, RANK]``), a split one into its fp32 partial row ``p_row`` (``[cap, ROWS,
        RANK]``) while ``p_row < partial_cap``. The log-sum-exp goes separately
        (``store_keys_lse``)."""
        ok_o = (c[:, None] < a.shape[0]) & (r < ROWS)[None, :]
        at = r.to(gl.int64)[None, :] * RANK + (col0 + c)[:, None]
        if nsplit == 1:
            gl.store(out_ptr + b64 * (ROWS * RANK) + at, (a * inv_l[None, :]).to(out_ptr.dtype.element_ty), mask=ok_o)
        elif p_row < partial_cap:
            gl.store(po_ptr + p_row.to(gl.int64) * (ROWS * RANK) + at, a * inv_l[None, :], mask=ok_o)

    @gluon.jit
    def store_out_staged(o, stage, row0, b64, out_ptr, ROWS, RANK: gl.constexpr, OUT_L: gl.constexpr):
        """An unsplit request's ``out`` rows through shared memory: ``o`` (fp32 ``[R, C]``, the
        result already divided by its row sums, in a wgmma accumulator's layout) is written into
        ``stage`` (``[R, C]`` of ``out``'s dtype: q's latent buffer once no dot reads it in the
        64-row FP8 kernel, a latent half of a warpgroup's own tile buffer in the ping-pong one) and
        read back in ``OUT_L`` (16-byte vectors along rows), so that ``out`` (``[B, ROWS, RANK]``
        from ``out_ptr``; the block's rows ``row0 + i`` of request ``b64``, its first C columns) is
        written a warp at a time in whole rows of contiguous bytes, not in the accumulator
        layout's 4-byte pieces of eight rows. The caller's warps are past a barrier
        after their last read of ``stage``; its next writer waits for a barrier after this."""
        stage.store(o.to(stage.dtype))
        gl.thread_barrier()
        m_o = row0 + gl.arange(0, stage.shape[0], layout=gl.SliceLayout(1, OUT_L))
        c_o = gl.arange(0, stage.shape[1], layout=gl.SliceLayout(0, OUT_L))
        gl.store(out_ptr + b64 * (ROWS * RANK) + m_o.to(gl.int64)[:, None] * RANK + c_o[None, :], stage.load(OUT_L),
                 mask=(m_o < ROWS)[:, None] & (c_o[None, :] < RANK))

    @gluon.jit
    def store_part_staged(acc, m_i, l_i, row0, p_row, partial_cap, po_ptr, plse_ptr, ROWS, stage, ROW_S: gl.constexpr,
                          ROW_A: gl.constexpr, PART_L: gl.constexpr):
        """A split request's fp32 partial through shared memory: ``acc`` (fp32 ``[R, RANK]``, a 64-row
        kernel's whole accumulator in its wgmma layout, rows ``row0 + i``) divided by its row sums
        is written into ``stage`` (fp32 ``[R, RANK]``, a free buffer) and read back a quarter of the
        columns at a time in ``PART_L`` (16-byte vectors along rows), so that partial row ``p_row``
        (``[cap, ROWS, RANK]`` from ``po_ptr``; log2 lse ``[cap, ROWS]`` from ``plse_ptr``) is
        written in whole row segments while ``p_row < partial_cap``. ``m_i`` / ``l_i``: the rows'
        log2 max and sum (``ROW_S``). The caller's warps are past a barrier after their last read
        of ``stage``."""
        l_safe, lse2 = softmax_result(m_i, l_i)
        stage.store(acc / gl.convert_layout(l_safe, ROW_A)[:, None])
        gl.thread_barrier()
        R: gl.constexpr = stage.shape[0]
        RANK: gl.constexpr = stage.shape[1]
        Q: gl.constexpr = RANK // 4
        if p_row < partial_cap:
            p64 = p_row.to(gl.int64)
            m_o = row0 + gl.arange(0, R, layout=gl.SliceLayout(1, PART_L))
            c_o = gl.arange(0, Q, layout=gl.SliceLayout(0, PART_L))
            at = po_ptr + p64 * (ROWS * RANK) + m_o.to(gl.int64)[:, None] * RANK + c_o[None, :]
            ok = (m_o < ROWS)[:, None] & (c_o[None, :] < Q)
            for k in gl.static_range(4):
                gl.store(at + k * Q, stage.slice(k * Q, Q, dim=1).load(PART_L), mask=ok)
            m_s = row0 + gl.arange(0, R, layout=ROW_S)
            gl.store(plse_ptr + p64 * ROWS + m_s, lse2, mask=m_s < ROWS)

    @gluon.jit
    def store_keys_lse(lse2, r, b64, nsplit, p_row, partial_cap, lse_ptr, plse_ptr, ROWS, SQ, H):
        """A request's log2-sum-exp ``lse2`` (``[R]``, rows ``r``): natural log into ``lse``
        (``[B, h, s_q]``) when unsplit (``nsplit == 1``), else into its partial row ``p_row``
        (log2, ``[cap, ROWS]``) while ``p_row < partial_cap``."""
        LN2: gl.constexpr = 0.6931471805599453
        row_ok = r < ROWS
        if nsplit == 1:
            gl.store(lse_ptr + b64 * ROWS + (r % H) * SQ + r // H, lse2 * LN2, mask=row_ok)
        elif p_row < partial_cap:
            gl.store(plse_ptr + p_row.to(gl.int64) * ROWS + r, lse2, mask=row_ok)

    @gluon.jit
    def copy_q_rows(q_row, row0, ROWS, q_lat_s, q_rope_s, RANK: gl.constexpr, ROPE: gl.constexpr, LAT_L: gl.constexpr,
                    ROPE_L: gl.constexpr):
        """Issue the ``cp.async`` copies of a row block's q into shared memory (the caller commits
        and waits): ``q_row`` points at the request's q (``[ROWS, RANK + ROPE]``, 16-bit), the
        block's rows are ``row0 + i`` (``q_lat_s``: ``[rows, RANK]``, copied in layout ``LAT_L``;
        ``q_rope_s``: ``[rows, ROPE]``, in ``ROPE_L``); rows at or past ``ROWS`` (padding) land as
        zeros."""
        D: gl.constexpr = RANK + ROPE
        BLOCK_M: gl.constexpr = q_lat_s.shape[0]
        m_lat = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, LAT_L))
        c_lat = gl.arange(0, RANK, layout=gl.SliceLayout(0, LAT_L))
        async_copy.async_copy_global_to_shared(q_lat_s, q_row + m_lat.to(gl.int64)[:, None] * D + c_lat[None, :],
                                               mask=(m_lat < ROWS)[:, None] & (c_lat[None, :] < RANK))
        m_rope = row0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, ROPE_L))
        c_rope = gl.arange(0, ROPE, layout=gl.SliceLayout(0, ROPE_L))
        async_copy.async_copy_global_to_shared(q_rope_s,
                                               q_row + m_rope.to(gl.int64)[:, None] * D + RANK + c_rope[None, :],
                                               mask=(m_rope < ROWS)[:, None] & (c_rope[None, :] < ROPE))

    @gluon.jit
    def start_request_rows(q_ptr, ctx_ptr, b64, ctx_w, tok, row_ok, row0, ROWS, q_lat_s, q_rope_s,
                           RANK: gl.constexpr, ROPE: gl.constexpr, LAT_L: gl.constexpr, ROPE_L: gl.constexpr):
        """Request ``b64``'s start in a consumer whose warps all read q from shared memory: loads
        its rows' context lengths (``ctx_ptr``: int32 ``[B, ctx_w]``; ``tok``: each row's token,
        ``row_ok`` the real rows, in any layout), waits until every warp of the partition is done
        with the previous request's q, then copies this one's (``copy_q_rows``: q ``[B, ROWS, RANK +
        ROPE]`` at ``q_ptr``, the block's rows from ``row0``, in layouts ``LAT_L`` / ``ROPE_L``) and
        waits until it has landed and is visible to the dots. Returns the context lengths (0 where
        masked)."""
        ctx = gl.load(ctx_ptr + b64 * ctx_w + tok, mask=row_ok & (tok < ctx_w), other=0)
        # every consumer warp is done with q of the previous request
        gl.thread_barrier()
        copy_q_rows(q_ptr + b64 * (ROWS * (RANK + ROPE)), row0, ROWS, q_lat_s, q_rope_s, RANK, ROPE, LAT_L, ROPE_L)
        async_copy.commit_group()
        async_copy.wait_group(0)
        fence_async_shared()
        gl.thread_barrier()
        return ctx

    @gluon.jit
    def softmax_rows_step(s, m_i, l_i, ctx, offs_n, seq_len):
        """One tile of the online softmax along the key axis of ``S`` (fp32 ``[rows, keys]``,
        already times ``softmax_scale * log2(e)``): keys ``offs_n`` (``[keys]``) past ``seq_len``
        or, per query row, past its context ``ctx`` (``[rows]``) are masked; ``m_i`` / ``l_i``
        (``[rows]``) the running max and sum. Returns ``(p, alpha, m_new, l_new)``: ``p =
        exp2(S - m_new)`` and the factor ``alpha`` (``[rows]``) by which the accumulator is to be
        rescaled."""
        visible = (offs_n[None, :] < ctx[:, None]) & (offs_n < seq_len)[None, :]
        s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        m_ref = gl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = gl.exp2(m_i - m_ref)
        p = gl.exp2(s - m_ref[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        return p, alpha, m_new, l_i

    @gluon.jit
    def rows_tile_step(q_lat_s, q_rope_s, k_lat, k_rope, p_s, acc, m_i, l_i, ctx, tile, n_s, seq_len, qk_scale,
                       S_L: gl.constexpr, ROW_A: gl.constexpr):
        """One key tile of a 64-row kernel whose whole CTA (two warpgroups: ``S_L`` and the
        accumulator's layout are ``[4, 2]``) works on it. Scores ``S = q_rope K_rope^T + q_lat
        K_lat^T`` (shared q ``[64, rank]`` / ``[64, rope]``, shared tile ``k_lat [keys, rank]`` /
        ``k_rope [keys, rope]``) times ``qk_scale``; ``softmax_rows_step`` over tile ``tile``'s
        keys (``n_s``: ``arange(keys)`` in the scores' column slice) with the rows' ``ctx`` and
        ``seq_len``; ``acc`` (fp32 ``[64, rank]``, an in-flight wgmma result) rescaled; P written
        to ``p_s`` (``[64, keys]``, the tile's dtype) and the PV dot issued on it. Returns ``(acc,
        m_i, l_i)``, ``acc`` in flight: the caller waits on it before ``p_s`` or the tile is
        rewritten."""
        s = gl.full([p_s.shape[0], p_s.shape[1]], 0.0, gl.float32, S_L)
        s = warpgroup_mma(q_rope_s, k_rope.permute((1, 0)), s, use_acc=False, is_async=True)
        s = warpgroup_mma(q_lat_s, k_lat.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        # (the keys' offsets after the dots, as the kernels had them inline: computed before,
        # they moved the warp-specialised consumer's schedule)
        p, alpha, m_i, l_i = softmax_rows_step(s * qk_scale, m_i, l_i, ctx, tile * p_s.shape[1] + n_s, seq_len)
        acc = acc * gl.convert_layout(alpha, ROW_A)[:, None]
        p_s.store(p.to(p_s.dtype))
        fence_async_shared()
        gl.thread_barrier()
        acc = warpgroup_mma(p_s, k_lat, acc, is_async=True)
        return acc, m_i, l_i

    @gluon.jit
    def store_rows_result(acc, m_i, l_i, row0, b64, nsplit, p_row, partial_cap, out_ptr, lse_ptr, po_ptr, plse_ptr,
                          ROWS, SQ, H, BLOCK_M: gl.constexpr, RANK: gl.constexpr, ROW_S: gl.constexpr,
                          ROW_A: gl.constexpr, COL_A: gl.constexpr, stage=None, OUT_L: gl.constexpr = None,
                          STAGED: gl.constexpr = False):
        """A request's result from a 64-row kernel's accumulator ``acc`` (fp32 ``[BLOCK_M, C]`` in a
        layout whose row / column slices are ``ROW_A`` / ``COL_A``; rows ``row0 + i`` = ``token * H
        + head``; its C columns the first C of the rows of ``RANK`` that ``out_ptr`` / ``po_ptr``
        point at: ``C = RANK``, or a column block with the pointers moved to it) and its softmax
        state ``m_i`` / ``l_i`` (log2 max and sum, ``[BLOCK_M]`` in ``ROW_S``): an unsplit request
        (``nsplit == 1``) stores ``out`` (its dtype, ``[B, s_q, h, RANK]``) and ``lse`` (natural
        log, ``[B, h, s_q]``); a split one its fp32 partial row ``p_row`` (``[cap, ROWS, RANK]``,
        log2 lse ``[cap, ROWS]``) while ``p_row < partial_cap``. A row without keys gets ``out`` 0
        and ``lse`` -inf.

        ``STAGED``: ``out`` goes through ``stage``, a free shared buffer ``[BLOCK_M, C]`` of its
        dtype, and is read back in ``OUT_L`` (``store_out_staged``)."""
        LN2: gl.constexpr = 0.6931471805599453
        l_safe, lse2 = softmax_result(m_i, l_i)
        o = acc / gl.convert_layout(l_safe, ROW_A)[:, None]
        m_s = row0 + gl.arange(0, BLOCK_M, layout=ROW_S)
        row_ok = m_s < ROWS
        m_a = row0 + gl.arange(0, BLOCK_M, layout=ROW_A)
        c_a = gl.arange(0, acc.shape[1], layout=COL_A)
        ok_a = (m_a < ROWS)[:, None] & (c_a[None, :] < RANK)
        m_rows = m_a.to(gl.int64)[:, None] * RANK + c_a[None, :]
        if nsplit == 1:
            if STAGED:
                store_out_staged(o, stage, row0, b64, out_ptr, ROWS, RANK, OUT_L)
            else:
                gl.store(out_ptr + b64 * (ROWS * RANK) + m_rows, o.to(out_ptr.dtype.element_ty), mask=ok_a)
            gl.store(lse_ptr + b64 * ROWS + (m_s % H) * SQ + m_s // H, lse2 * LN2, mask=row_ok)
        elif p_row < partial_cap:
            p64 = p_row.to(gl.int64)
            gl.store(po_ptr + p64 * (ROWS * RANK) + m_rows, o, mask=ok_a)
            gl.store(plse_ptr + p64 * ROWS + m_s, lse2, mask=row_ok)
