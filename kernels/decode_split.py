"""Split-KV MLA decode kernel (paged latent cache, grouped heads, MTP causal, FP8 dequant).

Grid ``(num_parts, m_blocks)``, fixed by static config: program ``(p, mb)`` walks the KV
range the planner gave part ``p`` (possibly the tail of one request, whole requests, and
the head of another) for query rows ``mb * BLOCK_M ...``. A query row is one (MTP token,
head) pair of a request, flattened token-major, so all heads *and* all MTP tokens of a
request share every loaded latent KV tile (the point of MLA's absorbed form: one KV row
serves every head).

Per KV tile: ``S = Q_lat @ K_lat^T + Q_rope @ K_rope^T`` (d_qk split as rank + rope), the
bottom-right causal mask from the per-token context lengths, an online softmax in base 2,
and ``acc += P @ K_lat`` (V is the latent part of the same rows). FP8 caches are
dequantised in registers (e4m3 bytes -> fp32 times the group's scale; rope read as bf16).

Each piece ends in one of two stores: a request that is not split writes its final
``out`` (q dtype) and ``lse`` directly; a split request writes an fp32 partial (normalised
output + base-2 LSE) into its row of the partial buffer for the combine kernel. Tokens with
no visible key get out 0 / lse -inf explicitly (``l == 0`` guarded, never 0/0).

Interpreter note: ``tl.dot`` on bf16/fp16 operands returns garbage under
``TRITON_INTERPRET=1`` (triton #11584), so ``DOT_F32`` upcasts the operands to fp32
(decided on the host); on the GPU bf16/fp16 operands feed the tensor cores directly.

Extension point (sparse top-k decode, later issue): the block marked "key positions ->
cache slots" is the only place that maps key positions to cache slots; the sparse variant
reads the slots from ``indices`` (``-1`` -> masked) instead of the block table, with
per-token key counts from ``topk_length`` in place of ``ctx_lens``, and the planner counts
``ceil(topk / block_n)`` tiles per request instead of ``ceil(seq_len / block_n)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import to_out

__all__ = ["launch_decode_split"]

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr,
                         out_ptr, lse_ptr, po_ptr, plse_ptr,
                         bt_stride, partial_cap, qk_scale, SQ, H, PAGE,
                         RANK: tl.constexpr, ROPE: tl.constexpr,
                         GROUP: tl.constexpr, TOKEN_STRIDE: tl.constexpr, FP8: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                         FP8_PREFETCH: tl.constexpr):
    pid_p = tl.program_id(0)
    pid_m = tl.program_id(1)
    ROWS = SQ * H
    D: tl.constexpr = RANK + ROPE
    LN2: tl.constexpr = 0.6931471805599453
    NG: tl.constexpr = RANK // GROUP

    b_first = tl.load(part_ptr + pid_p * 3 + 0)
    t_first = tl.load(part_ptr + pid_p * 3 + 1)
    j_first = tl.load(part_ptr + pid_p * 3 + 2)
    b_end = tl.load(part_ptr + (pid_p + 1) * 3 + 0)
    t_end = tl.load(part_ptr + (pid_p + 1) * 3 + 1)
    # the next part starting at tile 0 of b_end means this part stops before that request
    b_last = tl.where(t_end > 0, b_end, b_end - 1)
    ctx_w = tl.load(ctxw_ptr)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < ROWS
    tok = offs_m // H
    head = offs_m % H
    offs_r = tl.arange(0, RANK)
    offs_p = tl.arange(0, ROPE)
    offs_nb = tl.arange(0, BLOCK_N)
    offs_g = tl.arange(0, NG)

    for b in range(b_first, b_last + 1):
        b64 = tl.cast(b, tl.int64)
        seq_len = tl.load(seq_ptr + b)
        n_tiles = (tl.maximum(seq_len, 0) + BLOCK_N - 1) // BLOCK_N
        t0 = tl.where(b == b_first, t_first, 0)
        t1 = tl.where(b == b_end, t_end, n_tiles)
        piece = tl.where(b == b_first, j_first, 0)
        nsplit = tl.load(nsplit_ptr + b)
        p_row = tl.load(off_ptr + b) + piece

        q_row = q_ptr + b64 * (ROWS * D) + offs_m * D
        q_lat = tl.load(q_row[:, None] + offs_r[None, :], mask=row_ok[:, None], other=0.0)
        q_rope = tl.load(q_row[:, None] + RANK + offs_p[None, :], mask=row_ok[:, None], other=0.0)
        if DOT_F32:
            q_lat = q_lat.to(tl.float32)
            q_rope = q_rope.to(tl.float32)
        # keys visible to each row's token: 0 for padding tokens (and tokens past the view)
        ctx = tl.load(ctx_ptr + b64 * ctx_w + tok, mask=row_ok & (tok < ctx_w), other=0)
        bt_row = bt_ptr + b64 * bt_stride

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
        if FP8:
            if FP8_PREFETCH:
                # FP8 tiles can be prefetched one tile ahead into registers: their loads feed
                # the dequantisation rather than a dot, which Triton's pipeliner may leave exposed.
                offs_n = t0 * BLOCK_N + offs_nb
                kv_ok = (offs_n < seq_len) & ((offs_nb * 0 + t0) < t1)
                page_id = tl.load(bt_row + offs_n // PAGE, mask=kv_ok, other=0)
                cur_row = kv_ptr + (page_id.to(tl.int64) * PAGE + offs_n % PAGE) * TOKEN_STRIDE
                codes = tl.load(cur_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0)
                rope_raw = tl.load((cur_row + RANK + 4 * NG).to(tl.pointer_type(tl.bfloat16))[:, None]
                                   + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
        for tile in range(t0, t1):
            offs_n = tile * BLOCK_N + offs_nb
            kv_ok = offs_n < seq_len
            if FP8:
                if FP8_PREFETCH:
                    kv_row = cur_row
                    nxt_n = offs_n + BLOCK_N
                    nxt_ok = (nxt_n < seq_len) & ((offs_nb * 0 + tile + 1) < t1)
                    # -- key positions -> cache slots (the sparse-decode hook: read slots from
                    #    `indices` here and below instead of the block table)
                    page_id = tl.load(bt_row + nxt_n // PAGE, mask=nxt_ok, other=0)
                    cur_row = kv_ptr + (page_id.to(tl.int64) * PAGE + nxt_n % PAGE) * TOKEN_STRIDE
                    vals = codes.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                    k_rope = rope_raw
                    codes = tl.load(cur_row[:, None] + offs_r[None, :], mask=nxt_ok[:, None], other=0)
                    rope_raw = tl.load((cur_row + RANK + 4 * NG).to(tl.pointer_type(tl.bfloat16))[:, None]
                                       + offs_p[None, :], mask=nxt_ok[:, None], other=0.0)
                else:
                    page_id = tl.load(bt_row + offs_n // PAGE, mask=kv_ok, other=0)
                    kv_row = kv_ptr + (page_id.to(tl.int64) * PAGE + offs_n % PAGE) * TOKEN_STRIDE
                    codes_now = tl.load(kv_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0)
                    vals = codes_now.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                    k_rope = tl.load((kv_row + RANK + 4 * NG).to(tl.pointer_type(tl.bfloat16))[:, None]
                                     + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
                # dequantise: e4m3 value times its group's scale, broadcast through a
                # [BLOCK_N, groups, group] view (a per-element gather of the scale words was
                # measured 2-3x slower on an H200, benchmarks/results)
                scale_row = (kv_row + RANK).to(tl.pointer_type(tl.float32))
                sc = tl.load(scale_row[:, None] + offs_g[None, :], mask=kv_ok[:, None], other=0.0)
                k_lat = tl.reshape(tl.reshape(vals, (BLOCK_N, NG, GROUP)) * sc[:, :, None], (BLOCK_N, RANK))
            else:
                # -- key positions -> cache slots (the sparse-decode hook: read slots from
                #    `indices` here instead of the block table; the rest is slot-agnostic)
                page_id = tl.load(bt_row + offs_n // PAGE, mask=kv_ok, other=0)
                slots = page_id.to(tl.int64) * PAGE + offs_n % PAGE
                # -- one latent KV row per key, shared by every query row of the program;
                #    these loads feed the dots directly and Triton pipelines them (num_stages).
                #    (Inlined rather than helpers: the interpreter re-patches triton.language
                #    on every nested jit call, ~10 ms each.) Masked keys load as 0.
                kv_row = kv_ptr + slots * TOKEN_STRIDE
                k_lat = tl.load(kv_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0.0)
                k_rope = tl.load(kv_row[:, None] + RANK + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
            k_lat = k_lat.to(q_lat.dtype)
            k_rope = k_rope.to(q_rope.dtype)
            if DOT_F32:
                s = tl.dot(q_lat, tl.trans(k_lat), input_precision="ieee")
                s += tl.dot(q_rope, tl.trans(k_rope), input_precision="ieee")
            else:
                s = tl.dot(q_lat, tl.trans(k_lat))
                s += tl.dot(q_rope, tl.trans(k_rope))
            s = s * qk_scale
            visible = (offs_n[None, :] < ctx[:, None]) & kv_ok[None, :]
            # tl.where, not an additive bias: a NaN score (poisoned padding q) must vanish too
            s = tl.where(visible, s, float("-inf"))
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
        # scalar conditions are broadcast to row vectors before combining: the interpreter
        # rejects a mask made of `vector & scalar`
        zero_m = offs_m * 0
        has_work = (zero_m + t1) > t0
        direct = row_ok & has_work & ((zero_m + nsplit) == 1)
        tl.store(out_ptr + b64 * (ROWS * RANK) + offs_m[:, None] * RANK + offs_r[None, :],
                 to_out(o, out_ptr.dtype.element_ty), mask=direct[:, None])
        tl.store(lse_ptr + b64 * ROWS + head * SQ + tok, lse2 * LN2, mask=direct)
        split = row_ok & has_work & ((zero_m + nsplit) > 1) & ((zero_m + p_row) < partial_cap)
        p64 = p_row.to(tl.int64)
        tl.store(po_ptr + p64 * (ROWS * RANK) + offs_m[:, None] * RANK + offs_r[None, :], o, mask=split[:, None])
        tl.store(plse_ptr + p64 * ROWS + offs_m, lse2, mask=split)


def launch_decode_split(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                        split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale: float, rank: int,
                        rope_dim: int, fp8_group: int, block_m: int, block_n: int, num_warps: int,
                        num_stages: int, dot_f32: bool, fp8_prefetch: bool = True) -> None:
    """Launch the decode (arguments checked by ``ops.decode_split``).

    Shapes: q ``[B, s_q, h, rank + rope]``; block_table int32 ``[B, max_blocks]``;
    cache_seqlens int32 ``[B]``; ctx_lens int32 ``[B, W]`` with ``W = ctx_width[0]``;
    part_info int32 ``[num_parts + 1, 3]``; num_splits / split_offsets int32 ``[B]``;
    out ``[B, s_q, h, rank]``; lse fp32 ``[B, h, s_q]``; partial_o fp32 ``[cap, s_q*h, rank]``;
    partial_lse fp32 ``[cap, s_q*h]``.
    """
    B, s_q, h, _ = q.shape
    num_parts = part_info.shape[0] - 1
    m_blocks = triton.cdiv(s_q * h, block_m)
    fp8 = kv_cache.dtype == torch.uint8
    page = kv_cache.shape[1]
    grid = (num_parts, m_blocks)
    _decode_split_kernel[grid](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse,
        block_table.shape[1], partial_o.shape[0], float(softmax_scale) * _LOG2E, s_q, h, page,
        RANK=rank, ROPE=rope_dim, GROUP=fp8_group, TOKEN_STRIDE=kv_cache.shape[-1],
        FP8=fp8, BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=dot_f32, FP8_PREFETCH=bool(fp8_prefetch) and fp8,
        num_warps=num_warps, num_stages=num_stages)
