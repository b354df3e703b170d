"""Split-KV MLA decode kernel (paged latent cache, grouped heads, MTP causal, FP8 cache).

Grid ``(num_parts, m_blocks)``, fixed by static config: program ``(p, mb)`` walks the KV
range the planner gave part ``p`` (possibly the tail of one request, whole requests, and
the head of another) for query rows ``mb * BLOCK_M ...``. A query row is one (MTP token,
head) pair of a request, flattened token-major, so all heads *and* all MTP tokens of a
request share every loaded latent KV tile (the point of MLA's absorbed form: one KV row
serves every head).

Per KV tile of ``BLOCK_N`` keys (``d_qk`` split as rank + rope; V is the latent part of
the same rows)::

    S   = (Q_lat @ K_lat^T + Q_rope @ K_rope^T) * scale * log2(e)
    S   = where(key visible to the row's token, S, -inf)      # bottom-right causal mask
    m'  = max(m, rowmax(S));  P = exp2(S - m');  alpha = exp2(m - m')
    l   = l * alpha + rowsum(P);  acc = acc * alpha + P @ K_lat;  m = m'

and at the end ``out = acc / l``, ``lse = (m + log2 l) * ln 2``.

FP8 caches store the latent as e4m3 codes ``C`` with one fp32 scale per group of ``GROUP``
values: ``K_lat[n, c] = C[n, c] * sc[n, g(c)]``. Since the scale is constant inside a group,
it factors out of each group's part of both products (``Q_g`` / ``C_g`` / ``acc_g``: the
columns of group g)::

    Q_lat @ K_lat^T  = sum_g  (Q_g @ C_g^T) * sc[:, g][None, :]       (scale the dot result)
    (P @ K_lat)_g    = (P * sc[:, g][None, :]) @ C_g                  (scale P, not K)

so the codes go into the tensor-core dots as they are, converted e4m3 -> the q dtype (exact:
bf16 and fp16 hold every finite e4m3 value), and the fp32 scale work per tile is
``BLOCK_M x BLOCK_N`` per group instead of ``BLOCK_N x RANK`` — no per-element dequantise,
no ``[BLOCK_N, groups, GROUP]`` reshape. Triton has no tensor slicing, so this
*grouped-dot* path holds the latent in four quarters (``q0..q3`` / ``acc0..acc3``, each
``[BLOCK_M, RANK / 4]``; the total stays ``[BLOCK_M, RANK]`` fp32) loaded by pointer
offsets; it applies when a quarter lies inside one group (``groups in {1, 2, 4}``: both
shipped specs have 4; 1 and 2 make tokens that ``check_spec_supported`` refuses for the GPU)
and a quarter is a legal dot dim (``RANK / 4 >= 16``). Quarter j
takes scale word ``j * groups // 4``. ``P * sc`` is rounded to the q dtype for the PV dot
(a rounding comparable to the former rounding of the dequantised K), after a fixed
``2**8`` factor — undone exactly at the end — that keeps it out of fp16's subnormal range
(scales are ``amax / 448``, typically ~1e-2). The scores' scaling happens in fp32 on the
dot results, so QK is as exact as the fp32 reference up to summation order.
Other group counts (or ``FP8_GROUPED_DOTS = False``, for benchmarks and tests) take the
*dequantise* path: e4m3 -> fp32 times the group scale through a ``[BLOCK_N, groups, GROUP]``
view, cast to the q dtype, then the same dots as a 16-bit cache. Rope is bf16 in both.

Hiding the load latency of FP8 tiles. Triton's software pipeliner (``num_stages >= 2``)
turns a load into an asynchronous copy to shared memory issued stages ahead only when all
of the load's dot uses agree on one shared-memory layout; a code tile converted and then
used by both dots (as ``K^T`` for QK, as ``K`` for PV) does not qualify, so its load stays
synchronous, every tile waiting out a full memory round trip (both FP8 paths, in the TTGIR
that Triton 3.9 makes for sm_90; a 16-bit cache's tile is pipelined). Two remedies, picked
on the host:

- *twin loads* (grouped path, ``num_stages >= 2``, no ``fp8_prefetch``, ``BLOCK_M <= 32``;
  module switch ``FP8_TWIN_LOADS``): each code tile is loaded twice, once per dot, so each
  load has one use and is pipelined. The second read of the same bytes should be served
  by L2 (DRAM traffic unchanged, L2->SM traffic ~1.8x); the two loads carry different eviction
  hints (``evict_last`` / ``evict_first``), which also keeps the compiler from merging
  them. Row blocks of 64 (wgmma, operands staged in shared memory) would exceed the 227 KiB
  of shared memory with twin buffers at ``block_n = 64`` (281 KiB for sm_90), so they load once.
- ``FP8_PREFETCH`` (``DecodeConfig.fp8_prefetch``, both FP8 paths; pair with
  ``num_stages=1``): tile ``i+1``'s bytes (codes, scales, rope) are loaded into registers
  while tile ``i`` is computed, at the price of holding a tile in registers.

Both are ignored for 16-bit caches, whose tiles feed the dots directly and are pipelined.

Each piece ends in one of two stores: a request that is not split writes its final
``out`` (q dtype) and ``lse`` directly; a split request writes an fp32 partial (normalised
output + base-2 LSE) into its row of the partial buffer for the combine kernel. Tokens with
no visible key get out 0 / lse -inf explicitly (``l == 0`` guarded, never 0/0).

Interpreter note: ``tl.dot`` on bf16/fp16 operands returns garbage under
``TRITON_INTERPRET=1`` (triton #11584), so ``DOT_F32`` upcasts the operands to fp32
(decided on the host); on the GPU bf16/fp16 operands feed the tensor cores directly.

Extension point (sparse top-k decode, later issue): the blocks marked "key positions ->
cache slots" are the only places that map key positions to cache slots; the sparse variant
reads the slots from ``indices`` (``-1`` -> masked) instead of the block table, with
per-token key counts from ``topk_length`` in place of ``ctx_lens``, and the planner counts
``ceil(topk / block_n)`` tiles per request instead of ``ceil(seq_len / block_n)``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .rounding import to_out

__all__ = ["launch_decode_split", "fp8_grouped_dots"]

_LOG2E = 1.4426950408889634

#: Use the grouped-dot FP8 path wherever the spec allows it (module doc). A module switch
#: read at every launch rather than a ``DecodeConfig`` field: it picks an implementation,
#: not a tuning knob. ``benchmarks/fp8_decode_bench.py`` and the tests set it to False to
#: time / exercise the dequantise path on the shipped specs.
FP8_GROUPED_DOTS = True
#: Grouped-dot path without ``fp8_prefetch``, with ``num_stages >= 2`` and ``block_m <= 32``:
#: load each code tile twice, once per dot (module doc, "twin loads"). A module switch for
#: the same reason.
FP8_TWIN_LOADS = True


#: Largest row block that takes the grouped-dot path: at 64 rows (h=128) its four
#: ``[BLOCK_M, RANK/4]`` accumulators and operands spill, and it ran 1.8x slower than the
#: dequantise path on an H200 (h=128, s_q=2, B=128, L=16k: 9.9 vs 5.4 ms,
#: benchmarks/results/h200-2026-11-26-kernel-fp8-paths.json).
GROUPED_MAX_BLOCK_M = 32


def fp8_grouped_dots(rank: int, fp8_group: int, block_m: int = 16) -> bool:
    """True when an FP8 cache of this shape takes the grouped-dot path (module doc): every
    latent quarter lies inside one scale group and is a legal ``tl.dot`` dim, and the row
    block is small enough for the per-quarter accumulators (``GROUPED_MAX_BLOCK_M``)."""
    groups = rank // fp8_group
    return (bool(FP8_GROUPED_DOTS) and groups in (1, 2, 4) and rank % 4 == 0 and rank // 4 >= 16
            and block_m <= GROUPED_MAX_BLOCK_M)


@triton.jit
def _decode_split_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr,
                         out_ptr, lse_ptr, po_ptr, plse_ptr,
                         bt_stride, partial_cap, qk_scale, SQ, H, PAGE,
                         RANK: tl.constexpr, ROPE: tl.constexpr,
                         GROUP: tl.constexpr, TOKEN_STRIDE: tl.constexpr, FP8: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                         DOT_PREC: tl.constexpr, FP8_PREFETCH: tl.constexpr, GROUPED: tl.constexpr,
                         TWIN: tl.constexpr, K_EVICT: tl.constexpr):
    pid_p = tl.program_id(0)
    pid_m = tl.program_id(1)
    ROWS = SQ * H
    D: tl.constexpr = RANK + ROPE
    LN2: tl.constexpr = 0.6931471805599453
    NG: tl.constexpr = RANK // GROUP
    ROPE_OFF: tl.constexpr = RANK + 4 * NG   # FP8 token: codes, NG fp32 scales, bf16 rope
    # grouped-dot path: the latent in quarters of QW columns; quarter j uses scale word Gj
    QW: tl.constexpr = RANK // 4
    G1: tl.constexpr = NG // 4
    G2: tl.constexpr = NG // 2
    G3: tl.constexpr = (3 * NG) // 4
    # P * scale is taken 2**8 larger (out of fp16's subnormals) and acc 2**-8 at the end
    PV_SCALE: tl.constexpr = 256.0
    INV_PV_SCALE: tl.constexpr = 0.00390625

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
    offs_q = tl.arange(0, QW)

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
        q_rope = tl.load(q_row[:, None] + RANK + offs_p[None, :], mask=row_ok[:, None], other=0.0)
        if DOT_F32:
            q_rope = q_rope.to(tl.float32)
        if GROUPED:
            q0 = tl.load(q_row[:, None] + offs_q[None, :], mask=row_ok[:, None], other=0.0)
            q1 = tl.load(q_row[:, None] + QW + offs_q[None, :], mask=row_ok[:, None], other=0.0)
            q2 = tl.load(q_row[:, None] + 2 * QW + offs_q[None, :], mask=row_ok[:, None], other=0.0)
            q3 = tl.load(q_row[:, None] + 3 * QW + offs_q[None, :], mask=row_ok[:, None], other=0.0)
            if DOT_F32:
                q0 = q0.to(tl.float32)
                q1 = q1.to(tl.float32)
                q2 = q2.to(tl.float32)
                q3 = q3.to(tl.float32)
            acc0 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
            acc1 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
            acc2 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
            acc3 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
        else:
            q_lat = tl.load(q_row[:, None] + offs_r[None, :], mask=row_ok[:, None], other=0.0)
            if DOT_F32:
                q_lat = q_lat.to(tl.float32)
            acc = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
        # keys visible to each row's token: 0 for padding tokens (and tokens past the view)
        ctx = tl.load(ctx_ptr + b64 * ctx_w + tok, mask=row_ok & (tok < ctx_w), other=0)
        bt_row = bt_ptr + b64 * bt_stride

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        if FP8:
            if FP8_PREFETCH:
                # tile t0's bytes, carried into the loop (see FP8_PREFETCH in the module doc)
                offs_n = t0 * BLOCK_N + offs_nb
                kv_ok = (offs_n < seq_len) & ((offs_nb * 0 + t0) < t1)
                page_id = tl.load(bt_row + offs_n // PAGE, mask=kv_ok, other=0)
                cur_row = kv_ptr + (page_id.to(tl.int64) * PAGE + offs_n % PAGE) * TOKEN_STRIDE
                rope_raw = tl.load((cur_row + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))[:, None]
                                   + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
                if GROUPED:
                    pc0 = tl.load(cur_row[:, None] + offs_q[None, :], mask=kv_ok[:, None], other=0)
                    pc1 = tl.load(cur_row[:, None] + QW + offs_q[None, :], mask=kv_ok[:, None], other=0)
                    pc2 = tl.load(cur_row[:, None] + 2 * QW + offs_q[None, :], mask=kv_ok[:, None], other=0)
                    pc3 = tl.load(cur_row[:, None] + 3 * QW + offs_q[None, :], mask=kv_ok[:, None], other=0)
                    sc_row = (cur_row + RANK).to(tl.pointer_type(tl.float32))
                    ps0 = tl.load(sc_row, mask=kv_ok, other=0.0)
                    ps1 = tl.load(sc_row + G1, mask=kv_ok, other=0.0)
                    ps2 = tl.load(sc_row + G2, mask=kv_ok, other=0.0)
                    ps3 = tl.load(sc_row + G3, mask=kv_ok, other=0.0)
                else:
                    codes = tl.load(cur_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0)
        for tile in range(t0, t1):
            offs_n = tile * BLOCK_N + offs_nb
            kv_ok = offs_n < seq_len
            # ---- this tile's keys (masked keys load as 0: codes, scales and rope)
            if FP8:
                if FP8_PREFETCH:
                    kv_row = cur_row
                    nxt_n = offs_n + BLOCK_N
                    nxt_ok = (nxt_n < seq_len) & ((offs_nb * 0 + tile + 1) < t1)
                    # -- key positions -> cache slots (the sparse-decode hook: read slots from
                    #    `indices` here and below instead of the block table)
                    page_id = tl.load(bt_row + nxt_n // PAGE, mask=nxt_ok, other=0)
                    cur_row = kv_ptr + (page_id.to(tl.int64) * PAGE + nxt_n % PAGE) * TOKEN_STRIDE
                    k_rope = rope_raw
                    rope_raw = tl.load((cur_row + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))[:, None]
                                       + offs_p[None, :], mask=nxt_ok[:, None], other=0.0)
                    if GROUPED:
                        k0 = pc0
                        k1 = pc1
                        k2 = pc2
                        k3 = pc3
                        sc0 = ps0
                        sc1 = ps1
                        sc2 = ps2
                        sc3 = ps3
                        pc0 = tl.load(cur_row[:, None] + offs_q[None, :], mask=nxt_ok[:, None], other=0)
                        pc1 = tl.load(cur_row[:, None] + QW + offs_q[None, :], mask=nxt_ok[:, None], other=0)
                        pc2 = tl.load(cur_row[:, None] + 2 * QW + offs_q[None, :], mask=nxt_ok[:, None], other=0)
                        pc3 = tl.load(cur_row[:, None] + 3 * QW + offs_q[None, :], mask=nxt_ok[:, None], other=0)
                        sc_row = (cur_row + RANK).to(tl.pointer_type(tl.float32))
                        ps0 = tl.load(sc_row, mask=nxt_ok, other=0.0)
                        ps1 = tl.load(sc_row + G1, mask=nxt_ok, other=0.0)
                        ps2 = tl.load(sc_row + G2, mask=nxt_ok, other=0.0)
                        ps3 = tl.load(sc_row + G3, mask=nxt_ok, other=0.0)
                    else:
                        codes_now = codes
                        codes = tl.load(cur_row[:, None] + offs_r[None, :], mask=nxt_ok[:, None], other=0)
                else:
                    # -- key positions -> cache slots (the sparse-decode hook, as above)
                    page_id = tl.load(bt_row + offs_n // PAGE, mask=kv_ok, other=0)
                    kv_row = kv_ptr + (page_id.to(tl.int64) * PAGE + offs_n % PAGE) * TOKEN_STRIDE
                    k_rope = tl.load((kv_row + ROPE_OFF).to(tl.pointer_type(tl.bfloat16))[:, None]
                                     + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
                    if GROUPED:
                        k0 = tl.load(kv_row[:, None] + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                     eviction_policy=K_EVICT)
                        k1 = tl.load(kv_row[:, None] + QW + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                     eviction_policy=K_EVICT)
                        k2 = tl.load(kv_row[:, None] + 2 * QW + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                     eviction_policy=K_EVICT)
                        k3 = tl.load(kv_row[:, None] + 3 * QW + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                     eviction_policy=K_EVICT)
                        if TWIN:
                            # twin loads (module doc): the same bytes again for the PV dots; the
                            # other eviction hint keeps the compiler from merging the two loads
                            v0 = tl.load(kv_row[:, None] + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                         eviction_policy="evict_first")
                            v1 = tl.load(kv_row[:, None] + QW + offs_q[None, :], mask=kv_ok[:, None], other=0,
                                         eviction_policy="evict_first")
                            v2 = tl.load(kv_row[:, None] + 2 * QW + offs_q[None, :], mask=kv_ok[:, None],
                                         other=0, eviction_policy="evict_first")
                            v3 = tl.load(kv_row[:, None] + 3 * QW + offs_q[None, :], mask=kv_ok[:, None],
                                         other=0, eviction_policy="evict_first")
                        sc_row = (kv_row + RANK).to(tl.pointer_type(tl.float32))
                        sc0 = tl.load(sc_row, mask=kv_ok, other=0.0)
                        sc1 = tl.load(sc_row + G1, mask=kv_ok, other=0.0)
                        sc2 = tl.load(sc_row + G2, mask=kv_ok, other=0.0)
                        sc3 = tl.load(sc_row + G3, mask=kv_ok, other=0.0)
                    else:
                        codes_now = tl.load(kv_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0)
                if GROUPED:
                    # grouped dots: codes -> q dtype (exact), each quarter's scale on its dot result
                    k0 = k0.to(tl.float8e4nv, bitcast=True).to(q_rope.dtype)
                    k1 = k1.to(tl.float8e4nv, bitcast=True).to(q_rope.dtype)
                    k2 = k2.to(tl.float8e4nv, bitcast=True).to(q_rope.dtype)
                    k3 = k3.to(tl.float8e4nv, bitcast=True).to(q_rope.dtype)
                    if TWIN:
                        v0 = v0.to(tl.float8e4nv, bitcast=True).to(q_rope.dtype)
                        v1 = v1.to(tl.float8e4nv, bitcast=True).to(q_rope.dtype)
                        v2 = v2.to(tl.float8e4nv, bitcast=True).to(q_rope.dtype)
                        v3 = v3.to(tl.float8e4nv, bitcast=True).to(q_rope.dtype)
                    else:
                        v0 = k0
                        v1 = k1
                        v2 = k2
                        v3 = k3
                    s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC) * sc0[None, :]
                    s += tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * sc1[None, :]
                    s += tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * sc2[None, :]
                    s += tl.dot(q3, tl.trans(k3), input_precision=DOT_PREC) * sc3[None, :]
                else:
                    # dequantise: e4m3 value times its group's scale, broadcast through a
                    # [BLOCK_N, groups, group] view (a per-element gather of the scale words was
                    # measured 2-3x slower on an H200, benchmarks/results)
                    vals = codes_now.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                    scale_row = (kv_row + RANK).to(tl.pointer_type(tl.float32))
                    sc = tl.load(scale_row[:, None] + offs_g[None, :], mask=kv_ok[:, None], other=0.0)
                    k_lat = tl.reshape(tl.reshape(vals, (BLOCK_N, NG, GROUP)) * sc[:, :, None], (BLOCK_N, RANK))
                    k_lat = k_lat.to(q_lat.dtype)
                    s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC)
            else:
                # -- key positions -> cache slots (the sparse-decode hook: read slots from
                #    `indices` here instead of the block table; the rest is slot-agnostic)
                page_id = tl.load(bt_row + offs_n // PAGE, mask=kv_ok, other=0)
                slots = page_id.to(tl.int64) * PAGE + offs_n % PAGE
                # -- one latent KV row per key, shared by every query row of the program;
                #    these loads feed the dots directly and Triton pipelines them (num_stages).
                #    (Inlined rather than helpers: the interpreter re-patches triton.language
                #    on every nested jit call, ~10 ms each.)
                kv_row = kv_ptr + slots * TOKEN_STRIDE
                k_lat = tl.load(kv_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0.0)
                k_rope = tl.load(kv_row[:, None] + RANK + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
                k_lat = k_lat.to(q_lat.dtype)
                s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC)
            k_rope = k_rope.to(q_rope.dtype)
            s += tl.dot(q_rope, tl.trans(k_rope), input_precision=DOT_PREC)
            s = s * qk_scale
            visible = (offs_n[None, :] < ctx[:, None]) & kv_ok[None, :]
            # tl.where, not an additive bias: a NaN score (poisoned padding q) must vanish too
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_ref)
            p = tl.exp2(s - m_ref[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if GROUPED:
                # (P * sc_j) @ C_j, P * sc_j rounded to the q dtype (x 2**8, see PV_SCALE)
                pv = tl.dot((p * (sc0 * PV_SCALE)[None, :]).to(v0.dtype), v0, input_precision=DOT_PREC)
                acc0 = acc0 * alpha[:, None] + pv
                pv = tl.dot((p * (sc1 * PV_SCALE)[None, :]).to(v1.dtype), v1, input_precision=DOT_PREC)
                acc1 = acc1 * alpha[:, None] + pv
                pv = tl.dot((p * (sc2 * PV_SCALE)[None, :]).to(v2.dtype), v2, input_precision=DOT_PREC)
                acc2 = acc2 * alpha[:, None] + pv
                pv = tl.dot((p * (sc3 * PV_SCALE)[None, :]).to(v3.dtype), v3, input_precision=DOT_PREC)
                acc3 = acc3 * alpha[:, None] + pv
            else:
                pv = tl.dot(p.to(k_lat.dtype), k_lat, input_precision=DOT_PREC)
                acc = acc * alpha[:, None] + pv
            m_i = m_new

        has_keys = l_i > 0.0
        l_safe = tl.where(has_keys, l_i, 1.0)
        lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        # scalar conditions are broadcast to row vectors before combining: the interpreter
        # rejects a mask made of `vector & scalar`
        zero_m = offs_m * 0
        has_work = (zero_m + t1) > t0
        direct = row_ok & has_work & ((zero_m + nsplit) == 1)
        split = row_ok & has_work & ((zero_m + nsplit) > 1) & ((zero_m + p_row) < partial_cap)
        p64 = p_row.to(tl.int64)
        out_rows = out_ptr + b64 * (ROWS * RANK) + offs_m[:, None] * RANK
        po_rows = po_ptr + p64 * (ROWS * RANK) + offs_m[:, None] * RANK
        if GROUPED:
            o = (acc0 * INV_PV_SCALE) / l_safe[:, None]
            tl.store(out_rows + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty), mask=direct[:, None])
            tl.store(po_rows + offs_q[None, :], o, mask=split[:, None])
            o = (acc1 * INV_PV_SCALE) / l_safe[:, None]
            tl.store(out_rows + QW + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty), mask=direct[:, None])
            tl.store(po_rows + QW + offs_q[None, :], o, mask=split[:, None])
            o = (acc2 * INV_PV_SCALE) / l_safe[:, None]
            tl.store(out_rows + 2 * QW + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty),
                     mask=direct[:, None])
            tl.store(po_rows + 2 * QW + offs_q[None, :], o, mask=split[:, None])
            o = (acc3 * INV_PV_SCALE) / l_safe[:, None]
            tl.store(out_rows + 3 * QW + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty),
                     mask=direct[:, None])
            tl.store(po_rows + 3 * QW + offs_q[None, :], o, mask=split[:, None])
        else:
            o = acc / l_safe[:, None]
            tl.store(out_rows + offs_r[None, :], to_out(o, out_ptr.dtype.element_ty), mask=direct[:, None])
            tl.store(po_rows + offs_r[None, :], o, mask=split[:, None])
        tl.store(lse_ptr + b64 * ROWS + head * SQ + tok, lse2 * LN2, mask=direct)
        tl.store(plse_ptr + p64 * ROWS + offs_m, lse2, mask=split)


def launch_decode_split(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                        split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale: float, rank: int,
                        rope_dim: int, fp8_group: int, block_m: int, block_n: int, num_warps: int,
                        num_stages: int, dot_f32: bool, fp8_prefetch: bool = True, fp8_grouped: bool = True) -> None:
    """Launch the decode (arguments checked by ``ops.decode_split``).

    Shapes: q ``[B, s_q, h, rank + rope]``; block_table int32 ``[B, max_blocks]``;
    cache_seqlens int32 ``[B]``; ctx_lens int32 ``[B, W]`` with ``W = ctx_width[0]``;
    part_info int32 ``[num_parts + 1, 3]``; num_splits / split_offsets int32 ``[B]``;
    out ``[B, s_q, h, rank]``; lse fp32 ``[B, h, s_q]``; partial_o fp32 ``[cap, s_q*h, rank]``;
    partial_lse fp32 ``[cap, s_q*h]``. FP8 caches take the grouped-dot path where
    ``fp8_grouped`` (``DecodeConfig.fp8_grouped``) and ``fp8_grouped_dots(rank, fp8_group, block_m)``
    (module doc), else the dequantise path;
    ``fp8_prefetch`` applies to both and is ignored for 16-bit caches.
    """
    B, s_q, h, _ = q.shape
    num_parts = part_info.shape[0] - 1
    m_blocks = triton.cdiv(s_q * h, block_m)
    fp8 = kv_cache.dtype == torch.uint8
    prefetch = bool(fp8_prefetch) and fp8
    grouped = fp8 and bool(fp8_grouped) and fp8_grouped_dots(rank, fp8_group, block_m)
    twin = grouped and not prefetch and num_stages >= 2 and block_m <= 32 and bool(FP8_TWIN_LOADS)
    page = kv_cache.shape[1]
    grid = (num_parts, m_blocks)
    _decode_split_kernel[grid](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse,
        block_table.shape[1], partial_o.shape[0], float(softmax_scale) * _LOG2E, s_q, h, page,
        RANK=rank, ROPE=rope_dim, GROUP=fp8_group, TOKEN_STRIDE=kv_cache.shape[-1],
        FP8=fp8, BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=dot_f32,
        # None: Triton's default precision (only fp32 operands care, and those come with DOT_F32)
        DOT_PREC="ieee" if dot_f32 else None,
        FP8_PREFETCH=prefetch, GROUPED=grouped, TWIN=twin, K_EVICT="evict_last" if twin else "",
        num_warps=num_warps, num_stages=num_stages)
