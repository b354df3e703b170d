"""Split-KV MLA decode, the portable Triton kernel (paged latent cache, grouped heads, MTP causal, FP8).

Grid ``(num_parts, m_blocks)``, fixed by static config: program ``(p, mb)`` walks the KV range
the planner gave part ``p`` (possibly the tail of one request, whole requests, and the head of
another) for query rows ``mb * BLOCK_M ...``. A query row is one (MTP token, head) pair of a
request, flattened token-major, so every head and MTP token of a request shares each loaded
latent KV tile (MLA's absorbed form: one KV row serves every head). Per tile of ``BLOCK_N`` keys::

    S   = (Q_lat @ K_lat^T + Q_rope @ K_rope^T) * scale * log2(e)
    S   = where(key visible to the row's token, S, -inf)      # bottom-right causal mask
    m'  = max(m, rowmax(S));  P = exp2(S - m');  alpha = exp2(m - m')
    l   = l * alpha + rowsum(P);  acc = acc * alpha + P @ K_lat;  m = m'

and at the end ``out = acc / l``, ``lse = (m + log2 l) * ln 2``. Each piece ends in one of two
stores, scalar branches on the request's ``nsplit``: an unsplit request writes ``out`` (q dtype)
and ``lse``; a split one its fp32 partial (normalised output, base-2 lse) for the combine. A
token with no visible key gets 0 / -inf (``l == 0`` guarded). A request without a tile in the
part stores nothing; under the interpreter (``SKIP_EMPTY``) its whole body is skipped too.

FP8 caches hold e4m3 codes ``C`` and one fp32 scale per group: ``K_lat[n, c] = C[n, c] *
sc[n, g(c)]``. Two paths (``DecodeConfig.fp8_grouped``, ``fp8_grouped_dots``):

- *dequantise*: ``C * sc`` in fp32 through a ``[BLOCK_N, groups, GROUP]`` view, cast to the q
  dtype, then the 16-bit dots;
- *grouped* (row blocks up to ``GROUPED_MAX_BLOCK_M``, 1, 2 or 4 groups): the scale is constant
  inside a group, so it moves onto the dots -- ``Q_lat K_lat^T = sum_g (Q_g C_g^T) sc[:, g]`` and
  ``(P K_lat)_g = (P sc[:, g]) C_g`` -- over the latent in four quarters (``q0..q3`` /
  ``acc0..acc3``), the codes converted exactly. With bf16 queries the dots take fp16 (one
  ``cvt`` per code pair): each q row is scaled by a power of two ``2**k``, ``k = min(0, 14 - E)``
  (``E`` its max's exponent, NaN-proof from the bits) into fp16's range and unscaled on the
  scores, and ``P * sc * 2**8`` (``PV_SCALE``, undone at the end) is rounded to fp16.

Loads: 16-bit tiles feed the dots directly and Triton pipelines them (``num_stages``). A code
tile used by both dots is not pipelined (its uses disagree on a shared layout), so pipelined
grouped configs of up to 32 rows load it twice, once per dot (*twin loads*, two eviction hints);
and where ``fp8_tma_plan`` allows (compute capability 9+, row blocks up to ``TMA_MAX_BLOCK_M``,
a tile inside one page, aligned layout) tiles come through TMA descriptors -- codes, scales and
rope boxes -- whatever their uses, the rows past ``seq_len`` zeroed after the load (``0 * NaN``
would reach ``P @ V``).

*P through memory* (``fp8_p_via_memory``: FP8 dequantise path, 64-row blocks): Triton gives a
dot whose result reaches another dot all warps along M, so both warpgroups would compute the
same ``Q K^T``; here P and alpha go through a per-program scratch slot between two barriers and
the rope dot comes first, so the QK tile is split over the warpgroups.

Per-tensor FP8 caches (fp8_e4m3: float8_e4m3fn ``[nb, page, 1, d_qk]``, ``mla_ref.fp8_tensor``)
take the 16-bit path's loads and dots (``E4M3``): each loaded key row is converted to fp32 and
multiplied by the one scale, loaded from its device pointer at the start of every launch (a
captured graph follows the engine's in-place updates), latent and rope alike.

The page size is a compile-time constant (``PAGE``: a key's page and slot are a shift and a
mask). Under the interpreter ``tl.dot`` on bf16/fp16 operands is wrong (triton #11584), so
``DOT_F32`` upcasts the operands (the same roundings applied first). Only the lines marked "key
positions -> cache slots" map keys to cache rows (the sparse decode's hook).

The Hopper kernels (``kernels/hopper/``) take most CUDA launches on sm_90 (``kernels/routes.py``);
this one runs every other launch, every other GPU and the interpreter. The measurements behind
its defaults and paths are in ``docs/kernel-performance.md``.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from .config import UNSPECIALIZED_DECODE_INTEGERS, interpreting
from .hopper.pdl import grid_wait, launch_options, pdl_on
from .rounding import to_out

try:  # host-side TMA descriptors (Triton >= 3.3; the same class in 3.6 and 3.9)
    from triton.tools.tensor_descriptor import TensorDescriptor
except Exception:  # pragma: no cover - an older Triton: the pointer path only
    TensorDescriptor = None

__all__ = ["launch_decode_split", "fp8_grouped_dots", "fp8_p_via_memory", "fp8_tma_plan", "TmaPlan",
           "GROUPED_MAX_BLOCK_M", "TMA_MAX_BLOCK_M", "P_MEM_MIN_BLOCK_M", "FP8_TMA_STAGES", "FP8_TMA_SMEM_BUDGET"]

_LOG2E = 1.4426950408889634

#: TMA pipeline depth where the config says ``num_stages=1`` (an unpipelined TMA load would wait out
#: every tile's round trip); ``num_stages >= 2`` is used as given, within ``FP8_TMA_SMEM_BUDGET``
FP8_TMA_STAGES = 3
#: shared memory the TMA path's tile buffers may take (``num_stages * block_n * bytes_per_token``; the
#: rest of the H100's 227 KiB is left for Triton's layout conversions); deeper pipelines are cut to fit
FP8_TMA_SMEM_BUDGET = 176 * 1024
#: the largest row block that takes the TMA path (1.02-1.07x at 16 rows, 0.90-0.96x at 32)
TMA_MAX_BLOCK_M = 16
#: the smallest row block that hands P through memory (a warpgroup's wgmma covers 64 rows)
P_MEM_MIN_BLOCK_M = 64
#: the largest row block that takes the grouped-dot path (at 64 rows its four accumulators spill)
GROUPED_MAX_BLOCK_M = 32


def fp8_grouped_dots(rank: int, fp8_group: int, block_m: int = 16) -> bool:
    """True when an FP8 cache of this shape can take the grouped-dot path (module doc): every
    latent quarter lies inside one scale group and is a legal ``tl.dot`` dim, and the row
    block is small enough for the per-quarter accumulators (``GROUPED_MAX_BLOCK_M``)."""
    groups = rank // fp8_group
    return groups in (1, 2, 4) and rank % 4 == 0 and rank // 4 >= 16 and block_m <= GROUPED_MAX_BLOCK_M


def fp8_p_via_memory(fp8: bool, grouped: bool, block_m: int) -> bool:
    """True when the decode hands P to the PV dot through its scratch slot (module doc, "P
    through memory"): an FP8 cache on the dequantise path in row blocks of at least
    ``P_MEM_MIN_BLOCK_M``."""
    return fp8 and not grouped and block_m >= P_MEM_MIN_BLOCK_M


@dataclass(frozen=True)
class TmaPlan:
    """The host's decision on the FP8 TMA path for one launch: ``use`` it or not, the
    ``num_stages`` to compile with when used, and why (``reason``: the first constraint
    that failed, or what was decided)."""

    use: bool
    num_stages: int
    reason: str


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple:
    return tuple(torch.cuda.get_device_capability(index))


def _device_capability(device: torch.device) -> Optional[tuple]:
    if device.type != "cuda":
        return None
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def fp8_tma_plan(kv_cache: torch.Tensor, *, rank: int, rope_dim: int, fp8_group: int, block_m: int,
                 block_n: int, num_stages: int, capability: Optional[tuple] = None) -> TmaPlan:
    """Whether the FP8 decode fetches its cache tiles through TMA descriptors (module doc,
    "TMA path"), and with how many pipeline stages. Host-side and static (shapes, strides,
    alignment, device): a captured graph's kernel choice depends only on capture-time facts.

    ``capability``: the device's compute capability; None reads it from ``kv_cache``'s device
    (None for a CPU tensor). Passing it lets tests ask what a CUDA device would get.
    Every constraint of the path is checked here; the first that fails is the ``reason``
    and the pointer path runs instead.
    """
    def no(reason: str) -> TmaPlan:
        return TmaPlan(False, num_stages, reason)

    if kv_cache.dtype != torch.uint8:
        return no("not an FP8 cache")
    if TensorDescriptor is None:
        return no("this Triton has no triton.tools.tensor_descriptor")
    cap = capability if capability is not None else _device_capability(kv_cache.device)
    if cap is None or tuple(cap) < (9, 0):
        return no(f"device without TMA (compute capability {cap})")
    if block_m > TMA_MAX_BLOCK_M:
        return no(f"block_m {block_m} > TMA_MAX_BLOCK_M {TMA_MAX_BLOCK_M}")
    if kv_cache.dim() != 3 or not kv_cache.is_contiguous():
        return no("cache not a contiguous [num_blocks, page_size, bytes_per_token] tensor")
    nb, page, token = kv_cache.shape
    ng = rank // fp8_group if fp8_group > 0 else 0
    if ng < 1 or rank % fp8_group or token != rank + 4 * ng + 2 * rope_dim:
        return no("token layout is not codes + fp32 scales + bf16 rope")
    # a tile of block_n keys must lie inside one page: tiles start at multiples of block_n
    # within a request (planner), so block_n | page_size suffices
    if page % block_n:
        return no(f"page_size {page} not a multiple of block_n {block_n}")
    if block_n > 256:
        return no(f"block_n {block_n} > 256 rows")
    if nb * page >= 2 ** 31:
        return no("more than 2**31 cache rows (TMA coordinates are int32)")
    # TMA: 16-byte aligned base, row strides of 16-byte multiples, boxes >= 16 bytes wide
    # starting at 16-byte aligned columns (the interpreter checks the same)
    if kv_cache.data_ptr() % 16:
        return no("cache base not 16-byte aligned")
    if token % 16:
        return no(f"bytes per token {token} not a multiple of 16")
    # (both code box widths are checked: the launcher picks the grouped or dequantise path)
    for what, nbytes in (("code quarter", rank // 4), ("code row", rank), ("scale row", 4 * ng),
                         ("rope row", 2 * rope_dim)):
        if nbytes < 16 or nbytes & (nbytes - 1):
            return no(f"{what} of {nbytes} bytes: a TMA box needs a power of two >= 16 bytes")
    if rank % 16 or (rank + 4 * ng) % 16:
        return no("scale or rope columns not 16-byte aligned in the token")
    stages = num_stages if num_stages >= 2 else FP8_TMA_STAGES
    fit = max(2, FP8_TMA_SMEM_BUDGET // (block_n * token))
    if stages > fit:
        return TmaPlan(True, fit, f"TMA, num_stages {stages} cut to {fit} (FP8_TMA_SMEM_BUDGET)")
    return TmaPlan(True, stages, f"TMA, num_stages {stages}")


def _fp8_tma_descriptors(kv_cache: torch.Tensor, *, rank: int, rope_dim: int, fp8_group: int, block_n: int,
                         grouped: bool) -> tuple:
    """Three descriptors over dtype views of the same cache, seen as ``[rows, token bytes]``
    (``rows = num_blocks * page_size``), each limited to its region of a token: uint8 codes
    ``[rows, rank]`` (boxes of a latent quarter on the grouped path, of the whole row on the
    dequantise path — Triton splits a box wider than the hardware's 256 elements into
    several copies), fp32 scales ``[rows, rank/4 + groups]`` (box: the row's ``groups``
    words at column ``rank/4``) and bf16 rope ``[rows, (rank + 4 groups)/2 + rope]`` (box at
    column ``(rank + 4 groups)/2``)."""
    nb, page, token = kv_cache.shape
    rows = nb * page
    ng = rank // fp8_group
    flat = kv_cache.view(rows, token)
    f32 = flat.view(torch.float32)
    b16 = flat.view(torch.bfloat16)
    codes = TensorDescriptor(flat, shape=[rows, rank], strides=[token, 1],
                             block_shape=[block_n, rank // 4 if grouped else rank])
    scales = TensorDescriptor(f32, shape=[rows, rank // 4 + ng], strides=[token // 4, 1], block_shape=[block_n, ng])
    rope = TensorDescriptor(b16, shape=[rows, (rank + 4 * ng) // 2 + rope_dim], strides=[token // 2, 1],
                            block_shape=[block_n, rope_dim])
    return codes, scales, rope


@triton.jit(do_not_specialize=UNSPECIALIZED_DECODE_INTEGERS)
def _decode_split_kernel(q_ptr, kv_ptr, bt_ptr, seq_ptr, ctx_ptr, ctxw_ptr, part_ptr, nsplit_ptr, off_ptr,
                         out_ptr, lse_ptr, po_ptr, plse_ptr, codes_desc, scales_desc, rope_desc,
                         pscr_ptr, ascr_ptr, kscale_ptr, bt_stride, partial_cap, qk_scale, SQ, H, PAGE: tl.constexpr,
                         RANK: tl.constexpr, ROPE: tl.constexpr,
                         GROUP: tl.constexpr, TOKEN_STRIDE: tl.constexpr, FP8: tl.constexpr, E4M3: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_F32: tl.constexpr,
                         DOT_PREC: tl.constexpr, GROUPED: tl.constexpr,
                         TWIN: tl.constexpr, K_EVICT: tl.constexpr, USE_TMA: tl.constexpr,
                         F16_DOTS: tl.constexpr, SKIP_EMPTY: tl.constexpr, P_MEM: tl.constexpr,
                         PDL: tl.constexpr = False):
    if PDL:  # before any read of the plan (kernels/hopper/pdl.py)
        grid_wait()
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
    # TMA path: columns of the scale words (fp32 view) and of the rope (bf16 view) in a token
    SC_COL: tl.constexpr = RANK // 4
    ROPE_COL: tl.constexpr = ROPE_OFF // 2

    b_first = tl.load(part_ptr + pid_p * 3 + 0)
    t_first = tl.load(part_ptr + pid_p * 3 + 1)
    j_first = tl.load(part_ptr + pid_p * 3 + 2)
    b_end = tl.load(part_ptr + (pid_p + 1) * 3 + 0)
    t_end = tl.load(part_ptr + (pid_p + 1) * 3 + 1)
    # the next part starting at tile 0 of b_end means this part stops before that request
    b_last = tl.where(t_end > 0, b_end, b_end - 1)
    ctx_w = tl.load(ctxw_ptr)
    if E4M3:  # read at every launch, never baked in: a replayed graph follows the engine's updates
        k_scale = tl.load(kscale_ptr)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = offs_m < ROWS
    tok = offs_m // H
    head = offs_m % H
    offs_r = tl.arange(0, RANK)
    offs_p = tl.arange(0, ROPE)
    offs_nb = tl.arange(0, BLOCK_N)
    # FP8 pointer path: tiles start at multiples of BLOCK_N within a request (planner), so when
    # BLOCK_N divides the page size a tile's keys are consecutive rows of one page -- one scalar
    # block-table load per tile and a loop-invariant per-key row offset instead of a page
    # lookup per key (H100: 1.01-1.035x for FP8 s_q=2, h=16 and h=128; 16-bit caches keep the
    # lookup, 0.97-1.01x there: h100-2026-11-26-kernel-tile-in-page-{before,after}.json)
    TILE_IN_PAGE: tl.constexpr = PAGE % BLOCK_N == 0
    row_offs = offs_nb * TOKEN_STRIDE
    offs_g = tl.arange(0, NG)
    offs_q = tl.arange(0, QW)
    ok_col = row_ok[:, None]
    m_rows = offs_m[:, None] * RANK
    if P_MEM:  # P through memory (module doc): this program's slot of the scratch buffers
        offs_ml = tl.arange(0, BLOCK_M)
        slot = tl.cast(pid_p * tl.num_programs(1) + pid_m, tl.int64)
        pscr_tile = pscr_ptr + slot * (BLOCK_M * BLOCK_N) + offs_ml[:, None] * BLOCK_N + offs_nb[None, :]
        ascr_rows = ascr_ptr + slot * BLOCK_M + offs_ml

    for b in range(b_first, b_last + 1):
        b64 = tl.cast(b, tl.int64)
        seq_len = tl.load(seq_ptr + b)
        n_tiles = (tl.maximum(seq_len, 0) + BLOCK_N - 1) // BLOCK_N
        t0 = tl.where(b == b_first, t_first, 0)
        t1 = tl.where(b == b_end, t_end, n_tiles)
        has_work = t1 > t0
        # nothing of request b in this part (an empty request, or a stale plan): it stores
        # nothing (the branches below). Under the interpreter its whole body is skipped too;
        # on the GPU that outer branch cost 5-10% at s_q=2 (module doc), so it is a
        # compile-time constant there and the body runs with no tile.
        if SKIP_EMPTY:
            run_body = has_work
        else:
            run_body = True
        if run_body:
            piece = tl.where(b == b_first, j_first, 0)
            nsplit = tl.load(nsplit_ptr + b)
            p_row = tl.load(off_ptr + b) + piece

            q_row = q_ptr + b64 * (ROWS * D) + offs_m * D
            q_rope = tl.load(q_row[:, None] + RANK + offs_p[None, :], mask=ok_col, other=0.0)
            if DOT_F32:
                q_rope = q_rope.to(tl.float32)
            if GROUPED:
                q0 = tl.load(q_row[:, None] + offs_q[None, :], mask=ok_col, other=0.0)
                q1 = tl.load(q_row[:, None] + QW + offs_q[None, :], mask=ok_col, other=0.0)
                q2 = tl.load(q_row[:, None] + 2 * QW + offs_q[None, :], mask=ok_col, other=0.0)
                q3 = tl.load(q_row[:, None] + 3 * QW + offs_q[None, :], mask=ok_col, other=0.0)
                if F16_DOTS:
                    # fp16 dots (module doc): each row times qs = 2**k, k <= 0, so that its
                    # max |q_lat| < 2**15, k from the exponent of the row max -- an integer max
                    # of the fp32 bits without the sign (NaN-proof: a NaN / inf row has exponent
                    # field 255 and gets k = -114, a zero or masked row 0 and k = 0)
                    q0 = q0.to(tl.float32)
                    q1 = q1.to(tl.float32)
                    q2 = q2.to(tl.float32)
                    q3 = q3.to(tl.float32)
                    top = tl.max(q0.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1)
                    top = tl.maximum(top, tl.max(q1.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
                    top = tl.maximum(top, tl.max(q2.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
                    top = tl.maximum(top, tl.max(q3.to(tl.int32, bitcast=True) & 0x7FFFFFFF, axis=1))
                    k_exp = tl.minimum(141 - (top >> 23), 0)  # min(0, 14 - E): 141 = 127 + 14
                    # 2**k and 2**-k built from their exponent fields (finite normals for every k)
                    qs = ((127 + k_exp) << 23).to(tl.float32, bitcast=True)[:, None]
                    lat_unscale = ((127 - k_exp) << 23).to(tl.float32, bitcast=True)[:, None]
                    q0 = (q0 * qs).to(tl.float16)
                    q1 = (q1 * qs).to(tl.float16)
                    q2 = (q2 * qs).to(tl.float16)
                    q3 = (q3 * qs).to(tl.float16)
                    if DOT_F32:  # the interpreter: the fp16 values, as fp32 dot operands
                        q0 = q0.to(tl.float32)
                        q1 = q1.to(tl.float32)
                        q2 = q2.to(tl.float32)
                        q3 = q3.to(tl.float32)
                elif DOT_F32:
                    q0 = q0.to(tl.float32)
                    q1 = q1.to(tl.float32)
                    q2 = q2.to(tl.float32)
                    q3 = q3.to(tl.float32)
                acc0 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
                acc1 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
                acc2 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
                acc3 = tl.zeros([BLOCK_M, QW], dtype=tl.float32)
            else:
                q_lat = tl.load(q_row[:, None] + offs_r[None, :], mask=ok_col, other=0.0)
                if DOT_F32:
                    q_lat = q_lat.to(tl.float32)
                acc = tl.zeros([BLOCK_M, RANK], dtype=tl.float32)
            # keys visible to each row's token: 0 for padding tokens (and tokens past the view)
            ctx = tl.load(ctx_ptr + b64 * ctx_w + tok, mask=row_ok & (tok < ctx_w), other=0)
            bt_row = bt_ptr + b64 * bt_stride

            m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
            l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
            for tile in range(t0, t1):
                offs_n = tile * BLOCK_N + offs_nb
                kv_ok = offs_n < seq_len
                # ---- this tile's keys (masked keys load as 0: codes, scales and rope)
                if FP8:
                    if USE_TMA:
                        # -- key positions -> cache rows: the tile is one box of rows of one page
                        #    (host: block_n | page_size). Its first key decides the page; the mask
                        #    only guards a stale plan (a tile past seq_len reads page 0, all masked).
                        n0 = tile * BLOCK_N
                        page_id = tl.load(bt_row + n0 // PAGE, mask=n0 < seq_len, other=0)
                        row0 = page_id * PAGE + n0 % PAGE
                        # The boxes hold every row of the tile, keys past seq_len too (the fuzzer
                        # poisons them with NaN): zero codes, scales and rope of those rows, as the
                        # pointer path's masked loads do (other=0), or 0 * NaN reaches P @ V.
                        k_rope = rope_desc.load([row0, ROPE_COL])
                        k_rope = tl.where(kv_ok[:, None], k_rope, tl.zeros_like(k_rope))
                        sc_all = scales_desc.load([row0, SC_COL])
                        sc_all = tl.where(kv_ok[:, None], sc_all, 0.0)
                        if GROUPED:
                            k0 = codes_desc.load([row0, 0])
                            k1 = codes_desc.load([row0, QW])
                            k2 = codes_desc.load([row0, 2 * QW])
                            k3 = codes_desc.load([row0, 3 * QW])
                            k0 = tl.where(kv_ok[:, None], k0, tl.zeros_like(k0))
                            k1 = tl.where(kv_ok[:, None], k1, tl.zeros_like(k1))
                            k2 = tl.where(kv_ok[:, None], k2, tl.zeros_like(k2))
                            k3 = tl.where(kv_ok[:, None], k3, tl.zeros_like(k3))
                            # quarter j's scale word: column Gj of the [BLOCK_N, NG] box (no slicing
                            # in Triton: a masked row sum over NG words)
                            sc0 = tl.sum(tl.where(offs_g[None, :] == 0, sc_all, 0.0), axis=1)
                            sc1 = tl.sum(tl.where(offs_g[None, :] == G1, sc_all, 0.0), axis=1)
                            sc2 = tl.sum(tl.where(offs_g[None, :] == G2, sc_all, 0.0), axis=1)
                            sc3 = tl.sum(tl.where(offs_g[None, :] == G3, sc_all, 0.0), axis=1)
                        else:
                            codes_now = codes_desc.load([row0, 0])
                            codes_now = tl.where(kv_ok[:, None], codes_now, tl.zeros_like(codes_now))
                    else:
                        # -- key positions -> cache slots (the sparse-decode hook: read slots from
                        #    `indices` here instead of the block table)
                        if TILE_IN_PAGE:  # one page holds the tile: one block-table entry
                            n0 = tile * BLOCK_N
                            page0 = tl.load(bt_row + n0 // PAGE, mask=n0 < seq_len, other=0)
                            kv_row = kv_ptr + (page0.to(tl.int64) * PAGE + n0 % PAGE) * TOKEN_STRIDE + row_offs
                        else:
                            pos_u = offs_n.to(tl.uint32)  # >= 0: unsigned // and % by the constant PAGE
                            page_id = tl.load(bt_row + pos_u // PAGE, mask=kv_ok, other=0)
                            kv_row = kv_ptr + (page_id.to(tl.int64) * PAGE + pos_u % PAGE) * TOKEN_STRIDE
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
                        # grouped dots: codes -> the latent q's dot dtype (exact: bf16, fp16 or
                        # fp32; fp16 with F16_DOTS), each quarter's scale on its dot result
                        k0 = k0.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                        k1 = k1.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                        k2 = k2.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                        k3 = k3.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                        if TWIN:
                            v0 = v0.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                            v1 = v1.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                            v2 = v2.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                            v3 = v3.to(tl.float8e4nv, bitcast=True).to(q0.dtype)
                        else:
                            v0 = k0
                            v1 = k1
                            v2 = k2
                            v3 = k3
                        s = tl.dot(q0, tl.trans(k0), input_precision=DOT_PREC) * sc0[None, :]
                        s += tl.dot(q1, tl.trans(k1), input_precision=DOT_PREC) * sc1[None, :]
                        s += tl.dot(q2, tl.trans(k2), input_precision=DOT_PREC) * sc2[None, :]
                        s += tl.dot(q3, tl.trans(k3), input_precision=DOT_PREC) * sc3[None, :]
                        if F16_DOTS:
                            s = s * lat_unscale  # undo the rows' 2**k (exact), before the rope
                    else:
                        # dequantise: e4m3 value times its group's scale, broadcast through a
                        # [BLOCK_N, groups, group] view (a per-element gather of the scale words was
                        # measured 2-3x slower on an H200, benchmarks/results)
                        vals = codes_now.to(tl.float8e4nv, bitcast=True).to(tl.float32)
                        if USE_TMA:
                            sc = sc_all
                        else:
                            scale_row = (kv_row + RANK).to(tl.pointer_type(tl.float32))
                            sc = tl.load(scale_row[:, None] + offs_g[None, :], mask=kv_ok[:, None], other=0.0)
                        k_lat = tl.reshape(tl.reshape(vals, (BLOCK_N, NG, GROUP)) * sc[:, :, None], (BLOCK_N, RANK))
                        k_lat = k_lat.to(q_lat.dtype)
                        if P_MEM:  # rope dot first: the latent dot's result then feeds no dot
                            s = tl.dot(q_rope, tl.trans(k_rope.to(q_rope.dtype)), input_precision=DOT_PREC)
                            s = tl.dot(q_lat, tl.trans(k_lat), s, input_precision=DOT_PREC)
                        else:
                            s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC)
                else:
                    # -- key positions -> cache slots (the sparse-decode hook: read slots from
                    #    `indices` here instead of the block table; the rest is slot-agnostic)
                    #    (a per-key lookup even when one page holds the tile: the FP8 path's
                    #    TILE_IN_PAGE shortcut measured 0.97-1.01x here on an H100)
                    pos_u = offs_n.to(tl.uint32)  # >= 0: unsigned // and % by the constant PAGE
                    page_id = tl.load(bt_row + pos_u // PAGE, mask=kv_ok, other=0)
                    kv_row = kv_ptr + (page_id.to(tl.int64) * PAGE + pos_u % PAGE) * TOKEN_STRIDE
                    # -- one latent KV row per key, shared by every query row of the program;
                    #    these loads feed the dots directly and Triton pipelines them (num_stages).
                    #    (Inlined rather than helpers: the interpreter re-patches triton.language
                    #    on every nested jit call, ~10 ms each.)
                    k_lat = tl.load(kv_row[:, None] + offs_r[None, :], mask=kv_ok[:, None], other=0.0)
                    k_rope = tl.load(kv_row[:, None] + RANK + offs_p[None, :], mask=kv_ok[:, None], other=0.0)
                    if E4M3:
                        # per-tensor FP8 (fp8_e4m3): e4m3 -> fp32 (exact) times the one scale, the
                        # reference's fp32 product; then the 16-bit path's roundings
                        k_lat = k_lat.to(tl.float32) * k_scale
                        k_rope = k_rope.to(tl.float32) * k_scale
                    k_lat = k_lat.to(q_lat.dtype)
                    s = tl.dot(q_lat, tl.trans(k_lat), input_precision=DOT_PREC)
                if not P_MEM:
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
                    # (P * sc_j) @ C_j, P * sc_j rounded to the codes' dot dtype (x 2**8, see
                    # PV_SCALE); with F16_DOTS to fp16 (under the interpreter: and back to fp32)
                    pw = p * (sc0 * PV_SCALE)[None, :]
                    if F16_DOTS:
                        pw = pw.to(tl.float16)
                    pv = tl.dot(pw.to(v0.dtype), v0, input_precision=DOT_PREC)
                    acc0 = acc0 * alpha[:, None] + pv
                    pw = p * (sc1 * PV_SCALE)[None, :]
                    if F16_DOTS:
                        pw = pw.to(tl.float16)
                    pv = tl.dot(pw.to(v1.dtype), v1, input_precision=DOT_PREC)
                    acc1 = acc1 * alpha[:, None] + pv
                    pw = p * (sc2 * PV_SCALE)[None, :]
                    if F16_DOTS:
                        pw = pw.to(tl.float16)
                    pv = tl.dot(pw.to(v2.dtype), v2, input_precision=DOT_PREC)
                    acc2 = acc2 * alpha[:, None] + pv
                    pw = p * (sc3 * PV_SCALE)[None, :]
                    if F16_DOTS:
                        pw = pw.to(tl.float16)
                    pv = tl.dot(pw.to(v3.dtype), v3, input_precision=DOT_PREC)
                    acc3 = acc3 * alpha[:, None] + pv
                else:
                    if P_MEM:
                        # P and alpha through this program's scratch slot (module doc, "P through
                        # memory"): nothing the PV dot reads derives from the QK dot's result, so
                        # Triton splits the QK tile's keys over the two warpgroups instead of
                        # computing it twice
                        tl.store(pscr_tile, p.to(k_lat.dtype))
                        tl.store(ascr_rows, alpha)
                        tl.debug_barrier()
                        p_op = tl.load(pscr_tile)
                        alpha_op = tl.load(ascr_rows)
                        tl.debug_barrier()  # every warp has read the slot before the next tile's store
                    else:
                        p_op = p.to(k_lat.dtype)
                        alpha_op = alpha
                    pv = tl.dot(p_op, k_lat, input_precision=DOT_PREC)
                    acc = acc * alpha_op[:, None] + pv
                m_i = m_new

            has_keys = l_i > 0.0
            l_safe = tl.where(has_keys, l_i, 1.0)
            lse2 = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
            l_col = l_safe[:, None]
            # one of two stores, on the request's uniform nsplit (module doc)
            if has_work & (nsplit == 1):
                # not split: the final out (q dtype, RNE) and the natural-log lse
                out_rows = out_ptr + b64 * (ROWS * RANK) + m_rows
                if GROUPED:
                    o = (acc0 * INV_PV_SCALE) / l_col
                    tl.store(out_rows + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty), mask=ok_col)
                    o = (acc1 * INV_PV_SCALE) / l_col
                    tl.store(out_rows + QW + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty), mask=ok_col)
                    o = (acc2 * INV_PV_SCALE) / l_col
                    tl.store(out_rows + 2 * QW + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty), mask=ok_col)
                    o = (acc3 * INV_PV_SCALE) / l_col
                    tl.store(out_rows + 3 * QW + offs_q[None, :], to_out(o, out_ptr.dtype.element_ty), mask=ok_col)
                else:
                    o = acc / l_col
                    tl.store(out_rows + offs_r[None, :], to_out(o, out_ptr.dtype.element_ty), mask=ok_col)
                tl.store(lse_ptr + b64 * ROWS + head * SQ + tok, lse2 * LN2, mask=row_ok)
            elif has_work & (nsplit > 1) & (p_row < partial_cap):
                # split: this piece's fp32 partial (normalised output, base-2 lse) for combine
                p64 = p_row.to(tl.int64)
                po_rows = po_ptr + p64 * (ROWS * RANK) + m_rows
                if GROUPED:
                    tl.store(po_rows + offs_q[None, :], (acc0 * INV_PV_SCALE) / l_col, mask=ok_col)
                    tl.store(po_rows + QW + offs_q[None, :], (acc1 * INV_PV_SCALE) / l_col, mask=ok_col)
                    tl.store(po_rows + 2 * QW + offs_q[None, :], (acc2 * INV_PV_SCALE) / l_col, mask=ok_col)
                    tl.store(po_rows + 3 * QW + offs_q[None, :], (acc3 * INV_PV_SCALE) / l_col, mask=ok_col)
                else:
                    tl.store(po_rows + offs_r[None, :], acc / l_col, mask=ok_col)
                tl.store(plse_ptr + p64 * ROWS + offs_m, lse2, mask=row_ok)


def launch_decode_split(q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits,
                        split_offsets, out, lse, partial_o, partial_lse, *, softmax_scale: float, rank: int,
                        rope_dim: int, fp8_group: int, block_m: int, block_n: int, num_warps: int,
                        num_stages: int, dot_f32: bool, fp8_grouped: bool = True,
                        k_scale: Optional[torch.Tensor] = None) -> None:
    """Launch this kernel (arguments checked by ``ops.decode_split``; ``routes.launch_decode``
    calls it for the launches no Hopper kernel takes).

    Shapes: q ``[B, s_q, h, rank + rope]``; block_table int32 ``[B, max_blocks]``;
    cache_seqlens int32 ``[B]``; ctx_lens int32 ``[B, W]`` with ``W = ctx_width[0]``;
    part_info int32 ``[num_parts + 1, 3]``; num_splits / split_offsets int32 ``[B]``;
    out ``[B, s_q, h, rank]``; lse fp32 ``[B, h, s_q]``; partial_o fp32 ``[cap, s_q*h, rank]``;
    partial_lse fp32 ``[cap, s_q*h]``. An FP8 cache takes the grouped-dot path where
    ``fp8_grouped`` (``DecodeConfig.fp8_grouped``) and ``fp8_grouped_dots`` allow it, with fp16
    dots for bf16 queries, else the dequantise path (module doc); its tiles come through TMA
    descriptors where ``fp8_tma_plan`` allows it (compiled with the plan's ``num_stages``), else
    by pointer loads, twice on the grouped path when pipelined (twin loads); where
    ``fp8_p_via_memory`` holds the launcher allocates the scratch slots P and alpha go through.
    ``dot_f32`` (the interpreter, fp32 queries): fp32 dot operands, the same roundings.
    An fp8_e4m3 cache (float8_e4m3fn ``[nb, page, 1, d_qk]``) takes the 16-bit path with
    ``k_scale`` (fp32 ``[1]``) loaded in the kernel.
    """
    B, s_q, h, _ = q.shape
    num_parts = part_info.shape[0] - 1
    m_blocks = triton.cdiv(s_q * h, block_m)
    fp8 = kv_cache.dtype == torch.uint8
    e4m3 = kv_cache.dtype == torch.float8_e4m3fn
    if e4m3 and k_scale is None:
        raise ValueError("an fp8_e4m3 cache needs k_scale (fp32 [1] on its device)")
    grouped = fp8 and bool(fp8_grouped) and fp8_grouped_dots(rank, fp8_group, block_m)
    tma = fp8_tma_plan(kv_cache, rank=rank, rope_dim=rope_dim, fp8_group=fp8_group, block_m=block_m,
                       block_n=block_n, num_stages=num_stages) if fp8 else None
    use_tma = tma is not None and tma.use
    if use_tma:
        descs = _fp8_tma_descriptors(kv_cache, rank=rank, rope_dim=rope_dim, fp8_group=fp8_group,
                                     block_n=block_n, grouped=grouped)
        num_stages = tma.num_stages
    else:
        descs = (kv_cache, kv_cache, kv_cache)  # placeholders: the pointer path never reads them
    f16_dots = grouped and q.dtype == torch.bfloat16
    twin = grouped and not use_tma and num_stages >= 2 and block_m <= 32
    page = kv_cache.shape[1]
    pdl = pdl_on(q)
    grid = (num_parts, m_blocks)
    p_mem = fp8_p_via_memory(fp8, grouped, block_m)
    if p_mem:
        # one slot per program, never read across launches (written before read in every
        # tile), so a fresh buffer per launch is safe under graph capture too; P in the dot
        # operand dtype (fp32 with dot_f32)
        p_dtype = torch.float32 if dot_f32 else q.dtype
        pscr = torch.empty(num_parts * m_blocks * block_m * block_n, dtype=p_dtype, device=q.device)
        ascr = torch.empty(num_parts * m_blocks * block_m, dtype=torch.float32, device=q.device)
    else:
        pscr = ascr = lse  # placeholders: never read
    _decode_split_kernel[grid](
        q, kv_cache, block_table, cache_seqlens, ctx_lens, ctx_width, part_info, num_splits, split_offsets,
        out, lse, partial_o, partial_lse, *descs, pscr, ascr, k_scale if e4m3 else lse,
        block_table.shape[1], partial_o.shape[0], float(softmax_scale) * _LOG2E, s_q, h, PAGE=page,
        RANK=rank, ROPE=rope_dim, GROUP=fp8_group, TOKEN_STRIDE=kv_cache.shape[-1],
        FP8=fp8, E4M3=e4m3, BLOCK_M=block_m, BLOCK_N=block_n, DOT_F32=dot_f32,
        # None: Triton's default precision (only fp32 operands care, and those come with DOT_F32)
        DOT_PREC="ieee" if dot_f32 else None,
        GROUPED=grouped, TWIN=twin, K_EVICT="evict_last" if twin else "",
        USE_TMA=use_tma, F16_DOTS=f16_dots, SKIP_EMPTY=interpreting(),
        P_MEM=p_mem, PDL=pdl, num_warps=num_warps, num_stages=num_stages, **launch_options(pdl))
